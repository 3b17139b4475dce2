from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


# --- CPU tests on a machine with a GPU, and the gpu-marked tests ------------------------------------------------
#
# On a machine with CUDA, `load_policy` puts a model on the GPU in half precision and the peak-memory probe reads
# CUDA's counters, so a test written for the CPU asserts the wrong thing there. Every test not marked `gpu` runs
# with torch seeing no CUDA device; a `gpu` test runs only where there is one.

_CUDA = {"found": False}  # whether torch saw a CUDA device when the session started, before any test hid it


# --- in parallel (pytest-xdist), and the tests that need the machine to themselves ------------------------------
#
# `make test` runs the suite twice: `pytest -n auto --serial=skip` spreads the tests over one worker process per
# core, then `pytest --serial=only` runs the `serial` ones alone, one after another. A test is `serial` when what it
# asserts depends on having the cores to itself: it times itself against a bound, or it claims torch's default
# thread count. Plain `pytest` (--serial=all) runs everything in one process, as before.

def pytest_addoption(parser) -> None:
    parser.addoption("--serial", choices=("all", "skip", "only"), default="all",
                     help="the tests marked serial: run them with the rest (all), leave them out (skip: the "
                          "parallel run), or run only them (only: the run after it).")


def pytest_configure(config) -> None:
    # A worker's share of the cores: each of N workers left at torch's default (every core) would run N x cores
    # threads on the cores, which thrash (see `one_thread` below). Subprocesses a test starts inherit the share.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        share = max(1, len(os.sched_getaffinity(0)) // workers) if hasattr(os, "sched_getaffinity") else 1
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)


def _select_serial(config, items) -> None:
    mode = config.getoption("--serial")
    if mode == "all":
        return
    wanted = mode == "only"
    keep = [item for item in items if (item.get_closest_marker("serial") is not None) == wanted]
    dropped = [item for item in items if (item.get_closest_marker("serial") is not None) != wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collection_modifyitems(config, items) -> None:
    _select_serial(config, items)
    # The real answer, read once before any test runs. It also fixes the driver's device count for the process
    # (CUDA reads CUDA_VISIBLE_DEVICES once, at its first query), so the empty value the CPU tests set below for
    # their subprocesses cannot hide the device from the gpu tests that come after them.
    _CUDA["found"] = torch.cuda.is_available()
    if _CUDA["found"]:
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device, and torch sees none on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session) -> None:
    """What the imports and the collection created (torch, transformers, plotly, the test modules: hundreds of
    thousands of objects) is moved out of the garbage collector's reach for the session (`gc.freeze`). Every rollout
    runs a full collection, twice on the CB path (cbkit's `PeakMemory` for a clean baseline, transformers'
    `ContinuousBatchProcessor.__del__` when the engine stops), and each scanned all of it: 0.16 s a collection in a
    process that imports them (328,699 objects), microseconds frozen; test_it_learns_with_cb_rollouts took 17.0 s
    without this, 10.2 s with it. What a test creates is collected as before; only module-level objects are frozen."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Hide CUDA from every test not marked `gpu`, from its setup to its teardown.

    A hook around the whole test rather than an autouse fixture: pytest sets fixtures up by scope, session first,
    so a function-scoped autouse fixture would come after the session's `tiny` and a module's own model fixture,
    which would already sit on the GPU. Here every fixture a CPU test creates is created with CUDA hidden."""
    if item.get_closest_marker("gpu") is not None or not _CUDA["found"]:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        _hide_cuda(mp)
        yield
    _forget_cuda_answers()  # what transformers cached while CUDA was hidden


def _hide_cuda(mp: pytest.MonkeyPatch) -> None:
    """torch answers "no CUDA" (cbkit, accelerate and transformers all ask `torch.cuda.is_available()`), and a
    subprocess the test starts (they all inherit os.environ) sees no device at all."""
    mp.setattr(torch.cuda, "is_available", lambda: False)
    mp.setattr(torch.cuda, "device_count", lambda: 0)
    mp.setenv("CUDA_VISIBLE_DEVICES", "")
    _forget_cuda_answers()


def _forget_cuda_answers() -> None:
    """transformers caches its answers about CUDA for the process (functools.lru_cache): clear them whenever the
    answer changes, so a CPU test does not read a GPU test's answer, nor the other way round."""
    from transformers.utils import import_utils

    for name in ("is_torch_cuda_available", "is_torch_bf16_gpu_available", "is_torch_fp16_available_on_device",
                 "is_torch_bf16_available_on_device", "is_torch_tf32_available"):
        getattr(getattr(import_utils, name, None), "cache_clear", lambda: None)()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Each test's call cut at $CBKIT_TEST_TIMEOUT_S seconds (scripts/gpu_check.sh sets it), failing with its name:
    pytest-timeout is not on every GPU image, and a test waiting on a stuck engine (the async test may wait 5 x
    120 s) must not take a whole device call. SIGALRM interrupts a wait on a lock or a queue in the main thread; a
    CUDA call blocked in C returns first, so the script's `timeout` stays the outer limit."""
    import signal
    import threading

    limit = float(os.environ.get("CBKIT_TEST_TIMEOUT_S") or 0)
    if limit <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past CBKIT_TEST_TIMEOUT_S={limit:g} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def gsm8k_dir() -> Path | None:
    """The offline GSM8K copy: $CBKIT_GSM8K_DIR, else ../shared/data/gsm8k beside the checkout."""
    for d in (os.environ.get("CBKIT_GSM8K_DIR"), REPO.parent / "shared" / "data" / "gsm8k"):
        if d and (Path(d) / "test.jsonl").is_file():
            return Path(d)
    return None


@pytest.fixture(scope="session")
def tiny():
    from cbkit.models.load import load_policy

    return load_policy("tiny", seed=0, device="cpu")  # the CPU tests' model, whichever test creates it first


@pytest.fixture(scope="session")
def smollm2():
    from cbkit.models.load import load_policy

    try:
        return load_policy("smollm2-offline", device="cpu")
    except ModuleNotFoundError as e:  # the README's install always brings it; say so if it is missing
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def gsm8k_test_path() -> Path:
    d = gsm8k_dir()
    if d is None:
        pytest.skip("GSM8K test.jsonl not found (set CBKIT_GSM8K_DIR or place ../shared/data/gsm8k beside the repo)")
    return d / "test.jsonl"


def _written_in_the_checkout() -> dict[str, tuple[int, int]]:
    """Every file under the repository's runs/ and every untracked, not ignored file, with its size and mtime."""
    import subprocess

    found = {str(p.relative_to(REPO)): p for p in (REPO / "runs").rglob("*") if p.is_file()}
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                             capture_output=True, text=True, timeout=60).stdout
        found |= {line[3:]: REPO / line[3:] for line in out.splitlines() if line.startswith("?? ")}
    except (OSError, subprocess.SubprocessError):  # not a git checkout: runs/ alone
        pass
    return {k: (p.stat().st_size, p.stat().st_mtime_ns) for k, p in found.items() if p.is_file()}


@pytest.fixture(scope="session", autouse=True)
def _leave_the_checkout_alone(request):
    """Tests write under a temporary folder only: a test that writes into the checkout (runs/ above all, where
    `make sweep` keeps its results) fails the run here, naming the files."""
    before = _written_in_the_checkout()
    yield
    after = _written_in_the_checkout()
    # The folders a make target or scripts/gpu_check.sh names for its artefacts (executed notebooks' HTML and
    # screenshots, the book, the GPU check's state, where this session's own log grows) are written on purpose;
    # anything else in the checkout is a test that forgot tmp_path.
    allowed = [Path(os.environ[v]).resolve() for v in ("CBKIT_EXECUTED_NOTEBOOKS", "CBKIT_BOOK", "CBKIT_GPU_CHECK_DIR")
               if os.environ.get(v)]
    # A notebook this run collected (`make test` runs them through nbmake beside the tests) is executed in place.
    allowed += {Path(item.path).resolve().parent for item in request.session.items if Path(item.path).suffix == ".ipynb"}
    written = sorted(k for k, v in after.items() if before.get(k) != v
                     and not any((REPO / k).resolve().is_relative_to(a) for a in allowed))
    assert not written, f"tests wrote into the checkout (write under tmp_path instead): {written}"


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _short_roofline_probes(monkeypatch):
    """The sweep probes the machine's two roofs before each N, each for a fixed time (about 3 s: every probe shape
    three rounds of 0.25 s, three reads of 256 MiB). The tests assert what the sweep does with a probe's answer, not
    the roof's value, so here a probe runs one short round: an argument a test passes still wins, and the tests of
    the probes themselves (tests/test_sweep.py) pass theirs. A test that replaces a probe replaces this one."""
    import functools

    from cbkit.measure import roofline

    monkeypatch.setattr(roofline, "matmul_probe", functools.partial(roofline.matmul_probe, rows=(64,),
                                                                     min_seconds=0.01, rounds=1))
    monkeypatch.setattr(roofline, "bandwidth_probe", functools.partial(roofline.bandwidth_probe, nbytes=8 * 2**20,
                                                                       min_seconds=0.01, rounds=1))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: two OpenMP threads on a 2-core machine shared with other jobs thrash (the tiny
    model ran ~30x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
