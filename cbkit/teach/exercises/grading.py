"""How an exercise is graded: a table of cases, the package's own reference on each, and one short verdict.

The first case where the learner's function disagrees with the reference fails the check, named with its inputs,
both answers and a hint; nothing the function does (a `NotImplementedError` stub, an exception) raises out of it.
The seed is printed with every verdict: `check_x(fn, seed=...)` replays the same table.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["Case", "Result", "close", "exact", "grade"]


@dataclass(frozen=True)
class Result:
    """A check's verdict: the first failing case's name (None when all passed or not implemented) and its message."""

    passed: bool
    case: str | None
    message: str
    not_implemented: bool = False


class Case(NamedTuple):
    """One row of a check's table; `expected` is given when there is no reference to call (the engine's record)."""

    name: str
    args: tuple
    hint: str
    expected: Any = None


def grade(exercise: str, fn: Callable[..., Any], cases: Callable[[int], Sequence[Case]],
          reference: Callable[..., Any] | None, compare: Callable[[Any, Any], str | None], *, seed: int | None,
          quiet: bool = False) -> Result:
    """Run `fn` on each of `cases(seed)` (a fresh seed when None) against `reference`, called on its own copy of
    the inputs, or `case.expected`; `compare(expected, got)` returns what differs, or None. Prints the verdict."""
    seed = random.SystemRandom().randrange(1, 1_000_000) if seed is None else seed
    replay = f"(seed {seed}: `check_{exercise}(fn, seed={seed})` replays these cases)"
    table = cases(seed)
    for case in table:
        expected = case.expected if reference is None else reference(*copy.deepcopy(case.args))
        what = ""
        try:
            got = fn(*copy.deepcopy(case.args))
            what = f"returned {show(got)}: "
            diff = compare(expected, got)
        except NotImplementedError:
            return _verdict(Result(False, None, f"{exercise}: not implemented yet. Write its body in the cell above "
                                   "(it still raises NotImplementedError), run that cell, then run this check again.",
                                   not_implemented=True), quiet)
        except Exception as exc:  # a learner's bug, or a value the comparison cannot read, is a verdict
            diff = f"{'could not compare it:' if what else 'raised'} {type(exc).__name__}: {exc}"
        if diff is not None:
            inputs = ", ".join(show(a) for a in case.args)
            return _verdict(Result(False, case.name, f"{exercise} fails the case '{case.name}' {replay}\n"
                                   f"      inputs:   ({inputs})\n      expected: {show(expected)}\n"
                                   f"      yours:    {what}{diff}\n      hint:     {case.hint}"), quiet)
    return _verdict(Result(True, None, f"{exercise}: correct on all {len(table)} cases, the edge cases included "
                           f"{replay}."), quiet)


def _verdict(result: Result, quiet: bool) -> Result:
    if not quiet:
        print(("PASS  " if result.passed else "TODO  " if result.not_implemented else "FAIL  ") + result.message)
    return result


def show(value: Any, width: int = 160) -> str:
    """A short readable form of a value: tensors as nested lists rounded to 4 digits, long text cut."""
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        value = value.tolist()
    text = repr(_rounded(value))
    return text if len(text) <= width else text[: width - 5] + " ...]"


def _rounded(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) else [_rounded(v) for v in x] if isinstance(x, list) else x


def close(expected: Any, got: Any, *, rtol: float = 1e-4, atol: float = 1e-6) -> str | None:
    """None when `got` (a number, a tensor or nested lists) equals `expected` within the tolerances, else what
    differs, as torch.testing says it."""
    import torch

    numeric = isinstance(got, (int, float, list, tuple, torch.Tensor)) or hasattr(got, "item")
    if isinstance(got, bool) or not numeric:
        return f"expected a number or a tensor, got a {type(got).__name__}"
    try:
        torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                                   torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol)
    except AssertionError as exc:
        return " ".join(str(exc).split())
    return None


def exact(expected: Any, got: Any) -> str | None:
    return None if (list(got) if isinstance(got, tuple) else got) == expected else "not the expected value"
