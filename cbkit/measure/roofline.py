"""The roofline of a rollout: the least time its work can take on this machine, by FLOPs and by bytes.

Both roofs are probed, never guessed (a matmul at the model's dtype and width, a read-bandwidth pass). Each decode
step costs the longer of its FLOPs at the matmul peak and its bytes (weights once, each row's KV) at the bandwidth;
summed with the prefill, that is the attainable tokens/s of the work, not of a backend. MFU is against the matmul
roof."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.telemetry import ModelShape, kv_bytes_per_token


@dataclass(frozen=True)
class Shape(ModelShape):
    """A model config's shape (`cbkit.telemetry.ModelShape`) and what it costs a token."""

    @property
    def matmul_params(self) -> int:
        """Weights that multiply a hidden state once per token: q, k, v, o, the gated MLP's three, the LM head."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    def attention_flops(self, context: int) -> int:
        """Score and value products of one query token against `context` keys, all layers."""
        return 4 * self.layers * self.heads * self.head_dim * context


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float

    def seconds(self, peak_flops: float, bytes_per_s: float) -> tuple[float, bool]:
        """The step's least seconds, and whether compute (not bandwidth) binds it."""
        compute, memory = self.flops / peak_flops, self.bytes / bytes_per_s
        return max(compute, memory), compute >= memory


def decode_step(config: Any, contexts: Sequence[int], dtype_bytes: int) -> StepCost:
    """One decode step over rows whose KV holds `contexts` tokens each: every weight read once, each row's KV read."""
    shape, rows = Shape.of(config), len(contexts)
    flops = 2 * shape.matmul_params * rows + sum(shape.attention_flops(c) for c in contexts)
    weight_bytes = (shape.matmul_params + shape.hidden * rows) * dtype_bytes  # + the rows' embedding lookups
    kv_bytes = kv_bytes_per_token(config, dtype_bytes) * sum(contexts)
    return StepCost(flops, weight_bytes + kv_bytes)


def prefill(config: Any, prompt_lens: Sequence[int], dtype_bytes: int) -> StepCost:
    """The prompts' forward: compute for every prompt token, the weights read once."""
    shape = Shape.of(config)
    flops = sum(2 * shape.matmul_params * p + sum(shape.attention_flops(c) for c in range(1, p + 1))
                for p in prompt_lens)
    return StepCost(flops, shape.matmul_params * dtype_bytes + kv_bytes_per_token(config, dtype_bytes) * sum(prompt_lens))


def rollout_roofline(config: Any, *, prompt_lens: Sequence[int], completion_lengths: Sequence[int],
                     dtype_bytes: int, peak_flops: float, bytes_per_s: float) -> dict[str, Any]:
    """The least time a rollout's work takes, and the tokens/s that makes: `prompt_lens` the distinct prompts (each
    prefilled once), `completion_lengths` each completion's tokens in group order; decode step t runs every
    completion still going, at context prompt + t."""
    if peak_flops <= 0 or bytes_per_s <= 0:
        raise ValueError(f"A roofline needs positive peaks, got {peak_flops} FLOP/s and {bytes_per_s} B/s.")
    lengths = list(completion_lengths)
    per = max(1, len(lengths) // max(1, len(prompt_lens)))
    prompt_of = [min(i // per, len(prompt_lens) - 1) for i in range(len(lengths))]
    seconds = prefill(config, prompt_lens, dtype_bytes).seconds(peak_flops, bytes_per_s)[0]
    steps = max(lengths, default=0)
    compute_steps = 0
    for t in range(steps):
        contexts = [prompt_lens[prompt_of[i]] + t for i, n in enumerate(lengths) if n > t]
        step_s, compute_bound = decode_step(config, contexts, dtype_bytes).seconds(peak_flops, bytes_per_s)
        seconds += step_s
        compute_steps += compute_bound
    return {"attainable_tokens_per_s": sum(lengths) / seconds if seconds else None, "roof_seconds": seconds,
            "decode_steps": steps, "compute_bound_steps": compute_steps}


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
    """The best FLOP/s of a decode step's MLP matmul at the model's dtype, each shape timed in ``rounds`` rounds (one
    short pass per shape reads low and unevenly on a CPU)."""
    shape = ModelShape.of(model.config)
    by_rows: dict[str, float] = {}
    for r in [r for _ in range(rounds) for r in rows]:
        a = torch.randn(r, shape.hidden, device=model.device, dtype=model.dtype)
        b = torch.randn(shape.hidden, shape.intermediate, device=model.device, dtype=model.dtype)
        calls = _per_second(functools.partial(torch.mm, a, b), model.device, min_seconds)
        by_rows[str(r)] = max(by_rows.get(str(r), 0.0), 2 * r * shape.hidden * shape.intermediate * calls)
    return {"peak_flops": max(by_rows.values()), "probe_flops_by_rows": by_rows,
            "probe_shape": [shape.hidden, shape.intermediate], "probe_dtype": str(model.dtype).removeprefix("torch.")}


def bandwidth_probe(device: torch.device | str = "cpu", nbytes: int = BANDWIDTH_BYTES, min_seconds: float = 0.1,
                    rounds: int = 3) -> dict[str, Any]:
    """Read bandwidth: a sum over an ``nbytes`` float32 tensor (every byte read once); the best round is the roof."""
    device = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    per_round = [x.numel() * 4 * _per_second(x.sum, device, min_seconds) for _ in range(rounds)]
    return {"bytes_per_s": max(per_round), "bandwidth_rounds": per_round}


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
