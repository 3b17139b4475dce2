"""Will it fit? The memory planner: one rollout's peak memory through each backend, from the model's config.

The planner predicts the peak memory (above the weights) of one rollout of P prompts x N completions for
both backends, from nothing but the model's config, one module a concept:

* `generate` -- ``generate()`` keeps every row of the static batch until the *last* row finishes, so its KV grows
  with N (held to the longest prompt + ``max_new_tokens``);
* `continuous` -- the CB engine allocates one pool up front and keeps it, whatever the batch needs; the planner
  repeats the engine's own sizing step for step;
* `training` -- the training step beside the rollout (`training_bytes`, `step_peak_bytes`);
* `shape` -- what they all read: the model's layers the way transformers' caches read them, the dtype's bytes.

``crossover_n`` is the smallest N at which CB's predicted peak is below ``generate()``'s. The decision guide
that turns a plan into a backend (``recommend``) is `cbkit.measure.advise`.

Accuracy. The CB block count is exact: tests/test_advise.py builds the engine on the tiny model (workload,
``num_blocks`` and memory sizing, default and small ``max_batch_tokens``) and compares. Peak *bytes* are
an estimate, and on CPU a lower bound: RSS counts what the plan does not model (allocator slack, the engine
thread's malloc arena); lab/cpu_results.md has how far apart they were. Every sweep run records its
``plan_error``.

Simplifications: full and sliding-window attention only (no MLA, no linear attention); activations are
counted for inference without gradients; prefix sharing (blocks shared between a group's identical
prompts) is ignored, so CB's *use* of its pool is overestimated, never its size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cbkit.measure.planner.continuous import ContinuousPlan, plan_continuous, pool_blocks
from cbkit.measure.planner.generate import GeneratePlan, plan_generate
from cbkit.measure.planner.shape import DTYPE_BYTES, CacheShape, check_positive
from cbkit.measure.planner.training import (
    ADAM_BYTES_PER_PARAM,
    GRAD_BYTES_PER_PARAM,
    TRAIN_STATE_BYTES_PER_PARAM,
    activation_bytes_per_token,
    step_peak_bytes,
    training_bytes,
)
from cbkit.telemetry import fmt_bytes, kv_bytes_per_token

__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "DTYPE_BYTES",
    "GRAD_BYTES_PER_PARAM",
    "TRAIN_STATE_BYTES_PER_PARAM",
    "ContinuousPlan",
    "GeneratePlan",
    "Plan",
    "activation_bytes_per_token",
    "check_positive",
    "crossover_n",
    "plan",
    "pool_blocks",
    "step_peak_bytes",
    "training_bytes",
]


@dataclass(frozen=True)
class Plan:
    model: str
    num_prompts: int
    num_generations: int
    num_sequences: int
    prompt_len: int  # the longest prompt
    max_new_tokens: int
    dtype_bytes: int
    device: str
    budget_bytes: int | None
    kv_bytes_per_token: int
    generate: GeneratePlan
    continuous: ContinuousPlan
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """The plan as a few readable lines (what `cbkit advise` prints)."""
        g, c = self.generate, self.continuous
        budget = f"budget {fmt_bytes(self.budget_bytes)} (free memory after weights)" if self.budget_bytes else "no budget"
        lines = [
            f"{self.model}: {self.num_prompts} prompts x N={self.num_generations} = {self.num_sequences} sequences, "
            f"prompt {self.prompt_len} + up to {self.max_new_tokens} new tokens, {self.dtype_bytes}-byte dtype, "
            f"{self.device}, {budget}",
            f"KV cache: {fmt_bytes(self.kv_bytes_per_token)} per token",
            f"generate():  peak {fmt_bytes(g.peak_bytes):>10}{_fit(g.fits)}  KV {fmt_bytes(g.kv_bytes)} "
            f"({g.rows} rows x {g.padded_len} positions, held until the last row ends) + last-step transients "
            f"{fmt_bytes(g.decode_transient_bytes)}"
            + (f" + CPU heap slack {fmt_bytes(g.cpu_heap_slack_bytes)}" if g.cpu_heap_slack_bytes else "")
            + f"; first forward {fmt_bytes(g.prefill_bytes)}",
            f"continuous:  peak {fmt_bytes(c.peak_bytes):>10}{_fit(c.fits)}  pool {fmt_bytes(c.cache_tensor_bytes)} "
            f"({c.num_blocks} blocks x {c.page_size} tokens, sized by {c.sized_by}) + buffers "
            f"{fmt_bytes(c.buffer_bytes)} + transients {fmt_bytes(c.transient_bytes)}; holds {c.full_length_sequences} "
            f"sequences at full length at once",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


# --- the planner --------------------------------------------------------------------------------------------


def plan(
    config: Any,
    *,
    num_prompts: int,
    num_generations: int,
    prompt_len: int | Sequence[int],
    max_new_tokens: int,
    dtype_bytes: int,
    mean_completion_len: float | None = None,
    budget_bytes: int | None = None,
    max_memory_percent: float | None = None,
    page_size: int | None = None,
    max_batch_tokens: int | None = None,
    num_blocks: int | None = None,
    cb_config: Mapping[str, Any] | None = None,
    device: Literal["cuda", "cpu"] = "cuda",
    attn_implementation: Literal["sdpa", "eager", "flash", "varlen"] | None = None,
    logits_to_keep: bool = True,
    model_name: str = "model",
) -> Plan:
    """Predict the peak memory above the weights of one rollout through each backend.

    ``prompt_len`` is one length for every prompt or one per prompt. ``budget_bytes`` is the memory free
    after the weights are loaded (on a GPU what ``torch.cuda.mem_get_info`` reports then); CB on a GPU
    needs it, because the engine sizes its pool as a share of it. ``max_memory_percent``, ``page_size``,
    ``max_batch_tokens``, ``num_blocks`` and ``cb_config`` are the continuous backend's overrides, with
    cbkit's defaults where left out. ``attn_implementation`` is what the engine runs: "flash" (a flash-attn
    kernel: no dense mask, and its block-table decode path), "varlen" (cbkit's varlen attention: no mask, no
    block table), "sdpa" or "eager" (the engine's dense mask). None means what cbkit's continuous backend runs
    (`engine_attention`, the engine's own decision) without flash-attn installed: cbkit's varlen attention on
    every device, or SDPA for a model that needs the engine's own attention (a sliding window, soft-capping);
    a plan for a GPU with flash-attn passes "flash".
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    lens = _prompt_lens(prompt_len, num_prompts)
    check_positive(num_prompts=num_prompts, num_generations=num_generations, max_new_tokens=max_new_tokens,
                    dtype_bytes=dtype_bytes)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}.")
    if attn_implementation is None:
        attn_implementation = _engine_attention(config, device, dtype_bytes)
    if attn_implementation not in ("sdpa", "eager", "flash", "varlen"):
        raise ValueError(f"attn_implementation must be 'sdpa', 'eager', 'flash', 'varlen' or None (cbkit's choice), "
                         f"got {attn_implementation!r}.")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0 (free memory after the weights), got {budget_bytes}.")
    if mean_completion_len is not None and not 1 <= mean_completion_len <= max_new_tokens:
        raise ValueError(
            f"mean_completion_len must be between 1 and max_new_tokens={max_new_tokens}, got {mean_completion_len}."
        )
    shape = CacheShape.read(text, dtype_bytes)
    rows = num_prompts * num_generations
    gen = plan_generate(shape, rows, max(lens), max_new_tokens, budget_bytes, device)
    cb, notes = plan_continuous(
        shape, lens, num_generations, max_new_tokens, mean_completion_len, budget_bytes, device,
        attn_implementation, logits_to_keep,
        overrides={**(cb_config or {}), **_given(max_memory_percent=max_memory_percent, page_size=page_size,
                                                 max_batch_tokens=max_batch_tokens, num_blocks=num_blocks)},
    )
    return Plan(model_name, num_prompts, num_generations, rows, max(lens), max_new_tokens, dtype_bytes, device,
                budget_bytes, kv_bytes_per_token(text, dtype_bytes), gen, cb, notes)


def crossover_n(config: Any, *, max_n: int = 1024, **plan_kwargs: Any) -> int | None:
    """The smallest N at which CB's predicted peak is below generate()'s, or None up to ``max_n``.

    Takes ``plan``'s keywords except ``num_generations``. On a GPU the CB pool does not grow with N and
    generate()'s KV grows linearly, so above the crossover CB stays the lighter one.
    """
    if "num_generations" in plan_kwargs:
        raise TypeError("crossover_n scans N itself; do not pass num_generations.")
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}.")
    for n in range(1, max_n + 1):
        p = plan(config, num_generations=n, **plan_kwargs)
        if p.continuous.peak_bytes < p.generate.peak_bytes:
            return n
    return None


def _prompt_lens(prompt_len: int | Sequence[int], num_prompts: int) -> list[int]:
    if isinstance(prompt_len, int):
        lens = [prompt_len] * max(num_prompts, 0)
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}.")
    else:
        lens = [int(p) for p in prompt_len]
        if len(lens) != num_prompts:
            raise ValueError(f"prompt_len gives {len(lens)} lengths for num_prompts={num_prompts}.")
        if any(p < 1 for p in lens):
            raise ValueError(f"every prompt length must be >= 1, got {min(lens)}.")
    return lens



def _engine_attention(config: Any, device: str, dtype_bytes: int) -> Literal["sdpa", "varlen"]:
    """`engine_attention`'s answer for a model of ``config`` with no flash-attn installed, in the planner's words."""
    import torch

    from cbkit.rollout.engine_config import ENGINE_OWN, engine_attention
    from cbkit.rollout.varlen_attention import varlen_unsupported_reason

    dtype = torch.float32 if dtype_bytes == 4 else torch.bfloat16
    chosen = engine_attention(device, dtype, flash=(), needs_own=varlen_unsupported_reason(config))
    return "sdpa" if chosen == ENGINE_OWN else "varlen"


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _fit(fits: bool | None) -> str:
    return "" if fits is None else (" (fits)" if fits else " (DOES NOT FIT)")
