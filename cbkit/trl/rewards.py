"""cbkit's rewards as TRL reward functions, and the problems as a TRL dataset."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cbkit.tasks.data import SYSTEM_PROMPT
from cbkit.tasks.rewards import resolve_rewards, reward_scores
from cbkit.trl.config import cbkit_values


def trl_dataset(problems, system_prompt: str | None = SYSTEM_PROMPT):
    """cbkit `Problem`s as the dataset TRL expects: a conversational `prompt` column and the gold `answer`."""
    from datasets import Dataset

    head = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return Dataset.from_dict({
        "prompt": [head + [{"role": "user", "content": p.question}] for p in problems],
        "answer": [p.answer for p in problems],
    })


class TRLReward:
    """A cbkit reward `fn(completions, answers)` as TRL calls it, `__name__` kept; a class so it pickles like `fn`."""

    def __init__(self, fn: Callable[[list[str], list[str]], list[float]], answer_column: str = "answer") -> None:
        self.fn = fn
        self.answer_column = answer_column
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        if self.answer_column not in kwargs:
            # TRL passes these besides prompts, completions and the dataset's columns.
            extra = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
            raise ValueError(f"reward {self.__name__!r} needs the gold answers in a dataset column "
                             f"{self.answer_column!r}; the columns TRL passed are "
                             f"{sorted(k for k in kwargs if k not in extra)}. Add the column or pass answer_column=.")
        # A chat completion (a list of messages) is its assistant text.
        texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions or []]
        return reward_scores(self.__name__, self.fn, texts, [str(a) for a in kwargs[self.answer_column]])


def _is_trl_native(fn) -> bool:
    """TRL reward functions must take **kwargs (TRL passes trainer_state, log_extra, ...); cbkit's never do."""
    return isinstance(fn, str | torch.nn.Module | TRLReward) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def trl_rewards(reward_funcs, reward_weights=None, cfg: Any = None, answer_column: str = "answer"):
    """TRL's reward list and weights by the loop's rules (`resolve_rewards`), cbkit rewards wrapped in `TRLReward`.
    Without `reward_weights`, the config's matched by name; neither: None (TRL's 1.0 each)."""
    if reward_weights is None and cfg is not None:
        values = cbkit_values(cfg)
        names, reward_weights = values.get("reward_funcs"), values.get("reward_weights")
        if reward_weights is not None and names is not None and isinstance(reward_funcs, Mapping):
            reward_weights = {n: float(w) for n, w in zip(names, reward_weights, strict=True) if n in reward_funcs}
    funcs, weights = resolve_rewards(reward_funcs, reward_weights, names_are_builtin=False)
    adapted = [f if _is_trl_native(f) else TRLReward(f, answer_column) for f in funcs.values()]
    return adapted, None if reward_weights is None else weights
