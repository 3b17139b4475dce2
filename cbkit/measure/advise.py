"""`cbkit advise`: the memory plan of both backends (`cbkit.measure.planner`) and, from it, TRL's benchmark's
decision guide (`recommend`), or a sweep measured on this machine (`measured_from_sweep`) in its place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cbkit.measure.planner import DTYPE_BYTES, Plan
from cbkit.models.load import DEFAULT_MODEL
from cbkit.train.config import same_as

Backend = Literal["generate", "continuous", "vllm"]
# TRL's benchmark (PR #5765, A100): parity at N=8, ~1.25x from N=32. Lengths count as variable from a CV of 0.2, or
# where 20% of generate()'s decode slots go to rows already finished.
CB_MIN_N, VARIABLE_CV, VARIABLE_WASTE = 32, 0.2, 0.2
TRL_BENCHMARK_BASIS = "thresholds from TRL's reported A100 benchmark (PR #5765), not this machine; --from a sweep"
# Ratios within 5% of 1.0 are parity: repeats of one point on a shared machine differ by a few percent.
PARITY_MARGIN = 0.05


def versus_parity(ratio: float, margin: float = PARITY_MARGIN) -> int:
    """1 if ``ratio`` is above parity by more than ``margin``, -1 if below by more, 0 if about equal."""
    if ratio != ratio:
        raise ValueError("versus_parity: the ratio is NaN; a ratio needs two measured numbers.")
    return 1 if ratio > 1 + margin else -1 if ratio < 1 - margin else 0


def _flag(text: str, default=None, *aliases: str):
    return field(default=default, metadata={"help": text, **({"aliases": list(aliases)} if aliases else {})})


@dataclass
class AdviseConfig:
    """What `cbkit advise` is asked: every field is a flag (`cbkit.cli.flags.dataclass_flags`). Only -N is required."""

    num_generations: int = same_as("num_generations", aliases=("-N",))
    model: str = _flag("the model whose config is planned (no weights loaded)", DEFAULT_MODEL)
    num_prompts: int = _flag("prompts per rollout", 8, "--prompts")
    prompt_len: int = _flag("longest prompt, tokens", 256)
    max_new_tokens: int = same_as("max_completion_length", default=512)
    mean_completion_len: float | None = _flag("mean completion length in tokens, if known")
    completion_cv: float | None = _flag("coefficient of variation of completion lengths, if known")
    budget_gb: float | None = _flag("GiB free after loading the weights (needed for cuda)")
    device: str | None = _flag("cuda or cpu; cuda when --budget-gb is given, else cpu")
    dtype: str | None = _flag(f"one of {', '.join(DTYPE_BYTES)} (default bf16 on cuda, fp32 on cpu)")
    multimodal: bool = _flag("prompts carry images or audio", False)
    max_throughput: bool = _flag("rollout throughput above all (weight sync to a separate engine acceptable)", False)
    gpus: int = _flag("GPUs available", 1)
    tensor_parallel: bool = _flag("the model must be split over GPUs", False)
    results_from: str | None = _flag("decide from a `cbkit sweep` results file measured here", None, "--from")

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
                             "GiB free after loading the weights.")

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
        return f"use {self.backend} ({'; '.join(self.reasons)})" + (f"\n  basis: {self.basis}" if self.basis else "")


@dataclass(frozen=True)
class Measured:
    """A sweep results file's medians at the N closest to the one asked about (`measured_from_sweep`)."""

    path: str
    n: int
    asked_n: int
    workload: str | None
    device: str | None
    speed_vs_generate: float | None
    mem_vs_generate: float | None
    length_mean: float | None
    length_cv: float | None
    length_max: float | None
    decode_padding_share: float | None

    def describe(self) -> str:
        where = f"N={self.n}" + (f" (nearest measured to N={self.asked_n})" if self.n != self.asked_n else "")
        spread = (f"lengths mean {self.length_mean:.1f}, CV {self.length_cv:.2f}, static batch padding "
                  f"{self.decode_padding_share:.0%}" if self.length_mean is not None else "no length statistics")
        return f"{self.path}: {where}, {self.workload or 'natural'} workload on {self.device or 'unknown'}; {spread}"


def measured_from_sweep(path: str, num_generations: int) -> Measured:
    """Read a `cbkit sweep` results file and take its medians at N (or the nearest measured N, larger on a tie)."""
    from cbkit.measure.results import aggregate, read_results

    try:
        results = read_results(path)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--from: {e}") from None
    by = {(q["backend"], q["N"]): q for q in aggregate(results.runs) if q["status"] == "ok"}
    ns = sorted(n for (b, n) in by if b == "continuous" and ("generate", n) in by)
    if not ns:
        raise ValueError(f"--from: {path} has no N at which both generate and continuous finished.")
    n = min(ns, key=lambda x: (abs(x - num_generations), -x))
    cb, gen = by[("continuous", n)], by[("generate", n)]
    fp = results.fingerprint
    return Measured(str(results.path), n, num_generations, fp.get("lengths"), fp.get("device"),
                    cb.get("speed_vs_generate"), cb.get("mem_vs_generate"), gen.get("length_mean"),
                    gen.get("length_cv"), gen.get("length_max"), gen.get("decode_padding_share"))


def recommend(num_generations: int, *, completion_cv: float | None = None, mean_completion_len: float | None = None,
              max_new_tokens: int | None = None, multimodal: bool = False, need_max_throughput: bool = False,
              num_gpus: int = 1, tensor_parallel: bool = False, memory: Plan | None = None,
              measured: Measured | None = None) -> Advice:
    """TRL's benchmark's guide, rule by rule: vLLM to split a model over GPUs or for maximum throughput; generate()
    for multimodal prompts (the engine takes token ids); the only backend a plan with a budget says fits; a sweep of
    this machine's speed ratio (at parity, the lighter backend); else CB from N >= 32 with variable lengths (unknown
    counts as variable)."""
    n = num_generations
    for name, v in (("num_generations", n), ("num_gpus", num_gpus)):
        if v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")
    if tensor_parallel or need_max_throughput:
        return Advice("vllm", ["tensor parallel" if tensor_parallel else "maximum throughput"])
    gen_fits, cb_fits = (memory.generate.fits, memory.continuous.fits) if memory is not None else (None, None)
    if multimodal:
        return Advice("generate", ["multimodal: the CB engine takes token ids only"])
    if gen_fits is False and memory is not None:
        cb = bool(cb_fits) or memory.continuous.peak_bytes < memory.generate.peak_bytes
        return Advice("continuous" if cb else "generate",
                      ["memory: generate() does not fit" + ("" if cb_fits else ", nor CB; lower N")])
    if measured is not None:
        speed, mem = measured.speed_vs_generate, measured.mem_vs_generate
        if speed is None:
            raise ValueError(f"--from: {measured.path} has no speed ratio at N={measured.n}.")
        said = f"CB measured {speed:.2f}x generate()'s tokens/s at N={measured.n}"
        basis = f"measured: {measured.describe()}"
        if versus_parity(speed):
            return Advice("continuous" if versus_parity(speed) > 0 else "generate", [said], basis)
        return Advice("continuous" if mem is not None and versus_parity(mem) < 0 else "generate",
                      [f"{said}: parity, so memory decides"], basis)
    if n < CB_MIN_N:
        return Advice("generate", [f"N={n} < {CB_MIN_N}"], TRL_BENCHMARK_BASIS)
    if completion_cv is not None:
        variable, spread = completion_cv >= VARIABLE_CV, f"length CV {completion_cv:.2f}"
    elif mean_completion_len is not None and max_new_tokens:
        waste = 1 - mean_completion_len / max_new_tokens
        variable, spread = waste >= VARIABLE_WASTE, f"~{waste:.0%} of generate()'s decode slots idle"
    else:
        variable, spread = True, "length spread assumed"
    return Advice("continuous" if variable else "generate", [f"N={n} >= {CB_MIN_N}", spread], TRL_BENCHMARK_BASIS)
