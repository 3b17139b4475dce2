"""Procedural tasks from `reasoning-gym`: arithmetic whose difficulty is a knob, answers checked by `math-verify`.

GRPO learns only where a group's completions disagree, and GSM8K is out of a 135M model's reach, so a run on it can
only learn (and game) the answer's format (docs/learning.md). reasoning-gym draws problems from a seed at a chosen
difficulty, set where the model sits between never and always right (lab/learning.md). A source is
`reasoning-gym:<dataset>`, its knobs `CBGRPOConfig.data_options`, e.g. `reasoning-gym:chain_sum` with
`{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}`; answers are scored by `verified_reward`, not by the
dataset's `score_answer` (which gives 0.07 to "The answer is 8").
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
