"""Held-out evaluation: train reward is no evidence a recipe learns (a reward hack raises it too), so the loop scores a
fixed set, removed from the training problems, with math-verify at step 0 and every `eval_steps`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from cbkit.rollout import RolloutBackend, SamplingParams
from cbkit.tasks.data import Problem
from cbkit.tasks.rewards import compute_rewards, verified_reward
from cbkit.train.hooks import StepRecord

EVAL_SEED = 20_240_601  # the evaluation set's seed and its sampler's


def question_key(problem: Problem) -> str:
    """The question, whitespace-normalised: two problems are the same for the leak check when these are."""
    return " ".join(problem.question.split())


def without_held_out(train: Sequence[Problem], held_out: Sequence[Problem]) -> list[Problem]:
    if not held_out:
        return list(train)
    banned = {question_key(p) for p in held_out}
    kept = [p for p in train if question_key(p) not in banned]
    if not kept:
        raise ValueError(f"All {len(train)} training problems are in the held-out set of {len(held_out)}: the task "
                         "has too few distinct problems. Lower eval_num_problems, raise num_problems, or make the "
                         "task larger (data_options).")
    return kept


class HeldOut:
    """A run's fixed evaluation set, scored before training, every `eval_steps` steps and after the last, through the
    CB engine; with eval_steps=0 it holds no problems and never samples."""

    def __init__(self, config: Any, run: Any, backend: RolloutBackend, sampling: SamplingParams,
                 rewards: Mapping[str, Callable[..., list[float]]]) -> None:
        self.every, self.last_step = config.eval_steps, config.max_steps
        self.num_generations = config.eval_num_generations
        self.problems, self.prompts = build_held_out(config, run.tokenizer) if self.every else ([], [])
        if self.every and backend.name != "continuous":
            from cbkit.rollout import make_backend

            backend = make_backend("continuous", run.model, cb_config=config.cb_overrides(),
                                   pad_token_id=run.pad_token_id)
        self.backend, self.sampling = backend, dataclasses.replace(sampling, seed=EVAL_SEED)
        self.rewards, self.tokenizer = rewards, run.tokenizer

    def before_training(self, step: int) -> list[StepRecord]:
        return [StepRecord(0, dict(self.evaluate()))] if self.every and step == 0 else []

    def after_step(self, step: int) -> dict[str, float]:
        due = self.every and (step % self.every == 0 or step == self.last_step)
        return self.evaluate() if due else {}

    def evaluate(self) -> dict[str, float]:
        """`eval/accuracy` (math-verify), `eval/<reward>` per training reward, lengths and time."""
        if not self.problems:
            raise ValueError("This run has no held-out set: set eval_steps > 0 in its config.")
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # the training stream of random numbers is left as it was
            rollout = self.backend.generate(self.prompts, self.num_generations, self.sampling,
                                            prompt_names=[p.id for p in self.problems])
        texts = [self.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in rollout.completions]
        answers = [self.problems[c.group].answer for c in rollout.completions]
        metrics: dict[str, float] = {"eval/accuracy": _mean(verified_reward(texts, answers))}
        _, per_reward = compute_rewards(texts, answers, dict(self.rewards), [1.0] * len(self.rewards),
                                        num_generations=self.num_generations)
        metrics.update({f"eval/{k.removeprefix('reward/')}": _mean(v) for k, v in per_reward.items()})
        return {**metrics, "eval/mean_length": _mean([len(c.completion_ids) for c in rollout.completions]),
                "eval/truncated_frac": _mean([c.finish_reason == "length" for c in rollout.completions]),
                "eval/completions": float(len(texts)), "eval/seconds": time.perf_counter() - start}


def build_held_out(config: Any, tokenizer: Any) -> tuple[list[Problem], list[list[int]]]:
    """The held-out problems a `CBGRPOConfig` asks for (`eval_data`, `eval_num_problems`) and their prompt ids."""
    from cbkit.tasks.data import chat_prompt_ids, load_problems

    source = config.eval_data or config.data
    options = config.data_options if source == config.data else None
    # A generated task can draw a question twice: each kept once, from more draws than needed.
    drawn = load_problems(source, n=4 * config.eval_num_problems, seed=EVAL_SEED, options=options)
    unique = list({question_key(p): p for p in drawn}.values())[: config.eval_num_problems]
    return unique, [chat_prompt_ids(tokenizer, p, system_prompt=config.system_prompt) for p in unique]


def _mean(values: Sequence[float | bool]) -> float:
    return sum(float(v) for v in values) / len(values) if values else float("nan")
