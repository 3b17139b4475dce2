"""The roofline of a rollout: the least time its work can take on a machine, by FLOPs and by bytes.

A decode step over R rows multiplies every matmul weight by R hidden states (plus the attention products, charged
per sequence over its own keys) and reads every weight once and each row's KV; whichever takes longer at the probed
peak FLOP/s or bandwidth binds. Summed over the decode steps (rows drop out as their completions end) plus the
prefill, that is the attainable tokens/s each backend's speed is a share of: a roof of the work, not of a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbkit.telemetry import ModelShape

GiB = 1024**3


@dataclass(frozen=True)
class Machine:
    """A GPU not at hand, for `cbkit tiers`: its name and the device memory its driver reports."""

    name: str
    memory_bytes: int

    def total_memory(self) -> int:
        return self.memory_bytes


GPUS: dict[str, Machine] = {
    "t4": Machine("NVIDIA T4", 15 * GiB),
    "a100-40": Machine("NVIDIA A100-SXM4-40GB", 40 * GiB),
    "a100-80": Machine("NVIDIA A100-SXM4-80GB", 80 * GiB),
    "h200": Machine("NVIDIA H200", 141 * GiB),
}


@dataclass(frozen=True)
class Shape(ModelShape):
    """A model config's shape (`cbkit.telemetry.ModelShape`) and what it costs a token."""

    @property
    def matmul_params(self) -> int:
        """Weights that multiply a hidden state once per token: q, k, v, o, the gated MLP's three, the LM head."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def attention_flops(self, context: int) -> int:
        """Score and value products of one query token against `context` keys, all layers."""
        return 4 * self.layers * self.heads * self.head_dim * context


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float

    def seconds(self, peak_flops: float, bytes_per_s: float) -> float:
        return max(self.flops / peak_flops, self.bytes / bytes_per_s)

    def compute_bound(self, peak_flops: float, bytes_per_s: float) -> bool:
        return self.flops / peak_flops >= self.bytes / bytes_per_s


def decode_step(shape: Shape, contexts: Sequence[int], dtype_bytes: int) -> StepCost:
    """One decode step over rows whose KV holds `contexts` tokens each: every weight read once, each row's KV read."""
    rows = len(contexts)
    flops = 2 * shape.matmul_params * rows + sum(shape.attention_flops(c) for c in contexts)
    weight_bytes = (shape.matmul_params + shape.hidden * rows) * dtype_bytes  # + the rows' embedding lookups
    kv_bytes = shape.kv_bytes_per_token(dtype_bytes) * sum(contexts)
    return StepCost(flops, weight_bytes + kv_bytes)


def prefill(shape: Shape, prompt_lens: Sequence[int], dtype_bytes: int) -> StepCost:
    """The prompts' forward: compute for every prompt token, the weights read once."""
    flops = sum(2 * shape.matmul_params * p + sum(shape.attention_flops(c) for c in range(1, p + 1))
                for p in prompt_lens)
    return StepCost(flops, shape.matmul_params * dtype_bytes + shape.kv_bytes_per_token(dtype_bytes) * sum(prompt_lens))


def rollout_roofline(config: Any, *, prompt_lens: Sequence[int], completion_lengths: Sequence[int],
                     dtype_bytes: int, peak_flops: float, bytes_per_s: float) -> dict[str, Any]:
    """The least time a rollout's work takes, and the tokens/s that makes: `prompt_lens` the distinct prompts (each
    prefilled once), `completion_lengths` each completion's tokens in group order; decode step t runs every
    completion still going, at context prompt + t."""
    if peak_flops <= 0 or bytes_per_s <= 0:
        raise ValueError(f"A roofline needs positive peaks, got {peak_flops} FLOP/s and {bytes_per_s} B/s.")
    shape = Shape.of(config)
    lengths = list(completion_lengths)
    per = max(1, len(lengths) // max(1, len(prompt_lens)))
    prompt_of = [min(i // per, len(prompt_lens) - 1) for i in range(len(lengths))]
    seconds = prefill(shape, prompt_lens, dtype_bytes).seconds(peak_flops, bytes_per_s)
    compute_steps = steps = 0
    for t in range(max(lengths, default=0)):
        contexts = [prompt_lens[prompt_of[i]] + t for i, n in enumerate(lengths) if n > t]
        cost = decode_step(shape, contexts, dtype_bytes)
        seconds += cost.seconds(peak_flops, bytes_per_s)
        compute_steps += cost.compute_bound(peak_flops, bytes_per_s)
        steps += 1
    tokens = sum(lengths)
    return {"attainable_tokens_per_s": tokens / seconds if seconds else None, "roof_seconds": seconds,
            "decode_steps": steps, "compute_bound_steps": compute_steps}
