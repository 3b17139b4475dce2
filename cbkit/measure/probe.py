"""What this machine can do: a matmul probe at the model's dtype and width, and MFU against it.

A run's model FLOP utilisation is 2 x matmul parameters x completion tokens / seconds, over the probed peak: the
number that says how far a backend is from the hardware, next to its speed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

# --- the limit beside the number: a matmul probe and MFU ----------------------------------------------------

# Rows of the probe's [rows x hidden] @ [hidden x intermediate]: a decode step's MLP matmul at a few batch
# sizes (a decode step has one row per running sequence), the largest near what the hardware sustains.
PROBE_ROWS = (64, 512, 4096)


def matmul_probe(model, rows: Sequence[int] = PROBE_ROWS, min_seconds: float = 0.25, rounds: int = 3) -> dict[str, Any]:
    """This machine's matmul throughput at the model's dtype and width: the best FLOP/s of a
    [rows x hidden] @ [hidden x intermediate] ``torch.mm`` over ``rows``, each timed over repeated calls
    for at least ``min_seconds`` after one warm-up (CUDA synchronised before every clock read), the shapes
    taken in turn for ``rounds`` rounds: one short pass per shape reads low and unevenly on a CPU
    (docs/cpu_results.md).

    It is the ceiling MFU is measured against: a run at MFU 0.3 did 30% of the matmul work this machine
    can do per second. The same code runs on CUDA; on a shared CPU the probe is only as quiet as the machine.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = cfg.hidden_size
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    device, dtype = model.device, model.dtype
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, per_rows = 0.0, {}
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
        best = max(best, flops)
        del a, b
    return {"peak_flops": best, "probe_flops_by_rows": per_rows, "probe_shape": [hidden, inter],
            "probe_dtype": str(dtype).removeprefix("torch."), "probe_device": device.type}


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: every ``nn.Linear`` weight, the LM head included
    (tied to the embedding or not, it multiplies the hidden state by vocab x hidden). The input embedding is
    a lookup and not counted; attention's score and value products (which grow with context) are left out,
    as in the usual 2 x parameters per token estimate."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def mfu(params: int, completion_tokens: float, seconds: float | None, peak_flops: float) -> float | None:
    """Model FLOP utilisation: 2 x matmul params x useful completion tokens / seconds / probed peak FLOP/s.
    Useful tokens are the completion tokens (padding never counts, the prompt's prefill neither), so a
    static batch's padded slots lower its MFU, as they lower its throughput."""
    if not seconds or seconds <= 0 or not peak_flops:
        return None
    return 2 * params * completion_tokens / seconds / peak_flops
