"""Answer extraction and reward functions for GSM-style rollouts.

GRPO learns only from reward *differences inside a group*: if all N completions of a prompt score
the same, their advantages are zero and that prompt teaches nothing. So the rewards here are cheap,
deterministic and strict enough to separate completions, and nothing else:

- `correctness_reward`: 1.0 when the extracted answer equals the gold number, else 0.0. Extraction is
  lenient (`#### 18`, `The answer is $18.`, `\\boxed{18}`, or the last number in the text) because a
  135M model rarely follows the format at first, and we want "right but badly formatted" to still
  count as right; teaching the format is the other reward's job.
- `format_reward`: graded 1.0 / 0.5 / 0.0.
  1.0 when the last non-empty line is exactly `#### <number>` (what `cbkit.tasks.data.SYSTEM_PROMPT` asks
  for); 0.5 when `#### <number>` appears but more text follows it; 0.0 otherwise. The half step is
  deliberate: a completion that answers and then keeps talking wastes completion tokens until EOS or
  `max_completion_length`, which is exactly the long tail that makes rollouts slow, and the extra
  level gives groups a reward difference (hence a gradient) before any completion is perfect.
  "The answer is 18" gets no format credit: rewarding near-misses teaches the near-miss.

Every reward function has one signature, `fn(completions, answers) -> list[float]`, and its metric
name is derived from `__name__` (`correctness_reward` -> `reward/correctness`). Numbers are compared
as floats with an absolute tolerance of 1e-6, after `normalize_number`, so "1,234.00" equals "1234".
Fractions ("3/4") are not parsed: GSM8K's gold answers are all integers.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RewardFn = Callable[[list[str], list[str]], list[float]]

ABS_TOLERANCE = 1e-6

# One number as it appears in prose: optional minus and "$", thousands commas only in groups of three
# (so "3,4" is two numbers), optional decimals. The look-behind stops "5-3" from yielding "-3" and
# "x2" from yielding "2"; the look-ahead stops "1,2345" from being read as "1,234".
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])-?\$?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_STRICT_NUMBER = re.compile(r"(-?)(\d*)(?:\.(\d*))?")
_HASHES = "####"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
# "The answer is 12", "final answer: 12", "Answer = 12", "A: 12" (capital A only: "a: " is prose).
_ANSWER_PHRASE = re.compile(r"(?:\b(?:final\s+)?answer\b\s*(?:is\b|:|=)|(?<!\w)(?-i:A)\s*:)", re.IGNORECASE)
# "####" directly followed by a number: markdown headings ("#### Step 2") are not answers.
_HASH_ANSWER = re.compile(r"####\s*(?:\*\*)?\s*-?\$?\s*\.?\d")
# Decoded completions may keep special tokens (e.g. "<|im_end|>", "</s>") when the caller does not
# skip them; they must not cost format credit.
_TRAILING_SPECIALS = re.compile(r"(?:\s*(?:<\|[^|<>]*\|>|</s>|<eos>|<end_of_turn>))+\s*$")


def normalize_number(s: str | None) -> str | None:
    """Canonical string for a number, or None when `s` is not one number.

    Strips "$", "**", commas, spaces, a trailing "." and a leading "+"; drops trailing decimal zeros
    and leading integer zeros: "72.00" -> "72", "1,234" -> "1234", "0.50" -> "0.5", "-0" -> "0".
    """
    if s is None:
        return None
    t = s.strip().replace("**", "").replace("$", "").replace(",", "").replace(" ", "")
    t = t.rstrip(".")
    if t.startswith("+"):
        t = t[1:]
    m = _STRICT_NUMBER.fullmatch(t)
    if m is None:
        return None
    sign, whole, frac = m.group(1), m.group(2), m.group(3) or ""
    if not whole and not frac:
        return None
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "0" if out == "0" else f"{sign}{out}"


def _first_number(text: str) -> str | None:
    m = _NUMBER_IN_TEXT.search(text.replace("**", ""))
    return normalize_number(m.group(0)) if m else None


def _last_number(text: str) -> str | None:
    matches = _NUMBER_IN_TEXT.findall(text.replace("**", ""))
    return normalize_number(matches[-1]) if matches else None


def extract_answer(text: str) -> str | None:
    """The answer a completion commits to, normalised, or None if it contains no number.

    Tried in order: the last "#### <number>"; the last "\\boxed{...}"; the number after the last
    "answer is" / "Answer:" / "A:"; the last number anywhere.
    """
    hashes = list(_HASH_ANSWER.finditer(text))
    if hashes:
        return _first_number(text[hashes[-1].start() + len(_HASHES) :])
    boxed = _BOXED.findall(text)
    if boxed:
        found = _first_number(boxed[-1])
        if found is not None:
            return found
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if phrases:
        # Only the rest of that line: "The answer is below.\n... 3 apples" must not read "3".
        tail = text[phrases[-1].end() :].split("\n", 1)[0]
        found = _first_number(tail)
        if found is not None:
            return found
    return _last_number(text)


def has_answer_format(text: str) -> bool:
    """True when the completion contains "#### <number>" anywhere."""
    return _HASH_ANSWER.search(text) is not None


def _answer_on_last_line(text: str) -> bool:
    lines = [line for line in _TRAILING_SPECIALS.sub("", text).splitlines() if line.strip()]
    if not lines:
        return False
    last = lines[-1].strip()
    return last.startswith(_HASHES) and normalize_number(last[len(_HASHES) :]) is not None


def numbers_equal(a: str | None, b: str | None, tol: float = ABS_TOLERANCE) -> bool:
    """Both parse as numbers and differ by at most `tol`."""
    na, nb = normalize_number(a), normalize_number(b)
    if na is None or nb is None:
        return False
    return math.isclose(float(na), float(nb), rel_tol=0.0, abs_tol=tol)


def _check_lengths(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(
            f"got {len(completions)} completions but {len(answers)} answers; pass one gold answer per "
            "completion (repeat each prompt's answer N times for a group of N)"
        )


def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where `extract_answer(completion)` equals the gold answer (|a - b| <= 1e-6), else 0.0."""
    _check_lengths(completions, answers)
    out = []
    for i, (completion, gold) in enumerate(zip(completions, answers, strict=True)):
        if normalize_number(gold) is None:
            raise ValueError(
                f"gold answer {i} is {gold!r}, not a number; answers must be numbers such as '72' or '-0.5'"
            )
        out.append(1.0 if numbers_equal(extract_answer(completion), gold) else 0.0)
    return out


def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 if the last non-empty line is "#### <number>" and it is the only answer line, 0.5 if the form
    appears otherwise, else 0.0.

    "Only answer line": a GRPO run on SmolLM2 learned to end with a stack of `#### 9` lines, which a
    last-line check alone pays in full. `answers` is unused but kept so every reward has the same signature.
    """
    _check_lengths(completions, answers)
    out = []
    for completion in completions:
        if _answer_on_last_line(completion) and len(_HASH_ANSWER.findall(completion)) == 1:
            out.append(1.0)
        elif has_answer_format(completion):
            out.append(0.5)
        else:
            out.append(0.0)
    return out


def format_if_correct_reward(completions: list[str], answers: list[str]) -> list[float]:
    """`format_reward`, paid only where `correctness_reward` is 1: the fix for a format reward that is gamed.

    A format reward paid whatever the number teaches a small model to write `#### 13` and nothing else, right or
    wrong (docs/learning.md measured it). Gated by correctness, the format can only be earned by being right.
    """
    return [f * c for f, c in zip(format_reward(completions, answers), correctness_reward(completions, answers),
                                  strict=True)]


def verified_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where math-verify (the checker TRL and open-r1 score answers with) finds the gold answer as the
    completion's final answer, written as a number; else 0.0.

    math-verify reads the last `\\boxed{}` if there is one, else the last number or expression: "7 + 5 = 12" is
    right for 12, "12, or maybe 13" is not. The answer must be a number as written: math-verify also reads a final
    *expression* and evaluates it, so "The answer to 7 + 7 is" ends on `7 + 7` and is "right" for 14. A GRPO run
    on one-digit sums learned exactly that, echoing the question last (docs/learning.md, "Two runs that gamed their reward"), so
    an expression is not an answer here. Held-out accuracy (`eval/accuracy`) is always this score, whatever a run is
    trained on.
    """
    _check_lengths(completions, answers)
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ModuleNotFoundError("verified_reward needs math-verify: pip install math-verify "
                                  "(cbkit's default install has it).") from e
    # math-verify times out with SIGALRM, which only the main thread may use; elsewhere (a notebook's or TRL's
    # reward call) it runs without one, and would log that for every call: the inputs are short completions.
    main = threading.current_thread() is threading.main_thread()
    timeout = 5 if main else None
    if not main:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    out = []
    for completion, gold in zip(completions, answers, strict=True):
        try:
            found = parse(completion, parsing_timeout=timeout)
            # found = [the parsed value, the text it was read from]: an answer is a number, not "7 + 7".
            ok = (len(found) == 2 and normalize_number(str(found[1])) is not None
                  and verify(parse(gold, parsing_timeout=timeout), found, timeout_seconds=timeout))
        except Exception:  # math-verify raises on inputs it cannot parse: an answer it cannot read is not right
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


def reward_metric_name(fn: Callable[..., object]) -> str:
    """`correctness_reward` -> `reward/correctness`."""
    name = getattr(fn, "__name__", type(fn).__name__)
    return f"reward/{name.removesuffix('_reward')}"


DEFAULT_REWARDS: dict[str, RewardFn] = {"correctness": correctness_reward, "format": format_reward}
# Every reward a recipe can name; `reward_funcs: None` means DEFAULT_REWARDS.
BUILTIN_REWARDS: dict[str, RewardFn] = {**DEFAULT_REWARDS, "verified": verified_reward,
                                        "format_if_correct": format_if_correct_reward}
# Correctness dominates: a perfectly formatted wrong answer (0.5) must never beat a right one (1.0).
DEFAULT_REWARD_WEIGHTS: dict[str, float] = {"correctness": 1.0, "format": 0.5}


RewardsArg = Mapping[str, RewardFn] | Sequence[RewardFn | str] | RewardFn | str | None
WeightsArg = Mapping[str, float] | Sequence[float] | None


def resolve_rewards(
    reward_funcs: RewardsArg = None, reward_weights: WeightsArg = None, *, names_are_builtin: bool = True
) -> tuple[dict[str, Any], list[float]]:
    """The reward functions by name, and one weight each: the one place cbkit decides both.

    `reward_funcs`: a dict name -> fn, a list of functions (named after `__name__`, `correctness_reward` ->
    `correctness`), a single function, or names of the built-ins (`DEFAULT_REWARDS`); None means the built-ins.
    With `names_are_builtin=False` a string is kept as it is (TRL reads it as a reward model's id).
    `reward_weights`: one per function (a list), by name (a dict; a name left out weighs 1.0), or None: 1.0
    each (TRL's default), except that a built-in named by its string gets `DEFAULT_REWARD_WEIGHTS`.
    """
    if reward_funcs is None:
        reward_funcs = list(DEFAULT_REWARDS)
    if callable(reward_funcs) or isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    builtin: set[str] = set()
    # A str value is a reward model's id, kept for TRL (names_are_builtin=False).
    funcs: dict[str, RewardFn | str]
    if isinstance(reward_funcs, Mapping):
        funcs = dict(reward_funcs)
    else:
        funcs = {}
        for fn in reward_funcs:
            if isinstance(fn, str) and names_are_builtin:
                if fn not in BUILTIN_REWARDS:
                    unknown = [n for n in reward_funcs if isinstance(n, str) and n not in BUILTIN_REWARDS]
                    raise ValueError(f"Unknown reward function(s) {unknown}; built-in: {sorted(BUILTIN_REWARDS)}. "
                                     "Pass your own callables with GRPOTrainer(reward_funcs=...).")
                name, fn = fn, BUILTIN_REWARDS[fn]
                builtin.add(name)
            else:
                name = fn if isinstance(fn, str) else reward_metric_name(fn).removeprefix("reward/")
            if name in funcs:
                raise ValueError(f"Two reward functions are named {name!r}; pass a dict name -> function.")
            funcs[name] = fn
    if not funcs:
        raise ValueError("reward_funcs is empty; pass at least one reward function.")
    if reward_weights is None:
        return funcs, [DEFAULT_REWARD_WEIGHTS.get(n, 1.0) if n in builtin else 1.0 for n in funcs]
    if isinstance(reward_weights, Mapping):
        if not isinstance(reward_funcs, Mapping) and not all(isinstance(f, str) for f in reward_funcs):
            raise ValueError("reward_weights given by name needs reward_funcs given by name (a dict name -> fn).")
        unknown_weights = set(reward_weights) - set(funcs)
        if unknown_weights:
            raise ValueError(f"reward_weights for unknown rewards {sorted(unknown_weights)}; known: {sorted(funcs)}")
        return funcs, [float(reward_weights.get(n, 1.0)) for n in funcs]
    weights = [float(w) for w in reward_weights]
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions "
                         f"{list(funcs)}; give one weight per function.")
    return funcs, weights


def reward_scores(
    name: str, fn: Callable[..., Any], completions: list[str], answers: list[str], num_generations: int | None = None
) -> list[float]:
    """One reward function's scores, checked: a failure, a wrong count, a non-number or a non-finite score stops
    with the function's name and the completion that caused it.

    A NaN or inf reward would turn every advantage of its group (and with batch scaling, of the step) into NaN,
    so it is an error here rather than the silent advantage 0 TRL makes of it. `num_generations`, when the
    completions come in groups of N, lets the message say which prompt a completion belongs to.
    """

    def where(i: int) -> str:
        shown = completions[i] if len(completions[i]) <= 300 else completions[i][:300] + "..."
        group = f"prompt {i // num_generations}, " if num_generations else ""
        return f"completion {i} ({group}answer {answers[i]!r}):\n  {shown!r}"

    try:
        scores = list(fn(completions, answers))
    except Exception as e:
        culprit = next((i for i in range(len(completions)) if _raises(fn, completions[i], answers[i])), None)
        at = where(culprit) if culprit is not None else f"the batch of {len(completions)} completions"
        raise RuntimeError(f"Reward function {name!r} raised {type(e).__name__}: {e}\non {at}") from e
    if len(scores) != len(completions):
        raise ValueError(f"Reward function {name!r} returned {len(scores)} scores for {len(completions)} completions.")
    out = []
    for i, s in enumerate(scores):
        try:
            value = float(s)
        except (TypeError, ValueError):
            raise ValueError(f"Reward function {name!r} returned {s!r}, not a number, for {where(i)}") from None
        if not math.isfinite(value):
            raise ValueError(
                f"Reward function {name!r} returned {s} for {where(i)}\nRewards must be finite: a NaN or inf "
                "reward would turn every advantage of its group (and with batch scaling, of the step) into NaN."
            )
        out.append(value)
    return out


def _raises(fn: Callable[..., Any], text: str, answer: str) -> bool:
    try:
        fn([text], [answer])
    except Exception:
        return True
    return False


def compute_rewards(
    completions: list[str],
    answers: list[str],
    rewards: RewardsArg = None,
    weights: WeightsArg = None,
    num_generations: int | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted sum of the reward functions, and each one's scores keyed by `reward/<name>`.

    Functions and weights are resolved by `resolve_rewards` (None: the built-ins with their default weights),
    each function's scores are checked by `reward_scores`. The sum runs in float64, function by function.
    """
    _check_lengths(completions, answers)
    funcs, resolved = resolve_rewards(rewards, weights)
    total = [0.0] * len(completions)
    per_reward: dict[str, list[float]] = {}
    for (name, fn), w in zip(funcs.items(), resolved, strict=True):
        scores = reward_scores(name, fn, completions, answers, num_generations)
        per_reward[f"reward/{name}"] = scores
        total = [t + w * s for t, s in zip(total, scores, strict=True)]
    return total, per_reward
