"""A sweep killed mid-write leaves a torn last line: resume and `cbkit report` keep working, other damage is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbkit.cli import main
from cbkit.measure.results import ResultsFile, load_runs

FINGERPRINT = {"model": "tiny", "max_new_tokens": 8}


def _run(n: int) -> dict:
    return {"kind": "run", "backend": "generate", "N": n, "repeat": 0, "status": "ok"}


def _write(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_a_torn_last_line_is_dropped_with_a_warning_and_cut_before_the_next_append(tmp_path):
    path = tmp_path / "sweep.jsonl"
    header = {"kind": "header", "fingerprint": FINGERPRINT}
    _write(path, [header, _run(1)], tail='{"kind": "run", "backend": "contin')  # killed inside json.dumps' output
    with pytest.warns(UserWarning, match=r"sweep.jsonl, line 3: dropped a torn last line"):
        assert load_runs(path) == [_run(1)]
    with pytest.warns(UserWarning, match="torn last line"):
        results = ResultsFile(path, FINGERPRINT)
    assert results.runs == [_run(1)] and not results.done("continuous", 1, 0)
    results.add(_run(2))
    assert [json.loads(line) for line in path.read_text().splitlines()] == [header, _run(1), _run(2)]


def test_any_other_unreadable_line_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "sweep.jsonl"
    header = {"kind": "header", "fingerprint": FINGERPRINT}
    path.write_text(json.dumps(header) + "\n" + '{"kind": "run", "N": 1,,}\n' + json.dumps(_run(2)) + "\n")
    with pytest.raises(ValueError, match=r"sweep.jsonl, line 2: not a JSON record .*Fix or delete that line"):
        load_runs(path)
    with pytest.raises(ValueError, match="line 2"):
        ResultsFile(path, FINGERPRINT)


# --- `cbkit report` on a damaged file -------------------------------------------------------------------------------

SWEEP_FILE = Path(__file__).parent.parent / "lab" / "results" / "cpu-replay.jsonl"


def test_report_reads_a_real_sweep_file_with_a_torn_last_line(tmp_path, capsys):
    """lab/results/cpu-replay.jsonl, a real sweep's file, cut inside its last run line: `cbkit report` still prints
    every finished run, and warns about the torn line instead of failing."""
    lines = SWEEP_FILE.read_text().splitlines(keepends=True)
    runs_in_file = [json.loads(x) for x in lines if json.loads(x)["kind"] == "run"]
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    with pytest.warns(UserWarning, match="torn last line"):
        assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out
    kept = runs_in_file[:-1]
    with pytest.warns(UserWarning, match="torn last line"):
        runs = load_runs(path)
    assert [(r["backend"], r["N"]) for r in runs] == [(r["backend"], r["N"]) for r in kept]
    assert [r["decode_padding_share"] for r in runs] == [r["decode_padding_share"] for r in kept]
    csv = path.with_suffix(".csv").read_text().splitlines()
    assert len(csv) == 1 + len({(r["backend"], r["N"]) for r in kept})  # a header and one row per point


@pytest.mark.parametrize(("content", "said"), [("", "is empty: no header line and no runs"),
                                                ("\n\n", "is empty: no header line and no runs"),
                                                ('{"kind": "run", "N": 1}\n', "not a cbkit sweep results file")])
def test_report_on_an_empty_or_foreign_file_says_what_is_wrong(tmp_path, capsys, content, said):
    path = tmp_path / "sweep.jsonl"
    path.write_text(content)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert said in err and str(path) in err and "Traceback" not in err
