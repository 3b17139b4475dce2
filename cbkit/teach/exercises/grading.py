"""How an exercise is graded: a table of cases, the package's own reference on each, and one short verdict.

A check runs the learner's function on every case of its table, in order (the edge cases first, then cases drawn
from a seed), and stops at the first disagreement with the reference: the verdict names the case, shows its inputs,
what the reference returns and what the learner's function returned, and gives that case's hint, which points at
the idea the case tests, never at the code. Nothing the learner's function does raises out of a check: an
exception inside it is a verdict (its type and message, and the case), and `NotImplementedError`, the stub's, is
the "not implemented yet" verdict. The reference is called on its own copy of the inputs, so a learner's function
that writes into its arguments cannot change what it is compared with.

The seed is printed with every verdict: `check_x(fn, seed=...)` replays the same table. Without one a check draws
a fresh seed, so the drawn cases cannot be learned by heart.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Case", "Result", "close", "grade", "new_seed", "show"]


@dataclass(frozen=True)
class Result:
    """A check's verdict: whether every case passed, the first failing case's name (None when all passed or the
    function is not written yet), and the message the check printed."""

    passed: bool
    case: str | None
    message: str
    not_implemented: bool = False

    def __repr__(self) -> str:  # the message is printed already; a notebook's last expression shows this line
        return f"Result(passed={self.passed}, case={self.case!r})"


@dataclass(frozen=True)
class Case:
    """One row of a check's table: a name a learner can read, the arguments, and the idea it tests."""

    name: str
    args: tuple
    hint: str


def new_seed() -> int:
    return random.SystemRandom().randrange(1, 1_000_000)


def grade(exercise: str, fn: Callable[..., Any], cases: Sequence[Case], reference: Callable[..., Any],
          compare: Callable[[Any, Any], str | None], *, seed: int, check: str, quiet: bool = False) -> Result:
    """Run `fn` and `reference` on every case; the first case where `compare(expected, got)` finds a difference
    (it returns what differs, or None when they agree) fails the check. Prints the verdict unless `quiet`."""
    replay = f"(seed {seed}: `{check}(fn, seed={seed})` replays these cases)"
    result = None
    for case in cases:
        expected = reference(*copy.deepcopy(case.args))
        try:
            got = fn(*copy.deepcopy(case.args))
        except NotImplementedError:
            result = Result(False, None, f"{exercise}: not implemented yet. Write its body in the cell above (it still "
                            "raises NotImplementedError), run that cell, then run this check again.",
                            not_implemented=True)
            break
        except Exception as exc:  # a learner's bug is a verdict, never a traceback
            result = Result(False, case.name, _failure(exercise, case, expected,
                                                       f"raised {type(exc).__name__}: {exc}", replay))
            break
        try:
            diff = compare(expected, got)
        except Exception as exc:  # a return value the comparison cannot read (a wrong type, a wrong shape)
            diff = f"could not compare it with the expected value ({type(exc).__name__}: {exc})"
        if diff is not None:
            result = Result(False, case.name, _failure(exercise, case, expected, f"returned {show(got)}: {diff}",
                                                       replay))
            break
    if result is None:
        result = Result(True, None, f"{exercise}: correct on all {len(cases)} cases, the edge cases included {replay}.")
    if not quiet:
        print(("PASS  " if result.passed else "TODO  " if result.not_implemented else "FAIL  ") + result.message)
    return result


def _failure(exercise: str, case: Case, expected: Any, what: str, replay: str) -> str:
    inputs = ", ".join(show(a) for a in case.args)
    return (f"{exercise} fails the case '{case.name}' {replay}\n"
            f"      inputs:   ({inputs})\n"
            f"      expected: {show(expected)}\n"
            f"      yours:    {what}\n"
            f"      hint:     {case.hint}")


def show(value: Any, width: int = 160) -> str:
    """A short readable form of a value: tensors as nested lists rounded to 4 digits, long text cut."""
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        value = _rounded(value.tolist())
    elif isinstance(value, float):
        value = _rounded(value)
    text = repr(value)
    return text if len(text) <= width else text[: width - 5] + " ...]"


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def close(expected: Any, got: Any, *, rtol: float = 1e-4, atol: float = 1e-6) -> str | None:
    """None when `got` equals `expected` (numbers within the tolerances, tensors elementwise with the same shape,
    sequences item by item), else what differs."""
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            got = torch.as_tensor(got)
        if tuple(got.shape) != tuple(expected.shape):
            return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        e, g = expected.detach().cpu().double(), got.detach().cpu().double()
        if not torch.allclose(g, e, rtol=rtol, atol=atol, equal_nan=True):
            where = (~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)).nonzero()[0].tolist()
            return f"at index {tuple(where)} {g[tuple(where)].item():.6g}, expected {e[tuple(where)].item():.6g}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"expected a list of {len(expected)} items"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            diff = close(e, g, rtol=rtol, atol=atol)
            if diff is not None:
                return f"item {i}: {diff}"
        return None
    if hasattr(got, "item") and not isinstance(got, (int, float)):
        got = got.item()  # a 0-d tensor or numpy scalar where a number is expected
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"expected a number, got a {type(got).__name__}"
    if math.isnan(got) or not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
        return f"off by {got - expected:.6g}"
    return None
