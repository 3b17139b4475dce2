"""Held-out evaluation: accuracy on problems the run never trains on, at step 0 and every `eval_steps` steps.

Train reward is no evidence that a recipe learns its task: it is measured on the prompts being trained on, and it
rises just as well when the policy games the reward (docs/learning.md shows a run whose format reward went
0.34 -> 1.0 while its correctness fell to 0). So the loop also samples completions for a fixed set of problems it
never trains on and scores them with `verified_reward` (math-verify), whatever the training reward is:

* **fixed**: the same problems, prompts and sampling seed at every evaluation and in every run of a recipe (its
  seed is `EVAL_SEED`, not the run's), so two evaluations differ only by the weights, and two runs (two seeds, CB
  against `generate()`) are compared on the same problems and the same random numbers;
* **no leak**: the set is drawn first (`eval_data`, default the training source, with `EVAL_SEED`) and every
  training problem whose question is in it is removed (`without_held_out`), so a generated task with a small
  problem space cannot train on an evaluation question, and a file source loses its first `eval_num_problems`
  rows to evaluation;
* **through the CB engine**, `eval_num_generations` samples per problem at the training temperature (accuracy at
  the temperature the policy is trained at; greedy decoding would hide what sampling still gets wrong), timed on
  its own (`eval/seconds`, outside `step/seconds`), with the RNG state around it restored, so a run with evaluation
  trains exactly as the same run without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.rollout import RolloutBackend, SamplingParams
from cbkit.tasks.data import Problem
from cbkit.tasks.rewards import compute_rewards, verified_reward

# The evaluation set's seed and its sampler's: one constant, so every run of every recipe meets the same problems.
EVAL_SEED = 20_240_601


def question_key(problem: Problem) -> str:
    """What makes two problems the same for the leak check: the question, whitespace-normalised."""
    return " ".join(problem.question.split())


def without_held_out(train: Sequence[Problem], held_out: Sequence[Problem]) -> list[Problem]:
    """`train` minus every problem whose question is a held-out one; an error if nothing is left to train on."""
    banned = {question_key(p) for p in held_out}
    kept = [p for p in train if question_key(p) not in banned]
    if not kept:
        raise ValueError(f"All {len(train)} training problems are in the held-out set of {len(held_out)}: the task "
                         "has too few distinct problems. Lower eval_num_problems, raise num_problems, or make the "
                         "task larger (data_options).")
    return kept


@dataclass
class HeldOut:
    """The fixed evaluation set of a run, its chat prompts, and how it is sampled."""

    problems: list[Problem]
    prompts: list[list[int]]
    num_generations: int

    def evaluate(self, backend: RolloutBackend, sampling: SamplingParams, decode: Callable[[Sequence[int]], str],
                 rewards: Mapping[str, Callable[..., list[float]]] | None = None) -> dict[str, float]:
        """Sample `num_generations` completions per held-out problem and score them: `eval/accuracy` (math-verify),
        `eval/<reward>` for each training reward, `eval/mean_length`, `eval/truncated_frac`, `eval/seconds`."""
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # the training stream of random numbers is left as it was
            rollout = backend.generate(self.prompts, self.num_generations, sampling,
                                       prompt_names=[p.id for p in self.problems])
        texts = [decode(c.completion_ids) for c in rollout.completions]
        answers = [self.problems[c.group].answer for c in rollout.completions]
        metrics: dict[str, float] = {"eval/accuracy": _mean(verified_reward(texts, answers))}
        if rewards:
            _, per_reward = compute_rewards(texts, answers, dict(rewards), [1.0] * len(rewards),
                                            num_generations=self.num_generations)
            metrics.update({f"eval/{k.removeprefix('reward/')}": _mean(v) for k, v in per_reward.items()})
        lengths = [len(c.completion_ids) for c in rollout.completions]
        metrics.update({
            "eval/mean_length": sum(lengths) / len(lengths),
            "eval/truncated_frac": _mean([c.finish_reason == "length" for c in rollout.completions]),
            "eval/completions": float(len(texts)),
            "eval/seconds": time.perf_counter() - start,
        })
        return metrics


def build_held_out(config: Any, tokenizer: Any) -> HeldOut:
    """The held-out set a `CBGRPOConfig` asks for (`eval_data`, `eval_num_problems`, `eval_num_generations`)."""
    from cbkit.tasks.data import chat_prompt_ids, load_problems

    source = config.eval_data or config.data
    options = config.data_options if source == config.data else None
    # A generated task can draw the same question twice: keep each once, so every problem weighs the same, and draw
    # more than needed so that the set still has eval_num_problems of them where the task has that many.
    drawn = load_problems(source, n=4 * config.eval_num_problems, seed=EVAL_SEED, options=options)
    unique = list({question_key(p): p for p in drawn}.values())[: config.eval_num_problems]
    prompts = [chat_prompt_ids(tokenizer, p, system_prompt=config.system_prompt) for p in unique]
    return HeldOut(unique, prompts, config.eval_num_generations)


def eval_sampling(train_sampling: SamplingParams) -> SamplingParams:
    """The training sampling (temperature, top-p/k, length, stop ids) with the evaluation's fixed seed."""
    import dataclasses

    return dataclasses.replace(train_sampling, seed=EVAL_SEED)


def _mean(values: Sequence[float | bool]) -> float:
    return sum(float(v) for v in values) / len(values) if values else float("nan")
