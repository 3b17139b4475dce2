"""Measuring a rollout: peak memory, the way DESIGN.md's measurement rules say.

On CUDA the peak is `max_memory_allocated` after `reset_peak_memory_stats` (reserved is kept alongside).
On CPU there is no allocator counter to ask, so a poller thread samples the process's RSS and reports the
peak above the baseline taken when the probe starts (after the model is loaded). RSS sampling misses
spikes shorter than the poll interval and counts allocator slack, so CPU figures are indicative: compare
backends side by side in one process, never across machines.
"""

from __future__ import annotations

import threading

import torch


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

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            self.kind = "cuda_allocated"
        else:
            import psutil

            self._proc = psutil.Process()
            self._baseline = self._peak_rss = self._proc.memory_info().rss
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
            self.kind = "cpu_rss"
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak_rss = max(self._peak_rss, self._proc.memory_info().rss)

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
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self._peak_rss = max(self._peak_rss, self._proc.memory_info().rss)
            self.peak_bytes = self._peak_rss - self._baseline
