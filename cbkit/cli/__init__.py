"""`cbkit <command>`: the kit's entry points. `train`, `sweep` and `plan` take one flag per field of their
config dataclass (`cbkit.cli.flags`): a field added is a flag."""

from __future__ import annotations

import argparse
import sys

from cbkit.cli.plan import add_plan, add_tiers
from cbkit.cli.sweep import add_sweep
from cbkit.cli.train import add_plot, add_train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_sweep, add_plot, add_train, add_plan, add_tiers):  # the help's order
        add(sub)
    for command in (parser, *sub.choices.values()):  # a bad flag value: one line, as every other bad input
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
        print(f"cbkit {args.command}: error: {e}", file=sys.stderr)
        return 2
