"""Procedural tasks from `reasoning-gym`: arithmetic whose difficulty is a knob, answers checked by `math-verify`.

Why these, for learning. GRPO learns only where a group's completions disagree: a task the policy never solves
gives every completion reward 0 and teaches nothing, one it always solves teaches nothing either. GSM8K is out of
a 135M model's reach (a few percent correct), so a run on it can only learn the answer's *format*, and games that
reward (docs/learning.md). reasoning-gym's generators (MIT, maintained, made for RL on reasoning) draw problems
from a seed at a chosen difficulty, so the difficulty can be set where the model sits in the window that has
signal and room: lab/learning.md has what was measured to choose it.

A source is `reasoning-gym:<dataset>`, its knobs a dict (`CBGRPOConfig.data_options`), e.g.
`reasoning-gym:chain_sum` with `{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}`. Problem i depends only
on (seed, i), as for cbkit's synthetic problems. Answers are scored by `cbkit.tasks.rewards.verified_reward`
(math-verify), not by the dataset's own `score_answer`, which wants the bare answer string and gives 0.07 to
"The answer is 8".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cbkit.tasks.rewards import normalize_number

PREFIX = "reasoning-gym:"


def is_procedural(source: str) -> bool:
    return source.startswith(PREFIX)


def procedural_problems(source: str, n: int, seed: int,
                        options: Mapping[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """`n` problems (id, question, gold answer) of the reasoning-gym dataset named in `source`, drawn with `seed` at
    the difficulty `options`; `cbkit.tasks.data.load_problems` makes them `Problem`s."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ModuleNotFoundError(f"{source!r} needs the reasoning-gym package: pip install reasoning-gym "
                                  "(cbkit's default install has it).") from e
    name = source.removeprefix(PREFIX)
    try:
        dataset = reasoning_gym.create_dataset(name, size=n, seed=seed, **dict(options or {}))
    except Exception as e:  # unknown name or option: reasoning-gym raises KeyError/TypeError/ValueError/AssertionError
        raise ValueError(f"reasoning-gym could not build {name!r} with options {dict(options or {})}: "
                         f"{type(e).__name__}: {e}. Check the dataset name and its config fields "
                         "(reasoning_gym.factory lists the datasets).") from e
    problems = []
    for i, row in enumerate(dataset):
        gold = normalize_number(str(row["answer"]))
        if gold is None:
            raise ValueError(f"{source} problem {i} has answer {row['answer']!r}, not a number: cbkit's rewards "
                             "score numeric answers; choose an arithmetic dataset (chain_sum, basic_arithmetic, "
                             "products).")
        problems.append((f"rg-{name}-{seed}-{i}", row["question"], gold))
    return problems
