"""Which rollout backend? The seed's decision guide as a function, with the memory plan as one input.

``recommend`` turns N, the spread of completion lengths, the modality, the need for throughput, the GPU count
and (optionally) a memory plan (`cbkit.planner.plan`) into a backend with its reasons. The planner's names are
re-exported here because notebooks and the CLI import them from ``cbkit.advise``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cbkit.models import load_config
from cbkit.planner import (
    DTYPE_BYTES,
    ContinuousPlan,
    GeneratePlan,
    Plan,
    check_positive,
    crossover_n,
    fmt_bytes,
    kv_bytes_per_token,
    plan,
    planned_points,
)

__all__ = [
    "DTYPE_BYTES",
    "Advice",
    "ContinuousPlan",
    "GeneratePlan",
    "Plan",
    "crossover_n",
    "kv_bytes_per_token",
    "load_config",
    "plan",
    "planned_points",
    "recommend",
]

Backend = Literal["generate", "continuous", "vllm"]

# The seed measured parity at N=8 and a ~1.25x speed-up from N=32 on an A100; below 32 the engine's
# per-step overhead is not paid back by recycling.
CB_MIN_N = 32
# Share of generate()'s decode slots wasted on rows that already finished (1 - mean/max completion
# length) above which lengths count as "variable". A judgement call: below ~20% there is little padding
# for recycling to win back.
VARIABLE_WASTE = 0.2
# Coefficient of variation of completion lengths treated the same way (0.2 ~ lengths within +-20%).
VARIABLE_CV = 0.2


@dataclass(frozen=True)
class Advice:
    backend: Backend
    reasons: list[str]

    def __str__(self) -> str:
        return f"use {self.backend}:\n" + "\n".join(f"  - {r}" for r in self.reasons)


# --- the decision guide -------------------------------------------------------------------------------------


def recommend(
    num_generations: int,
    *,
    completion_cv: float | None = None,
    mean_completion_len: float | None = None,
    max_new_tokens: int | None = None,
    multimodal: bool = False,
    need_max_throughput: bool = False,
    num_gpus: int = 1,
    tensor_parallel: bool = False,
    memory: Plan | None = None,
) -> Advice:
    """The seed's guide: generate() for N < 32; CB for N >= 32 with variable completion lengths, text only,
    in-process (no weight sync); vLLM for maximum throughput or tensor parallel / multi-node. A plan with a
    budget adds the memory rule: when generate() won't fit and CB will, CB.

    Completion-length spread is ``completion_cv`` (std / mean) or ``mean_completion_len`` over
    ``max_new_tokens`` (generate()'s wasted decode slots are about 1 - mean/max); unknown counts as
    variable, as GRPO completions usually are, and the reasons say it was assumed.
    """
    check_positive(num_generations=num_generations, num_gpus=num_gpus)
    n = num_generations
    if tensor_parallel:
        return Advice("vllm", [
            "tensor parallel (a model split over GPUs): cbkit's backends run one model copy on one device; "
            "vLLM serves a tensor-parallel model, driven from TRL's GRPOTrainer (cbkit.trl_bridge)",
        ])
    reasons: list[str] = []
    if num_gpus > 1:
        reasons.append(f"{num_gpus} GPUs: run data parallel through TRL's GRPOTrainer under accelerate "
                       "(cbkit.trl_bridge); each GPU's rollout follows the rest of this advice")
    if need_max_throughput:
        return Advice("vllm", reasons + [
            "maximum rollout throughput: vLLM's kernels and scheduler beat transformers' CB engine; the price "
            "is a weight sync into vLLM after every optimizer step (server or colocate mode in TRL)",
        ])
    gen_fits = memory.generate.fits if memory is not None else None
    cb_fits = memory.continuous.fits if memory is not None else None
    if multimodal:
        reasons.append("multimodal inputs: transformers' CB engine takes token ids only (text only), so not "
                       "continuous; vLLM is the fast path for multimodal rollouts")
        if gen_fits is False:
            reasons.append(f"generate() is predicted to need {fmt_bytes(memory.generate.peak_bytes)} of a "
                           f"{fmt_bytes(memory.budget_bytes)} budget: lower N or the prompts per step")
        return Advice("generate", reasons)
    if gen_fits is False and cb_fits:
        return Advice("continuous", reasons + [
            f"memory: generate() is predicted to need {fmt_bytes(memory.generate.peak_bytes)} (KV for every row at "
            f"full length) and the budget is {fmt_bytes(memory.budget_bytes)}; CB's fixed pool fits "
            f"({fmt_bytes(memory.continuous.peak_bytes)}) and recycles blocks as sequences finish",
        ])
    if gen_fits is False and cb_fits is False:
        lighter: Backend = "continuous" if memory.continuous.peak_bytes < memory.generate.peak_bytes else "generate"
        return Advice(lighter, reasons + [
            f"memory: neither backend is predicted to fit the {fmt_bytes(memory.budget_bytes)} budget "
            f"(generate {fmt_bytes(memory.generate.peak_bytes)}, CB {fmt_bytes(memory.continuous.peak_bytes)}); "
            f"{lighter} is the lighter. Lower N, the prompts per step or max_new_tokens",
        ])
    if n < CB_MIN_N:
        return Advice("generate", reasons + [
            f"N={n} < {CB_MIN_N}: the seed measured parity at N=8; with few sequences per prompt the padded "
            "static batch wastes little and CB's per-step scheduling overhead is not paid back",
        ])
    variable, spread = _spread(completion_cv, mean_completion_len, max_new_tokens)
    if not variable:
        return Advice("generate", reasons + [
            f"N={n} >= {CB_MIN_N} but completion lengths are uniform ({spread}): generate() wastes few decode "
            "slots, so there is little for recycling to win back",
        ])
    return Advice("continuous", reasons + [
        f"N={n} >= {CB_MIN_N} with variable completion lengths ({spread}): generate() keeps finished rows "
        "in the batch until the longest ends, CB recycles their blocks and slots (~1.25x at N=32/64 in the seed)",
        "text only, and the engine runs in the training process on the same weights: no weight sync",
    ])


def _spread(cv: float | None, mean: float | None, max_new: int | None) -> tuple[bool, str]:
    if cv is not None:
        if cv < 0:
            raise ValueError(f"completion_cv must be >= 0, got {cv}.")
        return cv >= VARIABLE_CV, f"coefficient of variation {cv:.2f}"
    if mean is not None and max_new is not None:
        if not 0 < mean <= max_new:
            raise ValueError(f"mean_completion_len must be in (0, max_new_tokens={max_new}], got {mean}.")
        waste = 1 - mean / max_new
        return waste >= VARIABLE_WASTE, f"mean {mean:.1f} of max {max_new}: ~{waste:.0%} of generate()'s decode slots wasted"
    return True, "assumed: no completion-length statistics given"
