"""`cbkit <command>`: the kit's entry points. Each command is a function taking parsed args, easy to add to."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from cbkit.demo import format_table, run_demo

    results = run_demo(
        model=args.model,
        data=args.data,
        num_prompts=args.prompts,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        backends=tuple(args.backends.split(",")),
        cb_config=json.loads(args.cb_config) if args.cb_config else None,
        seed=args.seed,
        out=args.out,
    )
    print(f"\n{args.prompts} prompts x N={args.num_generations}, max_new_tokens={args.max_new_tokens}, "
          f"model={args.model}, data={args.data}")
    print("peak memory: CPU RSS above the post-load baseline (indicative); CUDA max_memory_allocated on a GPU")
    print(format_table(results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from cbkit.models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="cbkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="one GRPO-shaped rollout through each backend, side by side")
    demo.add_argument("--model", default=DEFAULT_MODEL,
                      help="smollm2-offline (default), tiny, a hub id or a local directory")
    demo.add_argument("--data", default="synthetic",
                      help="synthetic (default, offline), gsm8k-local, gsm8k[:split] (hub), or a .jsonl path")
    demo.add_argument("--prompts", type=int, default=2, help="number of prompts")
    demo.add_argument("-N", "--num-generations", type=int, default=8, help="completions per prompt")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--temperature", type=float, default=1.0)
    demo.add_argument("--top-p", type=float, default=1.0)
    demo.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    demo.add_argument("--backends", default="generate,continuous")
    demo.add_argument("--cb-config", default=None,
                      help='JSON overrides for the CB engine, e.g. \'{"max_memory_percent": 0.4}\'')
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default=None, help="append one JSON line per backend to this file")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        # Bad input: one clear line that says what to change, not a traceback.
        print(f"cbkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
