"""A dataclass as flags: one per field, made by transformers' `HfArgumentParser` and adapted where it cannot express
what cbkit needs (each reason beside it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any


def given_fields(args: argparse.Namespace, dtype: type) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(dtype) if f.name in vars(args)}


def dataclass_flags(dtype: type) -> argparse.ArgumentParser:
    """One flag per field of `dtype`: a parent parser for `add_parser(..., parents=[...])`. Defaults become
    `SUPPRESS` (a resumed checkpoint's config and a recipe lie under the flags, so only flags given may override
    them); `none` sets an Optional field to None; dict fields take JSON; list fields take comma-separated values."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(typing.cast(Any, dtype), add_help=False)  # its DataClassType is a NewType of Any
    hints = typing.get_type_hints(dtype)
    fields = {f.name: f for f in dataclasses.fields(dtype)}
    for action in parser._actions:
        f = fields.get(action.dest)
        if f is None:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        store_false = isinstance(action, argparse._StoreFalseAction)  # the --no-<flag> twin of a boolean
        action.default, action.required = argparse.SUPPRESS, required and not store_false
        if store_false:
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        text = f.metadata.get("help") or f"{dtype.__name__}.{f.name}"
        action.help = (text if required else f"{text} (default: {default!r})").replace("%", "%%")
        base, optional = hints[f.name], type(None) in typing.get_args(hints[f.name])
        if optional:
            base = next(a for a in typing.get_args(base) if a is not type(None))
        flag = action.option_strings[-1]
        if typing.get_origin(base) is dict:
            action.type = _json_value(flag)
        elif typing.get_origin(base) in (list, tuple):
            action.type, action.nargs = _comma_list(typing.get_args(base)[0], flag), "+"
            action.__class__ = _ListFlag  # was a plain store action: store the words' lists as one list
        if optional:
            action.type = _or_none(action.type)
    return parser


class _ListFlag(argparse._StoreAction):
    """A list flag whose words may each hold a comma-separated list: `--ns 8,16 32` is [8, 16, 32]."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, None if None in values else [x for part in values for x in part])


def _json_value(flag: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} is not valid JSON ({e.msg}): {text!r}. Example: {flag} "
                                             "'{\"page_size\": 32, \"num_blocks\": 256}'") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object of settings ({{...}}), got {text!r}.")
        return value

    return parse


def _comma_list(item: type, flag: str):
    def parse(text: str) -> list:
        try:
            return [item(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            kind = "integers like 8,16,32,64" if item is int else f"{item.__name__} values"
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated {kind}; got {text!r}.") from None

    return parse


def _or_none(parse):
    def convert(text: str):
        return None if text.lower() == "none" else parse(text)

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in "invalid <name> value" errors
    return convert
