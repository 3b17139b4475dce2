"""What this machine can do: a matmul probe at the model's dtype and width and a read-bandwidth probe (the two roofs
`roofline` turns into a run's attainable tokens/s), and MFU. A probe that cannot run is recorded, never guessed."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cbkit.telemetry import ModelShape

# Rows of the probe's [rows x hidden] @ [hidden x intermediate]: a decode step's MLP matmul at a few batch sizes.
PROBE_ROWS = (64, 512, 4096)
# Bytes a bandwidth pass reads: far more than any last-level cache, so it times DRAM or HBM, as a decode step does.
BANDWIDTH_BYTES = 256 * 2**20


def _per_second(work: Callable[[], Any], device: torch.device, min_seconds: float) -> float:
    """Calls of ``work`` a second, repeated for at least ``min_seconds`` after a warm-up call (CUDA synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        work()
        sync()
        calls, start = 0, time.perf_counter()
        while True:
            work()
            calls += 1
            if device.type != "cuda" or calls % 4 == 0:  # on CUDA, not a sync per small kernel
                sync()
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    return calls / elapsed


def matmul_probe(model, rows: Sequence[int] = PROBE_ROWS, min_seconds: float = 0.25, rounds: int = 3) -> dict[str, Any]:
    """The best FLOP/s of a [rows x hidden] @ [hidden x intermediate] ``torch.mm`` at the model's dtype, the shapes
    timed in turn for ``rounds`` rounds (one short pass per shape reads low and unevenly on a CPU)."""
    shape = ModelShape.of(model.config)
    by_rows: dict[str, list[float]] = {}
    for r in [r for _ in range(rounds) for r in rows]:
        a = torch.randn(r, shape.hidden, device=model.device, dtype=model.dtype)
        b = torch.randn(shape.hidden, shape.intermediate, device=model.device, dtype=model.dtype)
        calls = _per_second(functools.partial(torch.mm, a, b), model.device, min_seconds)
        by_rows.setdefault(str(r), []).append(2 * r * shape.hidden * shape.intermediate * calls)
    best = max(by_rows, key=lambda k: max(by_rows[k]))
    return {"peak_flops": max(by_rows[best]), "probe_flops_by_rows": {k: max(v) for k, v in by_rows.items()},
            "probe_shape": [shape.hidden, shape.intermediate], "peak_flops_spread": spread(by_rows[best]),
            "probe_dtype": str(model.dtype).removeprefix("torch."), "probe_device": model.device.type}


def bandwidth_probe(device: torch.device | str = "cpu", nbytes: int = BANDWIDTH_BYTES, min_seconds: float = 0.1,
                    rounds: int = 3) -> dict[str, Any]:
    """Read bandwidth: a sum over an ``nbytes`` float32 tensor (every byte read once); the best round is the roof."""
    device = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    per_round = [x.numel() * 4 * _per_second(x.sum, device, min_seconds) for _ in range(rounds)]
    return {"bytes_per_s": max(per_round), "bandwidth_rounds": per_round, "bytes_per_s_spread": spread(per_round)}


def spread(values: Sequence[float]) -> float | None:
    """(best - worst) / best over a probe's rounds: 0 on a quiet machine, growing with the noise."""
    values = [v for v in values if v]
    return (max(values) - min(values)) / max(values) if values else None


def machine_probe(model) -> dict[str, Any]:
    """Both roofs of this machine, probed now. A probe that cannot run leaves its field None and says why under
    ``probe_missing``: a roof is never made up."""
    out: dict[str, Any] = {"peak_flops": None, "bytes_per_s": None, "probe_missing": {}}
    probes = (("peak_flops", "matmul", lambda: matmul_probe(model)),
              ("bytes_per_s", "bandwidth", lambda: bandwidth_probe(model.device)))
    for key, name, probe in probes:
        try:
            out.update(probe())
        except Exception as e:  # a probe is a measurement like any other: its failure is recorded, not fatal
            out["probe_missing"][key] = f"{name} probe failed: {type(e).__name__}: {str(e)[:200]}"
    return out


def matmul_params(model) -> int:
    """Every ``nn.Linear`` weight, the LM head included (tied or not): the 2 x parameters a token of MFU."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def mfu(params: int, completion_tokens: float, seconds: float | None, peak_flops: float) -> float | None:
    """Model FLOP utilisation: 2 x matmul params x completion tokens (never padding) / seconds / probed peak."""
    if not seconds or seconds <= 0 or not peak_flops:
        return None
    return 2 * params * completion_tokens / seconds / peak_flops
