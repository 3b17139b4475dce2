"""cbkit's rewards as TRL reward functions, and the problems as a TRL dataset."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cbkit.tasks.data import SYSTEM_PROMPT
from cbkit.tasks.rewards import resolve_rewards, reward_scores


def trl_dataset(problems, system_prompt: str | None = SYSTEM_PROMPT):
    """cbkit `Problem`s as the dataset TRL expects: a conversational `prompt` column (with `system_prompt` unless
    None) and the gold `answer`."""
    from datasets import Dataset

    head = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return Dataset.from_dict({
        "prompt": [head + [{"role": "user", "content": p.question}] for p in problems],
        "answer": [p.answer for p in problems],
    })


class TRLReward:
    """A cbkit reward `fn(completions, answers)` as the reward function TRL calls: the gold answers from the dataset
    column `answer_column`, chat completions reduced to their text, `__name__` kept (TRL logs
    `rewards/<__name__>/mean`). A class rather than a closure so it pickles like `fn` does."""

    def __init__(self, fn: Callable[[list[str], list[str]], list[float]], answer_column: str = "answer") -> None:
        self.fn = fn
        self.answer_column = answer_column
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        if self.answer_column not in kwargs:
            columns = sorted(k for k in kwargs if k not in _TRL_EXTRA_KWARGS)
            raise ValueError(f"reward {self.__name__!r} needs the gold answers in a dataset column "
                             f"{self.answer_column!r}; the columns TRL passed are {columns}. Add the column or pass "
                             "answer_column= to trl_reward.")
        texts = [_completion_text(c) for c in completions]
        answers = [str(a) for a in kwargs[self.answer_column]]
        return reward_scores(self.__name__, self.fn, texts, answers)

    def __repr__(self) -> str:
        return f"TRLReward({self.__name__}, answer_column={self.answer_column!r})"


# What TRL passes to reward functions besides prompts, completions and the dataset columns.
_TRL_EXTRA_KWARGS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def trl_reward(fn: Callable[[list[str], list[str]], list[float]], answer_column: str = "answer") -> TRLReward:
    """Wrap a cbkit reward for TRL (see `TRLReward`)."""
    return TRLReward(fn, answer_column)


def _completion_text(completion) -> str:
    """A plain completion is its text; a chat completion (list of messages) is its assistant text."""
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion:
        content = message.get("content") if isinstance(message, Mapping) else message
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # typed content blocks
            parts.extend(b.get("text", "") for b in content if isinstance(b, Mapping))
    return "".join(parts)


def _is_trl_native(fn) -> bool:
    """TRL reward functions must take **kwargs (TRL passes trainer_state, log_extra, ...); cbkit's never do."""
    if isinstance(fn, str | torch.nn.Module | TRLReward):
        return True
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _weights_for(reward_funcs, reward_weights, cfg: Any):
    """The weights to hand TRL: `reward_weights` when given, else the config's, matched to the functions by name
    (so a TRL run weighs the rewards as cbkit's loop does from the same config)."""
    if reward_weights is not None or cfg is None:
        return reward_weights
    if isinstance(cfg, Mapping):
        names, weights = cfg.get("reward_funcs"), cfg.get("reward_weights")
    else:
        names = getattr(cfg, "reward_funcs", None)
        resolve = getattr(cfg, "resolved_reward_weights", None)
        weights = resolve() if callable(resolve) else getattr(cfg, "reward_weights", None)
    if weights is None:
        return None
    if names is not None and isinstance(reward_funcs, Mapping):
        return {n: float(w) for n, w in zip(names, weights, strict=True) if n in reward_funcs}
    count = 1 if callable(reward_funcs) or isinstance(reward_funcs, str) else len(reward_funcs)
    if count != len(weights):
        raise ValueError(f"The config's reward_weights {list(weights)} are for {len(weights)} reward functions, got "
                         f"{count}. Pass reward_funcs as a name -> fn dict with the config's names, or "
                         "reward_weights= explicitly.")
    return list(weights)


def _trl_rewards(reward_funcs, reward_weights, answer_column: str):
    """cbkit rewards as TRL's list and weights as its list, by the loop's rules (`resolve_rewards`), except that a
    string stays a reward model's id and no weights stays None (TRL's default, 1.0 each)."""
    funcs, weights = resolve_rewards(reward_funcs, reward_weights, names_are_builtin=False)
    adapted = [f if _is_trl_native(f) else trl_reward(f, answer_column) for f in funcs.values()]
    return adapted, None if reward_weights is None else weights
