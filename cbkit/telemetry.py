"""Measuring a rollout: peak memory, KV bytes, and the engine's occupancy over time.

On CUDA the peak is `max_memory_allocated` after `reset_peak_memory_stats`. On CPU it is the process's RSS
high-water mark above the baseline at the start: on Linux the kernel's own VmHWM, reset at the start (exact, and no
thread of ours beside the code measured); elsewhere a poller thread sampling RSS every 5 ms. RSS counts allocator
slack: compare backends side by side in one process, never across machines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    # typing.Self is 3.11+; the kit supports 3.10, where importing it at run time fails.
    from typing_extensions import Self


def return_freed_memory_to_os() -> None:
    """Hand glibc's freed heap back, so every run's RSS rises from the same floor."""
    import contextlib
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS figures are then only looser
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (what `release_memory` brings back down)."""
    return rss_reader()()


def release_memory(model: torch.nn.Module | None = None) -> None:
    """Collect what no longer has a reference (a trainer and its cycles), drop `model`'s gradients and hand the freed
    heap back, so resident memory falls to what is still held (a notebook, between sections)."""
    import gc

    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    return_freed_memory_to_os()


def rss_reader() -> Callable[[], int]:
    """A function returning this process's resident set size in bytes: psutil where installed, else Linux's
    ``/proc/self/statm`` (what psutil reads there too), so the bare install measures the same way."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        proc = psutil.Process()
        return lambda: proc.memory_info().rss
    statm = Path("/proc/self/statm")
    if statm.is_file():
        import os

        page = os.sysconf("SC_PAGE_SIZE")
        return lambda: int(statm.read_text().split()[1]) * page
    raise ModuleNotFoundError(
        "Measuring CPU memory needs psutil on this operating system (no /proc/self/statm): pip install psutil"
    )


_STATUS = Path("/proc/self/status")
_peak_before_resets = 0  # what PeakMemory's resets of the kernel's one counter discarded (process_peak_rss)


def _reset_high_water_mark() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False where that is not possible."""
    global _peak_before_resets
    _peak_before_resets = max(_peak_before_resets, _high_water_mark())
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _high_water_mark() > 0
    except OSError:
        return False


def _high_water_mark() -> int:
    """This process's peak RSS in bytes since the last reset (Linux's VmHWM), 0 where unknown."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_peak_rss() -> int:
    """This process's peak RSS in bytes since it started (0 where unknown): VmHWM and what PeakMemory's resets
    discarded, or getrusage's ru_maxrss where there is no /proc."""
    if hwm := _high_water_mark():
        return max(_peak_before_resets, hwm)
    try:
        import resource
        import sys
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


class PeakMemory:
    """Context manager: peak memory used by the code inside it, above what was in use when it started."""

    def __init__(self, device: torch.device | str | None = None, interval_s: float = 0.005) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.interval_s = interval_s
        self.peak_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None
        self.kind: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._baseline = 0
        self._peak_rss = 0
        self._hwm = False  # whether the kernel's high-water mark is used instead of polling

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            self.kind = "cuda_allocated"
        else:
            return_freed_memory_to_os()
            self._rss = rss_reader()
            self._baseline = self._peak_rss = self._rss()
            # Linux keeps the exact high-water mark: no poller then competes for the GIL (lab/cpu_results.md).
            self._hwm = _reset_high_water_mark()
            if not self._hwm:
                self._thread = threading.Thread(target=self._poll, daemon=True)
                self._thread.start()
            self.kind = "cpu_rss"
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak_rss = max(self._peak_rss, self._rss())

    def synchronize(self) -> None:
        """Wait for queued device work, so clocks read after this include it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
            self.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        else:
            if self._thread is not None:
                self._stop.set()
                self._thread.join()
            self._peak_rss = max(self._peak_rss, self._rss(), _high_water_mark() if self._hwm else 0)
            self.peak_bytes = self._peak_rss - self._baseline


def cuda_peaks(device: torch.device | str) -> dict[str, int]:
    """Right after a measured call: the allocator's peak reserved bytes since `PeakMemory` reset the counters, and
    the device's used bytes now (what nvidia-smi shows), without NVML bindings. Empty on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)), "device_used_bytes": int(total - free)}


def nvml_process_bytes(device_index: int = 0) -> int | None:
    """GPU memory this process holds according to the driver (CUDA context and allocator slack included); None
    without `nvidia-ml-py` or a GPU."""
    try:
        import os

        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory) if p.usedGpuMemory is not None else None
        return None
    except Exception:  # NVML errors mean "not available here", never a failed measurement
        return None


def fmt_bytes(n: int | float | None) -> str:
    """Bytes in binary units, 2 decimals: "1.50 GiB"; None is "n/a"."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ModelShape:
    """A model's shape, read from its transformers config in this one place (every KV, FLOP and memory count starts
    here): a multimodal config's text model, GQA's KV heads, ``head_dim``, the MLP's width."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Self:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        hidden = getattr(config, "hidden_size", 0)
        return cls(config.num_hidden_layers, heads, kv_heads, head_dim, hidden,
                   getattr(config, "intermediate_size", None) or 4 * hidden, getattr(config, "vocab_size", 0))


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V one token occupies across all layers: layers x 2 x kv heads x head dim x dtype."""
    s = ModelShape.of(config)
    return s.layers * 2 * s.kv_heads * s.head_dim * dtype_bytes


def kv_accounting(rollout, config, dtype_bytes: int) -> dict[str, float | int | None]:
    """Analytic KV bytes of a rollout and, for the static batch, the share of computed slots that were padding.

    generate: the cache holds every row at the padded length until the last row finishes:
        rows x (longest prompt + decode steps) x bytes/token -- allocated whether a row finished or not.
    continuous: the pool the engine allocated, num_blocks x page_size x bytes/token, whatever is in use.
    """
    per_token = kv_bytes_per_token(config, dtype_bytes)
    cfg = rollout.engine_config
    useful = sum(len(c.prompt_ids) + len(c.completion_ids) for c in rollout.completions)
    if rollout.backend == "generate":
        slots = cfg["batch_rows"] * (cfg["padded_prompt_len"] + cfg["steps"])
        return {"kv_bytes": slots * per_token, "kv_bytes_per_token": per_token, "token_slots": slots,
                "kv_padding_share": 1 - useful / slots}
    if "num_blocks" in cfg and "page_size" in cfg:
        return {"kv_bytes": cfg["num_blocks"] * cfg["page_size"] * per_token, "kv_bytes_per_token": per_token,
                "token_slots": cfg["num_blocks"] * cfg["page_size"], "kv_padding_share": 0.0}
    return {"kv_bytes": None, "kv_bytes_per_token": per_token, "token_slots": None, "kv_padding_share": None}


def occupancy(timeline: Mapping[str, Any]) -> dict[str, Any]:
    """Sequences running and KV blocks held by running requests over time, from per-request start, end and token
    times: a request holds ceil((prompt + generated) / page_size) blocks until it ends; with prefix sharing a
    prompt's complete pages are held once per group, from its first start to its last end. Blocks the engine keeps
    cached after a request ends are not counted (it evicts them under pressure)."""
    page = timeline["page_size"]
    t0 = timeline["t0"]
    sharing = bool(timeline.get("prefix_sharing", False))
    events: list[tuple[float, int, int]] = []  # (time, d_running, d_blocks)
    groups: dict[int, list[dict]] = {}
    for r in timeline["requests"]:
        groups.setdefault(r["group"], []).append(r)
    shared_by_group = {}
    for g, rs in groups.items():
        shared = min(r["prompt_len"] for r in rs) // page if sharing else 0
        shared_by_group[g] = shared
        if shared:
            events.append((min(r["start"] for r in rs), 0, shared))
            events.append((max(r["end"] for r in rs), 0, -shared))
    for r in timeline["requests"]:
        shared = shared_by_group[r["group"]]
        held = -(-r["prompt_len"] // page) - shared
        events.append((r["start"], 1, held))
        for k, token_time in enumerate(r["token_times"], start=1):
            need = -(-(r["prompt_len"] + k) // page) - shared
            if need > held:
                events.append((token_time, 0, need - held))
                held = need
        events.append((r["end"], -1, -held))
    events.sort(key=lambda e: (e[0], -e[1]))
    t: list[float] = []
    running: list[int] = []
    blocks: list[int] = []
    run = blk = 0
    for when, d_run, d_blk in events:
        run += d_run
        blk += d_blk
        if t and t[-1] == when - t0:
            running[-1], blocks[-1] = run, blk
        else:
            t.append(when - t0)
            running.append(run)
            blocks.append(blk)
    return {"t": t, "running": running, "blocks_in_use": blocks, "pool_blocks": timeline.get("pool_blocks", 0)}


def seconds_since(start: float, device: torch.device) -> float:
    """Wall seconds since `start` (`time.perf_counter`), once this thread's stream on `device` has run (an async
    engine's kernels on its own stream are not counted)."""
    import time

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter() - start
