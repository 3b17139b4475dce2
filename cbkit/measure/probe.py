"""What this machine can do: a matmul probe at the model's dtype and width, a read-bandwidth probe (the two roofs
`roofline` turns into a run's attainable tokens/s), and MFU. A probe that cannot run is recorded, never guessed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from cbkit.telemetry import ModelShape

# Rows of the probe's [rows x hidden] @ [hidden x intermediate]: a decode step's MLP matmul at a few batch sizes.
PROBE_ROWS = (64, 512, 4096)


def matmul_probe(model, rows: Sequence[int] = PROBE_ROWS, min_seconds: float = 0.25, rounds: int = 3) -> dict[str, Any]:
    """The best FLOP/s of a [rows x hidden] @ [hidden x intermediate] ``torch.mm`` at the model's dtype, each shape
    timed over repeated calls for at least ``min_seconds`` after a warm-up (CUDA synchronised before every clock
    read), the shapes in turn for ``rounds`` rounds: one short pass per shape reads low and unevenly on a CPU."""
    shape = ModelShape.of(model.config)
    hidden, inter = shape.hidden, shape.intermediate
    device, dtype = model.device, model.dtype
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    per_rows: dict[str, float] = {}
    rounds_by_rows: dict[str, list[float]] = {}
    for r in [r for _ in range(rounds) for r in rows]:
        a = torch.randn(r, hidden, device=device, dtype=dtype)
        b = torch.randn(hidden, inter, device=device, dtype=dtype)
        with torch.no_grad():
            torch.mm(a, b)
            sync()
            calls, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                calls += 1
                if device.type != "cuda" or calls % 4 == 0:  # on CUDA, not a sync per small kernel
                    sync()
                    elapsed = time.perf_counter() - start
                    if elapsed >= min_seconds:
                        break
        flops = 2 * r * hidden * inter * calls / elapsed
        per_rows[str(r)] = max(flops, per_rows.get(str(r), 0.0))
        rounds_by_rows.setdefault(str(r), []).append(flops)
        best = max(best, flops)
        del a, b
    best_rows = max(per_rows, key=lambda rows_key: per_rows[rows_key])
    return {"peak_flops": best, "probe_flops_by_rows": per_rows, "probe_shape": [hidden, inter],
            "peak_flops_rounds": rounds_by_rows[best_rows], "peak_flops_spread": spread(rounds_by_rows[best_rows]),
            "probe_dtype": str(dtype).removeprefix("torch."), "probe_device": device.type}


def matmul_params(model) -> int:
    """Every ``nn.Linear`` weight, the LM head included (tied or not): the 2 x parameters a token of MFU."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def mfu(params: int, completion_tokens: float, seconds: float | None, peak_flops: float) -> float | None:
    """Model FLOP utilisation: 2 x matmul params x completion tokens (never padding) / seconds / probed peak."""
    if not seconds or seconds <= 0 or not peak_flops:
        return None
    return 2 * params * completion_tokens / seconds / peak_flops


# Bytes a bandwidth pass reads: far more than any last-level cache, so it times DRAM or HBM, as a decode step does.
BANDWIDTH_BYTES = 256 * 2**20


def bandwidth_probe(device: torch.device | str = "cpu", nbytes: int = BANDWIDTH_BYTES, min_seconds: float = 0.1,
                    rounds: int = 3) -> dict[str, Any]:
    """Read bandwidth: a sum over an ``nbytes`` float32 tensor (every byte read once), repeated for ``min_seconds``
    a round after a warm-up; the best round is the roof, every round kept so a noisy machine's spread shows."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    per_round = []
    with torch.no_grad():
        x.sum()
        sync()
        for _ in range(rounds):
            passes, start = 0, time.perf_counter()
            while True:
                x.sum()
                passes += 1
                sync()
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    break
            per_round.append(x.numel() * 4 * passes / elapsed)
    del x
    return {"bytes_per_s": max(per_round), "bandwidth_rounds": per_round, "bandwidth_bytes": nbytes,
            "bandwidth_device": device.type}


def spread(values: Sequence[float]) -> float | None:
    """(best - worst) / best over a probe's rounds: 0 on a quiet machine, growing with the noise."""
    values = [v for v in values if v]
    return (max(values) - min(values)) / max(values) if values else None


def machine_probe(model, *, matmul_rounds: int = 3, matmul_seconds: float = 0.25,
                  bandwidth_rounds: int = 3) -> dict[str, Any]:
    """Both roofs of this machine, probed now, with each one's spread over its rounds. A probe that cannot run leaves
    its fields None and says why under ``probe_missing``: a roof is never made up."""
    out: dict[str, Any] = {"peak_flops": None, "bytes_per_s": None, "probe_missing": {}}
    try:
        mm = matmul_probe(model, min_seconds=matmul_seconds, rounds=matmul_rounds)
        out.update(mm)
    except Exception as e:  # a probe is a measurement like any other: its failure is recorded, not fatal
        out["probe_missing"]["peak_flops"] = f"matmul probe failed: {type(e).__name__}: {str(e)[:200]}"
    try:
        bw = bandwidth_probe(model.device, rounds=bandwidth_rounds)
        out.update(bw)
        out["bytes_per_s_spread"] = spread(bw["bandwidth_rounds"])
    except Exception as e:
        out["probe_missing"]["bytes_per_s"] = f"bandwidth probe failed: {type(e).__name__}: {str(e)[:200]}"
    return out
