"""The roofline of a rollout: how fast its shape could go on a machine, by FLOPs and by bytes.

A decode step over R rows multiplies every matmul weight by R hidden states (2 x matmul params x R FLOPs, plus the
attention products that grow with context, charged per sequence over its own keys, as the varlen or flash attention
cbkit runs computes them) and reads every weight once and each row's KV. Whichever takes longer on a machine, compute
at its peak FLOP/s or bytes at its bandwidth, binds. Summed over a rollout's decode steps (rows drop out as their
completions end) plus the prompts' prefill, that is the least time the work can take: the attainable tokens/s each
backend's speed is a share of. The roof is of the *work*, not of a backend: one that pads or recomputes pays for it
in its share. Peaks come from a probe of this machine (`measure/probe.py`) or, for a GPU not at hand, its datasheet
(`GPUS`). `estimated_*` turn a roof into an estimate of wall time for `cbkit tiers` and the GPU step table.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbkit.telemetry import ModelShape

GiB = 1024**3


@dataclass(frozen=True)
class Machine:
    """Peaks of one machine: FLOP/s by dtype name, memory bandwidth in bytes/s, device memory in bytes."""

    name: str
    peak_flops: dict[str, float]
    bytes_per_s: float
    memory_bytes: int | None = None
    source: str = "probed"  # or "datasheet"

    def total_memory(self) -> int:
        """Device memory in bytes; a probed machine has none recorded."""
        if self.memory_bytes is None:
            raise ValueError(f"{self.name} has no device memory recorded; plans need a GPU from roofline.GPUS.")
        return self.memory_bytes

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no peak for {dtype!r}; known: {sorted(self.peak_flops)}.")
        return self.peak_flops[dtype]


# Dense tensor-core peaks and memory bandwidth from NVIDIA's datasheets (no sparsity). Colab's A100 is the 40 GB
# SXM part. Memory is what the driver reports as total, rounded down.
GPUS: dict[str, Machine] = {
    "t4": Machine("NVIDIA T4", {"float16": 65e12, "float32": 8.1e12}, 320e9, 15 * GiB, "datasheet"),
    "a100-40": Machine("NVIDIA A100-SXM4-40GB", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                       1555e9, 40 * GiB, "datasheet"),
    "a100-80": Machine("NVIDIA A100-SXM4-80GB", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                       2039e9, 80 * GiB, "datasheet"),
    "h200": Machine("NVIDIA H200", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 4.8e12, 141 * GiB,
                    "datasheet"),
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
                     prompt_of: Sequence[int] | None = None, dtype_bytes: int, peak_flops: float,
                     bytes_per_s: float) -> dict[str, Any]:
    """The least time a rollout's work takes on a machine, and the tokens/s that makes: `prompt_lens` the distinct
    prompts (each prefilled once), `completion_lengths` each completion's tokens, `prompt_of[i]` completion i's prompt
    (default: split evenly, in order); decode step t runs every completion still going, at context prompt + t."""
    if peak_flops <= 0 or bytes_per_s <= 0:
        raise ValueError(f"A roofline needs positive peaks, got {peak_flops} FLOP/s and {bytes_per_s} B/s.")
    shape = Shape.of(config)
    lengths = list(completion_lengths)
    if prompt_of is None:
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
            "decode_steps": steps, "compute_bound_steps": compute_steps, "completion_tokens": tokens}


# --- the training step's roofs: the old-logprob forward and the update ------------------------------------------

# AdamW on fp32 weights reads the weight, its gradient and both moments and writes the weight and both moments.
ADAMW_BYTES_PER_PARAM = 7 * 4


def teacher_forced_forward(shape: Shape, rows: Sequence[tuple[int, int]], dtype_bytes: int, forwards: int) -> StepCost:
    """One teacher-forced forward over ``rows`` of (prompt, completion) tokens: every matmul weight over every real
    token (the LM head over the completion's positions, as ``logits_to_keep`` does), the causal attention products,
    the weights read once per forward call (``forwards``). Padding is not work."""
    head = shape.vocab * shape.hidden
    body = shape.matmul_params - head
    flops = sum(2 * body * (p + c) + 2 * head * (c + 1) + shape.attention_flops((p + c) * (p + c + 1) // 2)
                for p, c in rows)
    return StepCost(flops, shape.matmul_params * dtype_bytes * forwards)


def training_roofline(config: Any, *, rows: Sequence[tuple[int, int]], forwards: int, params: int, dtype_bytes: int,
                      peak_flops: float, bytes_per_s: float, num_iterations: int = 1) -> dict[str, float]:
    """The least seconds of a GRPO step's training phases: the old-logprob forward, and the update (``num_iterations``
    x a forward and its backward, three forwards' FLOPs and weight reads, then AdamW's bandwidth-bound pass)."""
    if peak_flops <= 0 or bytes_per_s <= 0:
        raise ValueError(f"A roofline needs positive peaks, got {peak_flops} FLOP/s and {bytes_per_s} B/s.")
    fwd = teacher_forced_forward(Shape.of(config), rows, dtype_bytes, forwards)
    fwd_bwd = StepCost(3 * fwd.flops, 3 * fwd.bytes)
    adamw = params * ADAMW_BYTES_PER_PARAM / bytes_per_s
    return {"old_logprob_roof_s": fwd.seconds(peak_flops, bytes_per_s),
            "update_roof_s": num_iterations * (fwd_bwd.seconds(peak_flops, bytes_per_s) + adamw),
            "update_compute_roof_s": num_iterations * 3 * fwd.flops / peak_flops}


# --- an estimate of wall time, from the roof --------------------------------------------------------------------
# Two assumptions, named as such wherever printed: the share of the lower roof a step reaches, and a floor under
# every step, because HF's eager forward launches its kernels one by one from Python (calibrated on TRL PR #5765's
# generate() of Llama-3.2-1B on an A100: 41.12 s for 2048 decode steps, 1.25 ms a layer).
LAUNCH_S_PER_LAYER = 41.12 / 2048 / 16
DECODE_EFFICIENCY = 0.5  # HF eager decode at large batch: bandwidth-bound, kernels far from peak bandwidth
TRAIN_EFFICIENCY = 0.3  # MFU of an HF eager forward + backward of a sub-1B model (no fused kernels, no compile)


def estimated_rollout_seconds(config: Any, *, prompt_lens: Sequence[int], running: Sequence[int], context: int,
                              dtype_bytes: int, machine: Machine, dtype: str,
                              efficiency: float = DECODE_EFFICIENCY, step_floor_s: float | None = None) -> float:
    """Wall seconds of a rollout by the roof, slowed to ``efficiency``, never under the per-step floor: ``running[t]``
    sequences decode at step t, each at ``context`` tokens of KV (a mean), after the prompts' prefill."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is a share of the roof in (0, 1], got {efficiency}.")
    shape = Shape.of(config)
    floor = LAUNCH_S_PER_LAYER * shape.layers if step_floor_s is None else step_floor_s
    peak, bw = machine.flops(dtype), machine.bytes_per_s
    seconds = prefill(shape, prompt_lens, dtype_bytes).seconds(peak, bw) / efficiency
    by_rows: dict[int, int] = {}
    for rows in running:
        by_rows[rows] = by_rows.get(rows, 0) + 1
    for rows, steps in by_rows.items():
        step = decode_step(shape, [context] * rows, dtype_bytes).seconds(peak, bw) / efficiency
        seconds += steps * max(step, floor)
    return seconds


def step_floor_seconds(config: Any) -> float:
    """The launch floor of one eager decode step of this model: ``LAUNCH_S_PER_LAYER`` for each layer."""
    return LAUNCH_S_PER_LAYER * Shape.of(config).layers


def rows_off_the_floor(config: Any, *, context: int, dtype_bytes: int, machine: Machine, dtype: str,
                       efficiency: float = DECODE_EFFICIENCY, limit: int = 1 << 20) -> int | None:
    """The fewest rows at which one decode step at ``context`` tokens of KV each takes longer by the roof than the
    launch floor (below it padded rows cost nothing in the estimate); None if even ``limit`` rows stay under it."""
    shape, floor = Shape.of(config), step_floor_seconds(config)
    peak, bw = machine.flops(dtype), machine.bytes_per_s

    def over(rows: int) -> bool:
        return decode_step(shape, [context] * rows, dtype_bytes).seconds(peak, bw) / efficiency > floor

    if not over(limit):
        return None
    lo, hi = 0, 1  # over(lo) is False (no rows, no work beyond the weights), over(hi) True once doubled enough
    while not over(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # a step's time grows with its rows: bisect
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if over(mid) else (mid, hi)
    return hi


def estimated_train_seconds(config: Any, *, rows: int, tokens_per_row: int, machine: Machine, dtype: str,
                            forwards: int = 1, efficiency: float = TRAIN_EFFICIENCY) -> float:
    """Wall seconds of ``forwards`` teacher-forced forwards (2 FLOPs a matmul weight a token) and one backward
    (4 more) over ``rows`` x ``tokens_per_row`` tokens, at ``efficiency`` of the dtype's matmul peak."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is a share of the peak in (0, 1], got {efficiency}.")
    flops = (2 * forwards + 4) * Shape.of(config).matmul_params * rows * tokens_per_row
    return flops / (machine.flops(dtype) * efficiency)


def estimated_step_split(config: Any, *, prompt_lens: Sequence[int], targets: Sequence[int], machine: Machine,
                         rollout_dtype: str, train_dtype: str, dtype_bytes: int) -> dict[str, dict[str, float]]:
    """An estimate (not a measurement) of one GRPO step's phases on ``machine``, per backend: the rollout (a static
    batch runs every row until the longest target ends, a pool large enough for every row each row until its own),
    the old-logprob forward and the update at ``TRAIN_EFFICIENCY``. ``targets``: one completion length per row."""
    rows, longest = len(targets), max(targets)
    context = round(statistics.mean(prompt_lens)) + longest // 2
    tokens_per_row = round(statistics.mean(prompt_lens)) + round(statistics.mean(targets))
    update = estimated_train_seconds(config, rows=rows, tokens_per_row=tokens_per_row, machine=machine,
                                     dtype=train_dtype, forwards=1)
    running = {"generate": [rows] * longest, "continuous": [sum(t > i for t in targets) for i in range(longest)]}
    return {backend: {"rollout_s": estimated_rollout_seconds(config, prompt_lens=prompt_lens, running=steps,
                                                             context=context, dtype_bytes=dtype_bytes,
                                                             machine=machine, dtype=rollout_dtype),
                      "old_logprob_s": update / 3,  # 2 of the update's 6 FLOPs a weight a token
                      "update_s": update}
            for backend, steps in running.items()}
