"""`cbkit demo`: one GRPO-shaped rollout through each backend, side by side."""

from __future__ import annotations

import argparse

from cbkit.cli.flags import dataclass_flags, given_fields


def _demo(args: argparse.Namespace) -> int:
    from cbkit.teach.demo import DemoConfig, format_table, run_demo

    cfg = DemoConfig(**given_fields(args, DemoConfig))
    results = run_demo(cfg)
    print(f"\n{cfg.num_prompts} prompts x N={cfg.num_generations}, max_new_tokens={cfg.max_new_tokens}, "
          f"model={cfg.model}, data={cfg.data}")
    print("peak memory: CPU RSS above the post-load baseline (indicative); CUDA max_memory_allocated on a GPU")
    print(format_table(results))
    return 0


def add_demo(sub: argparse._SubParsersAction) -> None:
    """`cbkit demo`, every `DemoConfig` field a flag."""
    from cbkit.teach.demo import DemoConfig

    demo = sub.add_parser("demo", parents=[dataclass_flags(DemoConfig)],
                          help="one GRPO-shaped rollout through each backend, side by side",
                          description="Every DemoConfig field is a flag; those the training run also has carry "
                                      "CBGRPOConfig's help.")
    demo.set_defaults(func=_demo)
