"""A sweep killed mid-write leaves a torn last line: resume and `cbkit report` keep working, other damage is named."""

from __future__ import annotations

import json

import pytest

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
