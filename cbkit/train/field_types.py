"""Every field of a config dataclass checked against its declared type, before any other check reads it.

A recipe's values arrive as YAML made them: `learning_rate: abc` is a string, and without this the first comparison
(`learning_rate > 0`) fails as a TypeError that names neither the field nor the fix. The annotations are the one
statement of each field's type (the CLI's flags are made from them too), so they are what a value is checked against,
generically: a field added later is checked without a line here.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import types
import typing
from typing import Any

_EXAMPLES: dict[Any, Any] = {int: 1, float: 0.5, bool: True, str: "text"}  # for a field whose default is None


def check_field_types(config: Any) -> None:
    """Check, in place, every field of the dataclass instance `config` against its annotation, before any other
    check reads it. Numbers take the field's type where nothing is lost (`1` for a float field is `1.0`, `8.0` for
    an int is `8`, numpy scalars are Python's), and a string that reads as a number is that number for a numeric
    field (PyYAML follows YAML 1.1, where `1e-6` is a string). Anything else raises a ValueError naming the field,
    the value given, the type expected and an example."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        ok, converted = _as_type(value, hints[f.name])
        if not ok:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            # The default, unless it is None or too long to read in one line (the system prompt).
            example = _example(hints[f.name]) if default is None or len(repr(default)) > 40 else default
            raise ValueError(f"{f.name}={value!r} ({type(value).__name__}) is not {_describe(hints[f.name])}; "
                             f"e.g. `{f.name}: {_yaml(example)}` in a recipe, `--{f.name} {_flag(example)}` "
                             "as a flag.")
        if converted is not value:
            setattr(config, f.name, converted)


def _as_type(value: Any, hint: Any) -> tuple[bool, Any]:
    """(whether `value` is a `hint`, the value as that type)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin is typing.Union or origin is types.UnionType:
        for arm in sorted(args, key=lambda a: a is not type(None)):  # None first: it never converts
            ok, out = _as_type(value, arm)
            if ok:
                return True, out
        return False, value
    if hint is type(None):
        return value is None, value
    if origin is typing.Literal:
        return value in args, value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        item = args[0] if args else Any
        items = [_as_type(v, item) for v in value]
        same = type(value) is origin and all(out is v for (_, out), v in zip(items, value, strict=True))
        return all(ok for ok, _ in items), value if same else origin(out for _, out in items)
    if origin is dict:
        if not isinstance(value, dict):
            return False, value
        key, val = args if args else (Any, Any)
        pairs = [(_as_type(k, key), _as_type(v, val)) for k, v in value.items()]
        same = all(k[1] is k0 and v[1] is v0 for (k, v), (k0, v0) in zip(pairs, value.items(), strict=True))
        return all(k[0] and v[0] for k, v in pairs), value if same else {k[1]: v[1] for k, v in pairs}
    if hint is bool:  # YAML's true/false; 0 and 1 are not switches
        return isinstance(value, bool), value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, numbers.Real | str):
            return False, value
        try:
            number = int(value) if isinstance(value, numbers.Integral) else hint(value) if isinstance(
                value, str) else float(value)
        except ValueError:
            return False, value
        if hint is int and not (isinstance(number, int) or number.is_integer()):
            return False, value
        return True, hint(number)
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value  # a hint this does not model: the field's own checks have it


def _describe(hint: Any, plural: bool = False) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(a, plural) for a in args)
    if hint is type(None):
        return "nulls (None)" if plural else "null (None)"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, tuple):
        return f"a list of {_describe(args[0], plural=True) if args else 'values'}"
    if origin is dict:
        return "a mapping"
    names = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "true/false"),
             str: ("a string", "strings")}
    return names[hint][plural] if hint in names else getattr(hint, "__name__", str(hint))


def _example(hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return _example(next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        return args[0]
    if origin in (list, tuple):
        return [_example(args[0]) if args else 1]
    if origin is dict:
        return {}
    return _EXAMPLES.get(hint, "...")


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value)


def _flag(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_flag(v) for v in value)
    if isinstance(value, dict):
        return "'" + json.dumps(value) + "'"
    return str(value)
