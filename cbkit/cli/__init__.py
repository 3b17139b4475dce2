"""`cbkit <command>`: the kit's entry points. Each command is a function taking parsed args, easy to add to.

`train`, `sweep`, `demo` and `advise` take one flag per field of their config dataclass (`CBGRPOConfig`,
`SweepConfig`, `DemoConfig`, `AdviseConfig`), made by transformers' `HfArgumentParser`, the parser TRL's scripts
use: typed from the annotation, help from the field's metadata, both `--num_generations` and `--num-generations`
(and a field's `aliases`, such as `-N`), booleans as `--flag [true|false]` plus `--no-flag` where the default is
True. A field added to a dataclass is a flag without touching this file; a field without a default is a required
flag.
`cbkit train --config recipe.yaml` reads a run from a YAML file of `CBGRPOConfig` fields, the way TRL's
`TrlParser` reads `--config`; flags given next to it win. (TRL itself is not imported: a bare GPU image has
transformers but not trl.) What `HfArgumentParser` cannot express is adapted in `_given_flags_only`, each
reason beside it.
"""

from __future__ import annotations

import argparse
import sys

from cbkit.cli.demo import add_demo
from cbkit.cli.plan import add_advise, add_tiers
from cbkit.cli.sweep import add_report, add_sweep
from cbkit.cli.train import add_plot, add_train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_demo, add_sweep, add_report, add_plot, add_train, add_advise, add_tiers):  # the help's order
        add(sub)
    for command in (parser, *sub.choices.values()):
        # A flag's bad value reaches main() as an ArgumentError, which prints it as the one line every other
        # bad input gets, instead of argparse's usage dump.
        command.exit_on_error = False
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error (status 2) or the help (status 0)
        return int(e.code or 0)
    except argparse.ArgumentError as e:
        # cbkit's own flag types name the flag in their message; argparse's ("invalid int value") need its name.
        said = e.message if e.message.startswith("--") else str(e)
        print(f"cbkit {argv[0] if argv else ''}: error: {said}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError, FileExistsError, FloatingPointError) as e:
        # Bad input: one clear line that says what to change, not a traceback.
        print(f"cbkit {args.command}: error: {e}", file=sys.stderr)
        return 2
