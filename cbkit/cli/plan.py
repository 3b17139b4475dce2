"""`cbkit advise` and `cbkit tiers`: the planner's answers, read from model configs, with no GPU and no model
loaded."""

from __future__ import annotations

import argparse
from typing import Any

from cbkit.cli.flags import dataclass_flags, given_fields


def _advise(args: argparse.Namespace) -> int:
    from cbkit.measure.advise import AdviseConfig, measured_from_sweep, recommend
    from cbkit.measure.planner import crossover_n, plan
    from cbkit.models.load import load_config

    a = AdviseConfig(**given_fields(args, AdviseConfig))
    sizes: dict[str, Any] = dict(num_prompts=a.num_prompts, prompt_len=a.prompt_len, max_new_tokens=a.max_new_tokens,
                 mean_completion_len=a.mean_completion_len, dtype_bytes=a.dtype_bytes, budget_bytes=a.budget_bytes,
                 device=a.device)
    measured = measured_from_sweep(a.results_from, a.num_generations) if a.results_from else None
    config = load_config(a.model)
    memory = plan(config, num_generations=a.num_generations, model_name=a.model, **sizes)
    cross = crossover_n(config, max_n=max(1024, 4 * a.num_generations), **sizes)
    advice = recommend(a.num_generations, completion_cv=a.completion_cv, mean_completion_len=a.mean_completion_len,
                       max_new_tokens=a.max_new_tokens, multimodal=a.multimodal,
                       need_max_throughput=a.max_throughput, num_gpus=a.gpus, tensor_parallel=a.tensor_parallel,
                       memory=memory if a.budget_bytes is not None else None, measured=measured)
    print("Predicted peak memory above the weights, one rollout:")
    print(memory.summary())
    print(f"crossover: CB's predicted peak is below generate()'s from N={cross}" if cross is not None
          else "crossover: CB's predicted peak stays above generate()'s for every N up to "
               f"{max(1024, 4 * a.num_generations)}")
    print(f"\nAdvice: {advice}")
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
    print(f"\n{len(plans) - len(failed)} of {len(plans)} notebook x GPU plans fit, finish within budget and show "
          "their phenomenon" + ("." if not failed else f"; {len(failed)} do not (above)."))
    if not args.notebooks:  # the learning recipe on the same GPUs: its CB and generate() runs with evaluations
        recipes = plan_recipes(names(args.gpus, list(MACHINES), "GPU(s)"))
        print("\nThe learning recipe (recipes/smollm2_arith.yaml) on the GPU tiers: one CB run with its held-out "
              "evaluations. AN ESTIMATE: no GPU has run it; the GPU model needs its difficulty measured "
              "first (docs/learning.md).\n" + "\n".join(p.line() for p in recipes))
        for p in recipes:
            for problem in p.problems():
                print(f"  {p.notebook} on {p.machine}: {problem}")
        failed += [p for p in recipes if not (p.fits and p.admitted)]
        presets = plan_presets()
        print("\nThe sweep's GPU presets (cbkit sweep --preset), the largest point on the smallest GPU each is for, "
              "with transformers' own admission check:\n" + "\n".join(p.line() for p in presets))
        failed += [p for p in presets if not p.ok]
    return 1 if failed else 0


def add_advise(sub: argparse._SubParsersAction) -> None:
    """`cbkit advise`, every `AdviseConfig` field a flag."""
    from cbkit.measure.advise import AdviseConfig

    advise = sub.add_parser(
        "advise", parents=[dataclass_flags(AdviseConfig)],
        help="predict both backends' peak memory and recommend generate, CB or vLLM",
        description="Reads only the model's config. Prints the planner's prediction for generate() and the CB "
                    "engine, the N from which CB uses less memory, and the decision guide applied (its "
                    "thresholds from TRL's A100 benchmark), or with --from a sweep measured on this machine. Every "
                    "AdviseConfig field is a flag.",
    )
    advise.set_defaults(func=_advise)


def add_tiers(sub: argparse._SubParsersAction) -> None:
    """`cbkit tiers`: every notebook planned on each GPU tier; exit 1 where one does not fit."""
    tiers = sub.add_parser(
        "tiers", help="plan every notebook on a T4 and an A100 (40/80 GB): fit, runtime, crossover; no GPU needed",
        description="For every notebook and GPU tier (t4: 15 GiB fp16; a100: 40 and 80 GiB bf16): the planned peak "
                    "against memory (the training step included where the notebook trains), the estimated runtime "
                    "against the budget (~10 min on a T4, ~5 on an A100), and whether each memory sweep's "
                    "crossover lies inside its swept N. Exits 1 where a configuration does not fit, overruns its "
                    "budget or hides its phenomenon. Sizes: cbkit/teach/tiers/table.py.",
    )
    tiers.add_argument("--notebooks", default=None, help="comma-separated notebook names (default: all)")
    tiers.add_argument("--gpus", default=None, help="comma-separated: t4, a100-40, a100-80 (default: all)")
    tiers.set_defaults(func=_tiers)
