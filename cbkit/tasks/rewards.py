"""Answer extraction and the reward functions, each `fn(completions, answers) -> list[float]`. GRPO learns only from
reward differences inside a group, so `format_reward` is graded: a group differs before any completion is perfect."""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RewardFn = Callable[[list[str], list[str]], list[float]]

# One number as it appears in prose: thousands commas only in groups of three ("3,4" is two numbers); the
# look-behind stops "5-3" from yielding "-3" and "x2" from yielding "2".
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])-?\$?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_STRICT_NUMBER = re.compile(r"(-?)(\d*)(?:\.(\d*))?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
# "The answer is 12", "final answer: 12", "Answer = 12", "A: 12" (capital A only: "a: " is prose).
_ANSWER_PHRASE = re.compile(r"(?:\b(?:final\s+)?answer\b\s*(?:is\b|:|=)|(?<!\w)(?-i:A)\s*:)", re.IGNORECASE)
# "####" directly followed by a number: markdown headings ("#### Step 2") are not answers.
_HASH_ANSWER = re.compile(r"####\s*(?:\*\*)?\s*-?\$?\s*\.?\d")
# Special tokens a caller left in the decoded text ("<|im_end|>") must not cost format credit.
_TRAILING_SPECIALS = re.compile(r"(?:\s*(?:<\|[^|<>]*\|>|</s>|<eos>|<end_of_turn>))+\s*$")


def normalize_number(s: str | None) -> str | None:
    """Canonical string for one number ("$1,234.50" -> "1234.5", "-0" -> "0"), or None when `s` is not one."""
    if s is None:
        return None
    t = s.strip().replace("**", "").replace("$", "").replace(",", "").replace(" ", "").rstrip(".").removeprefix("+")
    m = _STRICT_NUMBER.fullmatch(t)
    if m is None or not (m.group(2) or m.group(3)):
        return None
    whole, frac = m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "0" if out == "0" else f"{m.group(1)}{out}"


def _number(text: str, last: bool = False) -> str | None:
    matches = _NUMBER_IN_TEXT.findall(text.replace("**", ""))
    return normalize_number(matches[-1 if last else 0]) if matches else None


def extract_answer(text: str) -> str | None:
    """The answer a completion commits to: the last "#### <n>", else the last "\\boxed{n}", else the number after the
    last "answer is" / "Answer:" / "A:" on its line, else the last number; None if none."""
    hashes = list(_HASH_ANSWER.finditer(text))
    if hashes:
        return _number(text[hashes[-1].start() + 4 :])
    boxed = _BOXED.findall(text)
    found = _number(boxed[-1]) if boxed else None
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if found is None and phrases:
        # Only the rest of that line: "The answer is below.\n... 3 apples" must not read "3".
        found = _number(text[phrases[-1].end() :].split("\n", 1)[0])
    return found if found is not None else _number(text, last=True)


def numbers_equal(a: str | None, b: str | None) -> bool:
    na, nb = normalize_number(a), normalize_number(b)
    return na is not None and nb is not None and math.isclose(float(na), float(nb), rel_tol=0.0, abs_tol=1e-6)


def _check_lengths(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers; pass one gold answer per "
                         "completion (repeat each prompt's answer N times for a group of N)")


def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where `extract_answer(completion)` equals the gold answer, else 0.0."""
    _check_lengths(completions, answers)
    for i, gold in enumerate(answers):
        if normalize_number(gold) is None:
            raise ValueError(f"gold answer {i} is {gold!r}, not a number; answers must be numbers such as '72' or "
                             "'-0.5'")
    return [float(numbers_equal(extract_answer(c), gold)) for c, gold in zip(completions, answers, strict=True)]


def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 if the last non-empty line is the only "#### <number>", 0.5 if the form appears otherwise, else 0.0."""
    _check_lengths(completions, answers)
    out = []
    for completion in completions:
        lines = [line.strip() for line in _TRAILING_SPECIALS.sub("", completion).splitlines() if line.strip()]
        last_ok = bool(lines) and lines[-1].startswith("####") and normalize_number(lines[-1][4:]) is not None
        hashes = len(_HASH_ANSWER.findall(completion))
        out.append(1.0 if last_ok and hashes == 1 else 0.5 if hashes else 0.0)
    return out


def format_if_correct_reward(completions: list[str], answers: list[str]) -> list[float]:
    """`format_reward`, paid only where `correctness_reward` is 1, so a gamed format cannot earn it."""
    return [f * c for f, c in zip(format_reward(completions, answers), correctness_reward(completions, answers),
                                  strict=True)]


def verified_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where math-verify (TRL's and open-r1's checker) finds the gold answer as the completion's final answer,
    written as a number (so echoing "7 + 7" is not "right" for 14); else 0.0. Held-out accuracy is this score."""
    _check_lengths(completions, answers)
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ModuleNotFoundError("verified_reward needs math-verify: pip install math-verify "
                                  "(cbkit's default install has it).") from e
    # math-verify times out with SIGALRM, which only the main thread may use; elsewhere it logs that at every call.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    out = []
    for completion, gold in zip(completions, answers, strict=True):
        try:
            found = parse(completion, parsing_timeout=timeout)  # [the parsed value, the text it was read from]
            ok = (len(found) == 2 and normalize_number(str(found[1])) is not None
                  and verify(parse(gold, parsing_timeout=timeout), found, timeout_seconds=timeout))
        except Exception:  # math-verify raises on inputs it cannot parse: an answer it cannot read is not right
            ok = False
        out.append(1.0 if ok else 0.0)
    return out


DEFAULT_REWARDS: dict[str, RewardFn] = {"correctness": correctness_reward, "format": format_reward}
# Every reward a recipe can name; `reward_funcs: None` means DEFAULT_REWARDS.
BUILTIN_REWARDS: dict[str, RewardFn] = {**DEFAULT_REWARDS, "verified": verified_reward,
                                        "format_if_correct": format_if_correct_reward}
# Correctness dominates: a perfectly formatted wrong answer (0.5) must never beat a right one (1.0).
DEFAULT_REWARD_WEIGHTS: dict[str, float] = {"correctness": 1.0, "format": 0.5}

RewardsArg = Mapping[str, RewardFn] | Sequence[RewardFn | str] | RewardFn | str | None
WeightsArg = Mapping[str, float] | Sequence[float] | None


def resolve_rewards(reward_funcs: RewardsArg = None, reward_weights: WeightsArg = None, *,
                    names_are_builtin: bool = True) -> tuple[dict[str, Any], list[float]]:
    """The reward functions by name (`correctness_reward` -> `correctness`; a string is a built-in, or with
    `names_are_builtin=False` a TRL reward model's id) and one weight each (None: 1.0, or a built-in's default)."""
    if reward_funcs is None:
        reward_funcs = list(DEFAULT_REWARDS)
    if callable(reward_funcs) or isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    builtin: set[str] = set()
    funcs: dict[str, RewardFn | str] = dict(reward_funcs) if isinstance(reward_funcs, Mapping) else {}
    if not isinstance(reward_funcs, Mapping):
        unknown = [n for n in reward_funcs if isinstance(n, str) and n not in BUILTIN_REWARDS]
        if names_are_builtin and unknown:
            raise ValueError(f"Unknown reward function(s) {unknown}; built-in: {sorted(BUILTIN_REWARDS)}. "
                             "Pass your own callables with GRPOTrainer(reward_funcs=...).")
        for fn in reward_funcs:
            if isinstance(fn, str) and names_are_builtin:
                name, fn = fn, BUILTIN_REWARDS[fn]
                builtin.add(name)
            else:
                name = fn if isinstance(fn, str) else getattr(fn, "__name__", type(fn).__name__).removesuffix("_reward")
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


def reward_scores(name: str, fn: Callable[..., Any], completions: list[str], answers: list[str],
                  num_generations: int | None = None) -> list[float]:
    """One reward function's scores, checked: a failure, a wrong count or a non-finite score names the completion."""

    def where(i: int) -> str:
        shown = completions[i] if len(completions[i]) <= 300 else completions[i][:300] + "..."
        group = f"prompt {i // num_generations}, " if num_generations else ""
        return f"completion {i} ({group}answer {answers[i]!r}):\n  {shown!r}"

    def raises(i: int) -> bool:
        try:
            fn([completions[i]], [answers[i]])
        except Exception:
            return True
        return False

    try:
        scores = list(fn(completions, answers))
    except Exception as e:
        culprit = next((i for i in range(len(completions)) if raises(i)), None)
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
            raise ValueError(f"Reward function {name!r} returned {s} for {where(i)}\nRewards must be finite: a NaN "
                             "or inf reward would turn every advantage of its group into NaN.")
        out.append(value)
    return out


def compute_rewards(completions: list[str], answers: list[str], rewards: RewardsArg = None, weights: WeightsArg = None,
                    num_generations: int | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum of the reward functions, and each one's checked scores keyed by `reward/<name>`."""
    _check_lengths(completions, answers)
    funcs, resolved = resolve_rewards(rewards, weights)
    total = [0.0] * len(completions)
    per_reward: dict[str, list[float]] = {}
    for (name, fn), w in zip(funcs.items(), resolved, strict=True):
        scores = reward_scores(name, fn, completions, answers, num_generations)
        per_reward[f"reward/{name}"] = scores
        total = [t + w * s for t, s in zip(total, scores, strict=True)]
    return total, per_reward
