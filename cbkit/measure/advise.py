"""Which rollout backend? TRL's benchmark's decision guide as a function, with the memory plan as one input.

``recommend`` turns N, the spread of completion lengths, the modality, the need for throughput, the GPU count
and (optionally) a memory plan (`cbkit.measure.planner.plan`) into a backend with its reasons. The planner's names are
re-exported here because notebooks and the CLI import them from ``cbkit.measure.advise``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cbkit.measure.planner import DTYPE_BYTES, Plan, check_positive
from cbkit.models.load import DEFAULT_MODEL
from cbkit.telemetry import fmt_bytes
from cbkit.train.config import same_as

__all__ = [
    "AdviseConfig",
    "Advice",
    "Measured",
    "measured_from_sweep",
    "recommend",
    "versus_parity",
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
# Measured ratios within this margin of 1.0 count as parity: repeats of one point on a shared machine differ
# by a few percent, so a 3% "win" is not one. The one "about equal" rule of cbkit: the advice, the sentences
# printed under a run (cbkit.teach.findings) and the measured crossover all call `versus_parity`.
PARITY_MARGIN = 0.05


def versus_parity(ratio: float, margin: float = PARITY_MARGIN) -> int:
    """1 if ``ratio`` is above parity by more than ``margin``, -1 if below by more, 0 if about equal."""
    if ratio != ratio:  # NaN: nothing measured, so nothing to call above or below
        raise ValueError("versus_parity: the ratio is NaN; a ratio needs two measured numbers.")
    return 1 if ratio > 1 + margin else -1 if ratio < 1 - margin else 0


def _flag(text: str, default=None, *aliases: str):
    return field(default=default, metadata={"help": text, **({"aliases": list(aliases)} if aliases else {})})


@dataclass
class AdviseConfig:
    """What `cbkit advise` is asked: every field is a flag (`cbkit.cli.flags.dataclass_flags`). Only -N is required."""

    num_generations: int = same_as("num_generations", aliases=("-N",))
    model: str = _flag("the model whose config is planned (no weights loaded): smollm2-offline, tiny, a hub id or a "
                       "local directory", DEFAULT_MODEL)
    num_prompts: int = _flag("prompts per rollout", 8, "--prompts")
    prompt_len: int = _flag("longest prompt, tokens", 256)
    max_new_tokens: int = same_as("max_completion_length", default=512)
    mean_completion_len: float | None = _flag("mean completion length in tokens, if known: measures the spread of "
                                              "lengths")
    completion_cv: float | None = _flag("coefficient of variation of completion lengths, if known")
    budget_gb: float | None = _flag("GiB free after loading the weights (needed for cuda)")
    device: str | None = _flag("cuda or cpu; cuda when --budget-gb is given, else cpu (where cbkit sizes the pool to "
                               "the workload)")
    dtype: str | None = _flag(f"one of {', '.join(DTYPE_BYTES)} (default bf16 on cuda, fp32 on cpu)")
    multimodal: bool = _flag("prompts carry images or audio", False)
    max_throughput: bool = _flag("rollout throughput above all (weight sync to a separate engine acceptable)", False)
    gpus: int = _flag("GPUs available", 1)
    tensor_parallel: bool = _flag("the model must be split over GPUs", False)
    results_from: str | None = _flag("decide from a `cbkit sweep` results file measured here (its speed and memory "
                                     "ratios at the nearest N, and its length statistics) instead of the A100 "
                                     "thresholds", None, "--from")

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"-N must be >= 1, got {self.num_generations}.")
        if self.budget_gb is not None and not self.budget_gb > 0:
            raise ValueError(f"--budget-gb must be > 0 (GiB free after loading the weights), got {self.budget_gb}.")
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}; got {self.dtype!r}.")
        if self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"--device must be cuda or cpu; got {self.device!r}.")
        self.device = self.device or ("cuda" if self.budget_gb is not None else "cpu")
        if self.device == "cuda" and self.budget_gb is None:
            raise ValueError("on cuda the CB engine sizes its pool as a share of free memory: give --budget-gb, the "
                             "GiB free after loading the weights (e.g. ~76 on an A100-80GB with a 1B model in bf16).")

    @property
    def budget_bytes(self) -> int | None:
        return int(self.budget_gb * 1024**3) if self.budget_gb is not None else None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype] if self.dtype else (2 if self.device == "cuda" else 4)


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
        if memory is not None and gen_fits is False:
            reasons.append(f"generate() is predicted to need {fmt_bytes(memory.generate.peak_bytes)} of a "
                           f"{fmt_bytes(memory.budget_bytes)} budget: lower N or the prompts per step")
        return Advice("generate", reasons)
    if memory is not None and gen_fits is False and cb_fits:
        return Advice("continuous", reasons + [
            f"memory: generate() is predicted to need {fmt_bytes(memory.generate.peak_bytes)} (KV for every row at "
            f"full length) and the budget is {fmt_bytes(memory.budget_bytes)}; CB's fixed pool fits "
            f"({fmt_bytes(memory.continuous.peak_bytes)}) and recycles blocks as sequences finish",
        ])
    if memory is not None and gen_fits is False and cb_fits is False:
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
    if versus_parity(speed) > 0:
        return Advice("continuous", reasons + [
            f"{said}: what CB saves here (the group's prompt prefilled once, padding not decoded, freed slots "
            "refilled: notebook 03's split measures each) pays for the engine's per-step overhead",
            "text only, and the engine runs in the training process on the same weights: no weight sync",
        ], basis)
    if versus_parity(speed) < 0:
        return Advice("generate", reasons + [
            f"{said}: the engine's per-step overhead costs more than what it saves here (shared prompt prefill, "
            "padding, recycling: notebook 03's split measures each)",
        ], basis)
    lighter: Backend = "continuous" if mem is not None and versus_parity(mem) < 0 else "generate"
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
