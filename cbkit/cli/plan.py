"""`cbkit plan` and `cbkit tiers`: the planner's answers, read from model configs, with no GPU and no weights."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from cbkit.cli.flags import dataclass_flags, given_fields
from cbkit.measure.planner import crossover_n, plan
from cbkit.models.load import DEFAULT_MODEL, DTYPES, load_config
from cbkit.teach.tiers.plan import plan_notebook
from cbkit.teach.tiers.table import MACHINES, NOTEBOOKS
from cbkit.telemetry import fmt_bytes, kv_bytes_per_token
from cbkit.train.config import _help, same_as


@dataclass
class PlanConfig:
    """What `cbkit plan` is asked: every field is a flag (`cbkit.cli.flags.dataclass_flags`). Only -N is required."""

    num_generations: int = same_as("num_generations", aliases=("-N",))
    model: str = _help("the model whose config is planned (no weights loaded)", default=DEFAULT_MODEL)
    num_prompts: int = field(default=8, metadata={"help": "prompts per rollout", "aliases": ["--prompts"]})
    prompt_len: int = _help("longest prompt, tokens", default=256)
    max_new_tokens: int = same_as("max_completion_length", default=512)
    mean_completion_len: float | None = _help("mean completion length in tokens, if known", default=None)
    budget_gb: float | None = _help("GiB free after loading the weights (needed for cuda)", default=None)
    device: str | None = _help("cuda or cpu; cuda when --budget-gb is given, else cpu", default=None)
    dtype: str | None = _help(f"one of {', '.join(DTYPES)} (default bf16 on cuda, fp32 on cpu)", default=None)

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"-N must be >= 1, got {self.num_generations}.")
        if self.budget_gb is not None and not self.budget_gb > 0:
            raise ValueError(f"--budget-gb must be > 0 (GiB free after loading the weights), got {self.budget_gb}.")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}.")
        if self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"--device must be cuda or cpu; got {self.device!r}.")
        self.device = self.device or ("cuda" if self.budget_gb is not None else "cpu")
        if self.device == "cuda" and self.budget_gb is None:
            raise ValueError("on cuda the CB engine sizes its pool as a share of free memory: give --budget-gb, the "
                             "GiB free after loading the weights.")


def _plan(args: argparse.Namespace) -> int:
    a = PlanConfig(**given_fields(args, PlanConfig))
    dtype_bytes = DTYPES[a.dtype].itemsize if a.dtype else (2 if a.device == "cuda" else 4)
    sizes: dict[str, Any] = dict(num_prompts=a.num_prompts, prompt_len=a.prompt_len, max_new_tokens=a.max_new_tokens,
                                 mean_completion_len=a.mean_completion_len, dtype_bytes=dtype_bytes, device=a.device,
                                 budget_bytes=int(a.budget_gb * 1024**3) if a.budget_gb is not None else None)
    config = load_config(a.model)
    memory = plan(config, num_generations=a.num_generations, **sizes)
    max_n = max(1024, 4 * a.num_generations)
    gen, cb = memory.generate.peak_bytes, memory.continuous.peak_bytes
    budget = f"budget {fmt_bytes(sizes['budget_bytes'])} free after the weights" if a.budget_gb else "no budget"
    print(f"Planned peak memory above the weights, one rollout of {a.model}: {a.num_prompts} prompts x "
          f"N={a.num_generations}, prompt {a.prompt_len} + up to {a.max_new_tokens} new tokens, {dtype_bytes}-byte "
          f"dtype, {a.device}, {budget}; KV {fmt_bytes(kv_bytes_per_token(config, dtype_bytes))} a token")
    print(memory.summary())
    print(f"lower peak at N={a.num_generations}: {'continuous' if cb < gen else 'generate'} "
          f"(continuous/generate {cb / gen:.2f})")
    if memory.continuous.sized_by == "workload":  # CB's pool grows with N as generate()'s cache does
        print("crossover N: none, the pool is sized to the workload")
    else:
        cross = crossover_n(config, max_n=max_n, **sizes)
        print(f"crossover N: {cross}" if cross is not None else f"crossover N: none up to {max_n}")
    return 0


def _tiers(args: argparse.Namespace) -> int:
    plans = [plan_notebook(n, m) for n in args.notebooks or NOTEBOOKS for m in args.gpus or MACHINES]
    print(f"{'notebook':23} {'GPU':8} {'peak of memory':>24} {'host RAM':>10} {'engine start of free':>24}  verdict")
    print("\n".join(p.line() for p in plans))
    print("\n".join(f"  {p.notebook} on {p.machine}: {problem}" for p in plans for problem in p.problems()))
    failed = sum(bool(p.problems()) for p in plans)
    print(f"{len(plans) - failed} of {len(plans)} notebook x GPU plans fit and start their CB engines.")
    return 1 if failed else 0


def add_plan(sub: argparse._SubParsersAction) -> None:
    command = sub.add_parser("plan", parents=[dataclass_flags(PlanConfig)],
                             help="plan both backends' peak memory at N and the crossover N from the model's config")
    command.set_defaults(func=_plan)


def add_tiers(sub: argparse._SubParsersAction) -> None:
    tiers = sub.add_parser("tiers", help="plan every notebook (cbkit/teach/tiers/table.py) on a T4 and an A100 (40/80 "
                           "GB): memory fit and CB engine start, no GPU; exit 1 where one fails")
    tiers.add_argument("--notebooks", nargs="+", choices=list(NOTEBOOKS), metavar="NAME", help=", ".join(NOTEBOOKS))
    tiers.add_argument("--gpus", nargs="+", choices=list(MACHINES), metavar="GPU", help=", ".join(MACHINES))
    tiers.set_defaults(func=_tiers)
