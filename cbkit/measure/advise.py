"""Which rollout backend? TRL's benchmark's decision guide as a function, with the memory plan as one input.

``recommend`` turns N, the spread of completion lengths, the modality, the need for throughput, the GPU count
and (optionally) a memory plan (`cbkit.measure.planner.plan`) into a backend with its reasons. The planner's names are
re-exported here because notebooks and the CLI import them from ``cbkit.measure.advise``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cbkit.measure.planner import Plan, check_positive
from cbkit.telemetry import fmt_bytes

__all__ = [
    "Advice",
    "Measured",
    "measured_from_sweep",
    "recommend",
]

Backend = Literal["generate", "continuous", "vllm"]

# TRL's benchmark (PR #5765) measured parity at N=8 and a ~1.25x speed-up from N=32 on an A100; below 32 the engine's
# per-step overhead is not paid back by recycling.
CB_MIN_N = 32
# Share of generate()'s decode slots wasted on rows that already finished (1 - mean/max completion
# length) above which lengths count as "variable". A judgement call: below ~20% there is little padding
# for recycling to win back.
VARIABLE_WASTE = 0.2
# Coefficient of variation of completion lengths treated the same way (0.2 ~ lengths within +-20%).
VARIABLE_CV = 0.2


# Where the N and length-spread thresholds come from when no sweep of this machine is given.
TRL_BENCHMARK_BASIS = (
    "thresholds from TRL's reported A100 benchmark (Llama-3.2-1B-Instruct, GSM8K: parity with generate() at "
    "N=8, ~1.25x at N=32 and N=64), not from this machine; give --from runs/sweep.jsonl to decide from a sweep "
    "measured here"
)
# Measured speed ratios within this margin of 1.0 count as parity: repeats of one point on a shared machine
# differ by a few percent, so a 3% "win" is not one.
PARITY_MARGIN = 0.05


@dataclass(frozen=True)
class Advice:
    backend: Backend
    reasons: list[str]
    basis: str | None = None  # where the thresholds behind the decision came from

    def __str__(self) -> str:
        text = f"use {self.backend}:\n" + "\n".join(f"  - {r}" for r in self.reasons)
        return text + (f"\n  basis: {self.basis}" if self.basis else "")


@dataclass(frozen=True)
class Measured:
    """What a sweep results file measured at the N closest to the one asked about (`measured_from_sweep`)."""

    path: str
    n: int  # the measured N used
    asked_n: int
    workload: str | None
    device: str | None
    speed_vs_generate: float | None  # continuous tokens/s over generate()'s, median of repeats
    mem_vs_generate: float | None
    length_mean: float | None  # generate()'s runs: the static batch is the one that pads
    length_cv: float | None
    length_max: float | None
    decode_padding_share: float | None

    def describe(self) -> str:
        where = f"N={self.n}" + (f" (nearest measured to N={self.asked_n})" if self.n != self.asked_n else "")
        spread = (f"lengths mean {self.length_mean:.1f}, CV {self.length_cv:.2f}, max {self.length_max:.0f}, "
                  f"static batch padding {self.decode_padding_share:.0%}" if self.length_mean is not None
                  else "no length statistics recorded")
        return f"{self.path}: {where}, {self.workload or 'natural'} workload on {self.device or 'unknown'}; {spread}"


def measured_from_sweep(path: str, num_generations: int) -> Measured:
    """Read a `cbkit sweep` results file and take its medians at N (or the nearest measured N, larger on a tie)."""
    from cbkit.measure.results import aggregate, read_results

    try:
        results = read_results(path)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--from: {e}") from None
    p = results.path
    points = aggregate(results.runs)
    by = {(q["backend"], q["N"]): q for q in points if q["status"] == "ok"}
    ns = sorted(n for (b, n) in by if b == "continuous" and ("generate", n) in by)
    if not ns:
        raise ValueError(f"--from: {p} has no N at which both generate and continuous finished; nothing to compare.")
    n = min(ns, key=lambda x: (abs(x - num_generations), -x))
    cb, gen = by[("continuous", n)], by[("generate", n)]
    fp = results.fingerprint
    return Measured(str(p), n, num_generations, fp.get("lengths"), fp.get("device"), cb.get("speed_vs_generate"),
                    cb.get("mem_vs_generate"), gen.get("length_mean"), gen.get("length_cv"), gen.get("length_max"),
                    gen.get("decode_padding_share"))


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
    measured: Measured | None = None,
) -> Advice:
    """TRL's benchmark's guide: generate() for N < 32; CB for N >= 32 with variable completion lengths, text only,
    in-process (no weight sync); vLLM for maximum throughput or tensor parallel / multi-node. A plan with a
    budget adds the memory rule: when generate() won't fit and CB will, CB.

    Completion-length spread is ``completion_cv`` (std / mean) or ``mean_completion_len`` over
    ``max_new_tokens`` (generate()'s wasted decode slots are about 1 - mean/max); unknown counts as
    variable, as GRPO completions usually are, and the reasons say it was assumed.

    Those N and spread thresholds are TRL's benchmark's GPU measurements (``Advice.basis`` says so). ``measured``, a
    sweep of this machine (`measured_from_sweep`), replaces them: its speed and memory ratios at the nearest
    N, under the length workload it ran, decide instead.
    """
    check_positive(num_generations=num_generations, num_gpus=num_gpus)
    n = num_generations
    if tensor_parallel:
        return Advice("vllm", [
            "tensor parallel (a model split over GPUs): cbkit's backends run one model copy on one device; "
            "vLLM serves a tensor-parallel model, driven from TRL's GRPOTrainer (cbkit.trl.config)",
        ])
    reasons: list[str] = []
    if num_gpus > 1:
        reasons.append(f"{num_gpus} GPUs: run data parallel through TRL's GRPOTrainer under accelerate "
                       "(cbkit.trl.config); each GPU's rollout follows the rest of this advice")
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
    if measured is not None:  # this machine's sweep replaces TRL's benchmark's N and spread thresholds
        return _from_measured(measured, reasons)
    if n < CB_MIN_N:
        return Advice("generate", reasons + [
            f"N={n} < {CB_MIN_N}: TRL's reported A100 benchmark measured parity at N=8; with few sequences per prompt the padded "
            "static batch wastes little and CB's per-step scheduling overhead is not paid back",
        ], TRL_BENCHMARK_BASIS)
    variable, spread = _spread(completion_cv, mean_completion_len, max_new_tokens)
    if not variable:
        return Advice("generate", reasons + [
            f"N={n} >= {CB_MIN_N} but completion lengths are uniform ({spread}): generate() wastes few decode "
            "slots, so there is little for recycling to win back",
        ], TRL_BENCHMARK_BASIS)
    return Advice("continuous", reasons + [
        f"N={n} >= {CB_MIN_N} with variable completion lengths ({spread}): generate() keeps finished rows "
        "in the batch until the longest ends, CB recycles their blocks and slots (~1.25x at N=32/64 in TRL's reported A100 benchmark)",
        "text only, and the engine runs in the training process on the same weights: no weight sync",
    ], TRL_BENCHMARK_BASIS)


def _from_measured(m: Measured, reasons: list[str]) -> Advice:
    """The speed rule from a sweep of this machine instead of TRL's benchmark's thresholds: CB when it measured
    faster than generate() by more than the parity margin, generate() when slower; at parity the lighter."""
    basis = f"measured: {m.describe()}"
    speed, mem = m.speed_vs_generate, m.mem_vs_generate
    if speed is None:
        raise ValueError(f"--from: {m.path} has no speed ratio at N={m.n}.")
    mem_text = f", {mem:.2f}x its peak memory" if mem is not None else ""
    said = f"CB measured {speed:.2f}x generate()'s completion tokens/s at N={m.n}{mem_text}"
    if speed > 1 + PARITY_MARGIN:
        return Advice("continuous", reasons + [
            f"{said}: recycling finished rows' slots pays for the engine's overhead at this length spread",
            "text only, and the engine runs in the training process on the same weights: no weight sync",
        ], basis)
    if speed < 1 - PARITY_MARGIN:
        return Advice("generate", reasons + [
            f"{said}: at this length spread the engine's per-step overhead costs more than the padding it saves",
        ], basis)
    lighter: Backend = "continuous" if mem is not None and mem < 1 - PARITY_MARGIN else "generate"
    return Advice(lighter, reasons + [
        f"{said}: parity within {PARITY_MARGIN:.0%}, so memory decides"
        + (": CB's pool is the lighter" if lighter == "continuous" else ": generate() is no heavier"),
    ], basis)


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
