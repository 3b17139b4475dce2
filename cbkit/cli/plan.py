"""`cbkit plan` and `cbkit tiers`: the planner's answers, read from model configs, with no GPU and no model
loaded."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from cbkit.cli.flags import dataclass_flags, given_fields
from cbkit.measure.planner import DTYPE_BYTES
from cbkit.models.load import DEFAULT_MODEL
from cbkit.train.config import same_as


def _flag(text: str, default=None, *aliases: str):
    return field(default=default, metadata={"help": text, **({"aliases": list(aliases)} if aliases else {})})


@dataclass
class PlanConfig:
    """What `cbkit plan` is asked: every field is a flag (`cbkit.cli.flags.dataclass_flags`). Only -N is required."""

    num_generations: int = same_as("num_generations", aliases=("-N",))
    model: str = _flag("the model whose config is planned (no weights loaded)", DEFAULT_MODEL)
    num_prompts: int = _flag("prompts per rollout", 8, "--prompts")
    prompt_len: int = _flag("longest prompt, tokens", 256)
    max_new_tokens: int = same_as("max_completion_length", default=512)
    mean_completion_len: float | None = _flag("mean completion length in tokens, if known")
    budget_gb: float | None = _flag("GiB free after loading the weights (needed for cuda)")
    device: str | None = _flag("cuda or cpu; cuda when --budget-gb is given, else cpu")
    dtype: str | None = _flag(f"one of {', '.join(DTYPE_BYTES)} (default bf16 on cuda, fp32 on cpu)")

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


def _plan(args: argparse.Namespace) -> int:
    """The planner's one page: both backends' planned peaks at N, the lower one, and the crossover N."""
    from cbkit.measure.planner import crossover_n, plan
    from cbkit.models.load import load_config

    a = PlanConfig(**given_fields(args, PlanConfig))
    dtype_bytes = DTYPE_BYTES[a.dtype] if a.dtype else (2 if a.device == "cuda" else 4)
    sizes: dict[str, Any] = dict(num_prompts=a.num_prompts, prompt_len=a.prompt_len, max_new_tokens=a.max_new_tokens,
                                 mean_completion_len=a.mean_completion_len, dtype_bytes=dtype_bytes, device=a.device,
                                 budget_bytes=int(a.budget_gb * 1024**3) if a.budget_gb is not None else None)
    config = load_config(a.model)
    memory = plan(config, num_generations=a.num_generations, model_name=a.model, **sizes)
    max_n = max(1024, 4 * a.num_generations)
    # A pool sized to the workload grows with N as generate()'s cache does: no N from which CB stays lighter.
    cross = crossover_n(config, max_n=max_n, **sizes) if memory.continuous.sized_by != "workload" else None
    gen, cb = memory.generate.peak_bytes, memory.continuous.peak_bytes
    print("Planned peak memory above the weights, one rollout:")
    print(memory.summary())
    print(f"lower peak at N={a.num_generations}: {'continuous' if cb < gen else 'generate'} "
          f"(continuous/generate {cb / gen:.2f})")
    print(f"crossover N: {cross}" if cross is not None else "crossover N: none, the pool is sized to the workload"
          if memory.continuous.sized_by == "workload" else f"crossover N: none up to {max_n}")
    return 0


def _tiers(args: argparse.Namespace) -> int:
    from cbkit.teach.tiers import MACHINES, NOTEBOOKS, plan_all, plan_presets, plan_recipes, tiers_report

    def names(value: str | None, valid, what: str) -> list[str] | None:
        if not value:
            return None
        chosen = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in valid]
        if unknown:
            raise ValueError(f"unknown {what} {unknown}; choose from {', '.join(valid)}.")
        return chosen

    plans = plan_all(names(args.notebooks, list(NOTEBOOKS), "notebook(s)"), names(args.gpus, list(MACHINES), "GPU(s)"))
    print(tiers_report(plans))
    failed: list[Any] = [p for p in plans if not p.ok]
    print(f"\n{len(plans) - len(failed)} of {len(plans)} notebook x GPU plans fit, start their engines and show "
          "their phenomenon" + ("." if not failed else f"; {len(failed)} do not (above)."))
    if not args.notebooks:  # the learning recipe on the same GPUs: its CB and generate() runs with evaluations
        recipes = plan_recipes(names(args.gpus, list(MACHINES), "GPU(s)"))
        print("\nThe learning recipe (recipes/smollm2_arith.yaml) on the GPU tiers: one CB run with its held-out "
              "evaluations.\n" + "\n".join(p.line() for p in recipes))
        for p in recipes:
            for problem in p.problems():
                print(f"  {p.notebook} on {p.machine}: {problem}")
        failed += [p for p in recipes if not (p.fits and p.admitted)]
        presets = plan_presets()
        print("\nThe sweep's GPU presets (cbkit sweep --preset), the largest point on the smallest GPU each is for, "
              "with transformers' own admission check:\n" + "\n".join(p.line() for p in presets))
        failed += [p for p in presets if not p.ok]
    return 1 if failed else 0


def add_plan(sub: argparse._SubParsersAction) -> None:
    """`cbkit plan`, every `PlanConfig` field a flag."""
    command = sub.add_parser(
        "plan", parents=[dataclass_flags(PlanConfig)],
        help="plan both backends' peak memory at N and the crossover N; no GPU, no weights",
        description="Reads only the model's config. Prints the planner's peak for generate() and the CB engine at "
                    "N, which is lower, and the N from which CB's planned peak stays below generate()'s. Every "
                    "PlanConfig field is a flag.",
    )
    command.set_defaults(func=_plan)


def add_tiers(sub: argparse._SubParsersAction) -> None:
    """`cbkit tiers`: every notebook planned on each GPU tier; exit 1 where one does not fit."""
    tiers = sub.add_parser(
        "tiers", help="plan every notebook on a T4 and an A100 (40/80 GB): fit, engine start, crossover; no GPU needed",
        description="For every notebook and GPU tier (t4: 15 GiB fp16; a100: 40 and 80 GiB bf16): the planned peak "
                    "against memory (the training step included where the notebook trains) and the copies of the "
                    "weights against host RAM, transformers' own verdict on each CB engine start, and whether each "
                    "memory sweep's crossover lies inside its swept N. Exits 1 where a configuration does not fit, "
                    "would not start its engine or hides its phenomenon. Sizes: cbkit/teach/tiers/table.py.",
    )
    tiers.add_argument("--notebooks", default=None, help="comma-separated notebook names (default: all)")
    tiers.add_argument("--gpus", default=None, help="comma-separated: t4, a100-40, a100-80 (default: all)")
    tiers.set_defaults(func=_tiers)
