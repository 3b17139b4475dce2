"""Completions before and after a `cbkit train` run, on problems the run never trained on.

    OMP_NUM_THREADS=2 python scripts/learning_completions.py runs/arith [PROMPTS] [N]

Loads the run's recipe (its checkpoint's config.json) and its held-out set (`cbkit.train.evaluate`: the problems
removed from its training set; for a run without one, problems of its source drawn with the evaluation seed),
samples N completions for each of the first PROMPTS, once with the initial weights and once with the run's last
checkpoint, with the same sampling seed; prints held-out accuracy (math-verify) and the run's rewards for both, and
completions side by side as Markdown (docs/learning.md quotes it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_model

from cbkit.models.load import load_policy
from cbkit.rollout import make_backend
from cbkit.rollout.base import SamplingParams, stop_token_ids
from cbkit.tasks.rewards import compute_rewards, resolve_rewards, verified_reward
from cbkit.train import checkpoint
from cbkit.train.evaluate import build_held_out


def main(run_dir: str, prompts: int = 16, n: int = 4) -> None:
    last = checkpoint.latest_checkpoint(run_dir)
    if last is None:
        raise SystemExit(f"No checkpoint in {run_dir}: train with save_steps > 0 first.")
    config = checkpoint.read_config(last)
    policy = load_policy(config.model, dtype="float32", seed=config.seed)  # the weights the run trained
    problems, ids = build_held_out(config, policy.tokenizer)
    problems, ids = problems[:prompts], ids[:prompts]
    sampling = SamplingParams(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                              eos_token_id=stop_token_ids(policy.tokenizer, policy.model),
                              pad_token_id=policy.tokenizer.pad_token_id, seed=12345)
    funcs, weights = resolve_rewards(config.reward_funcs, config.reward_weights)
    texts = {}
    for name in ("before", "after"):
        if name == "after":
            load_model(policy.model, str(Path(last) / "model.safetensors"))
        rollout = make_backend("continuous", policy.model).generate(ids, n, sampling)
        texts[name] = [policy.tokenizer.decode(c.completion_ids, skip_special_tokens=True)
                       for c in rollout.completions]
        answers = [problems[c.group].answer for c in rollout.completions]
        total, parts = compute_rewards(texts[name], answers, funcs, weights, num_generations=n)
        said = ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in parts.items())
        accuracy = sum(verified_reward(texts[name], answers)) / len(answers)
        print(f"{name} ({'initial weights' if name == 'before' else last.name}): held-out accuracy {accuracy:.3f}, "
              f"reward/mean {sum(total) / len(total):.3f}, {said} over {len(total)} completions of "
              f"{len(problems)} held-out problems")
    print("\n| problem | before | after |\n| --- | --- | --- |")
    for i in range(0, min(len(problems), 8) * n, n):
        q = problems[i // n].question.replace("\n", " ")
        cell = [t.strip().replace("\n", "<br>").replace("|", "\\|") for t in (texts["before"][i], texts["after"][i])]
        print(f"| {q[:90]}{'...' if len(q) > 90 else ''} (answer {problems[i // n].answer}) | {cell[0]} | {cell[1]} |")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
