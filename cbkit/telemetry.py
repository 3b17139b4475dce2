"""Measuring a rollout: peak memory above a baseline (on Linux CPUs the kernel's high-water mark, reset at the start,
so no thread of ours runs beside the code measured), analytic KV bytes, byte formatting."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; the kit supports 3.10


def _status_bytes(field: str) -> int:
    """A field of Linux's /proc/self/status in bytes (VmRSS: resident now; VmHWM: peak since reset), else 0."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def resident_bytes() -> int:
    """This process's resident memory now, in bytes: Linux's VmRSS, else psutil's count."""
    if rss := _status_bytes("VmRSS"):
        return rss
    try:
        import psutil
    except ImportError:
        raise ModuleNotFoundError("Measuring memory here needs psutil: pip install psutil") from None
    return psutil.Process().memory_info().rss


def release_memory(model: torch.nn.Module | None = None) -> None:
    """Drop ``model``'s gradients, collect garbage and give glibc's freed heap back, so RSS falls to what is held."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # no glibc: RSS figures are only looser
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_peak_before_resets = 0  # the VmHWM that PeakMemory's resets of the kernel's one counter discarded


def process_peak_rss() -> int:
    """This process's peak RSS in bytes since it started, across PeakMemory's resets (Linux; 0 elsewhere)."""
    return max(_peak_before_resets, _status_bytes("VmHWM"))


class PeakMemory:
    """Context manager: ``peak_bytes``, the peak memory the code inside it used above what was in use when it
    started; ``kind``, what was measured (``cuda_allocated`` or ``cpu_rss``)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device or "cpu")
        self.kind = "cuda_allocated" if self.device.type == "cuda" else "cpu_rss"
        self.peak_bytes: int | None = None
        self._poller: threading.Thread | None = None  # where the kernel keeps no resettable high-water mark
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        global _peak_before_resets
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            return self
        release_memory()
        self._baseline = self._peak = resident_bytes()
        _peak_before_resets = process_peak_rss()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := the current RSS
        except OSError:
            self._poller = threading.Thread(target=self._poll, daemon=True)
            self._poller.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, resident_bytes())

    def synchronize(self) -> None:
        """Wait for queued device work, so clocks read after this include it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._baseline
            return
        if self._poller is not None:
            self._stop.set()
            self._poller.join()
        else:
            self._peak = max(self._peak, _status_bytes("VmHWM"))
        self.peak_bytes = max(self._peak, resident_bytes()) - self._baseline


def cuda_peaks(device: torch.device | str) -> dict[str, int]:
    """The allocator's peak reserved bytes and the device's used bytes now (what nvidia-smi shows); {} on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "device_used_bytes": int(total - free)}


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
    """A model's shape, read from its transformers config in this one place (a multimodal config's text model)."""

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


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Bytes of K and V one token occupies across all layers: layers x 2 x kv heads x head dim x dtype."""
    s = ModelShape.of(config)
    return s.layers * 2 * s.kv_heads * s.head_dim * dtype_bytes


def kv_accounting(rollout: Any, config: Any, dtype_bytes: int) -> dict[str, float | None]:
    """A rollout's analytic KV bytes: generate() holds every row at the padded length until the last row
    finishes (``kv_padding_share``: the share of those slots that held padding); CB, the pool it allocated."""
    per_token = kv_bytes_per_token(config, dtype_bytes)
    cfg = rollout.engine_config
    if rollout.backend == "generate":
        slots = cfg["batch_rows"] * (cfg["padded_prompt_len"] + cfg["steps"])
        useful = sum(len(c.prompt_ids) + len(c.completion_ids) for c in rollout.completions)
        return {"kv_bytes": slots * per_token, "kv_padding_share": 1 - useful / slots}
    if "num_blocks" in cfg and "page_size" in cfg:
        return {"kv_bytes": cfg["num_blocks"] * cfg["page_size"] * per_token, "kv_padding_share": 0.0}
    return {"kv_bytes": None, "kv_padding_share": None}


def seconds_since(start: float, device: torch.device) -> float:
    """Wall seconds since ``start`` (`time.perf_counter`), once this thread's stream on ``device`` has run."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter() - start
