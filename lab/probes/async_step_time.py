"""Step time of async rollouts against the synchronous loop, side by side in one process.

    OMP_NUM_THREADS=2 nice -n -10 python lab/probes/async_step_time.py [STEPS] [OUT.jsonl]

Same model, data, seed and sizes; the two loops alternate (sync, async, sync, async) from the same initial
weights, and each run's steps after the first are kept (an async run's first rollout has nothing to overlap).
Prints the median step, rollout-wait and training seconds per loop and appends one JSON line per run. On a CPU
the engine thread and the training share the same cores, so overlap buys little or nothing; on a GPU the
rollout's decode steps leave the device mostly idle between kernels, which is what the overlap fills.
"""
# Runs against cbkit as of commit 7648080 (`git worktree add /tmp/at-7648080 7648080`): the names it imports left the
# package after this probe was run; its result stays in lab/ with the command that made it.

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import torch
from cbkit.teach.offpolicy import Recorder

from cbkit.models.load import load_policy
from cbkit.teach.notebook import SHORT_ANSWER_PROMPT
from cbkit.train.config import CBGRPOConfig
from cbkit.train.grpo import GRPOTrainer


def main(steps: int = 4, out: str = "runs/async_step_time.jsonl") -> None:
    policy = load_policy("smollm2-offline")
    initial = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    base = CBGRPOConfig(model="smollm2-offline", data="synthetic", system_prompt=SHORT_ANSWER_PROMPT,
                        prompts_per_step=2, num_generations=8, max_completion_length=48, temperature=0.7,
                        learning_rate=5e-5, max_steps=steps, gradient_accumulation_steps=2, save_steps=0,
                        disable_tqdm=True, async_update_at=16)
    results = []
    for repeat, mode in enumerate(["sync", "async", "sync", "async"]):
        policy.model.load_state_dict(initial)
        rec = Recorder()
        config = dataclasses.replace(base, async_rollouts=mode == "async")
        start = time.perf_counter()
        GRPOTrainer(config, policy=policy, hooks=[rec]).train()
        kept = [r.metrics for r in rec.records[1:]]
        row = {"mode": mode, "repeat": repeat, "steps": steps, "wall_s": time.perf_counter() - start,
               "step_s": [m["step/seconds"] for m in kept], "train_s": [m["train/seconds"] for m in kept],
               "rollout_wait_s": [m.get("offpolicy/rollout_wait_s", m["rollout/seconds"]) for m in kept],
               "threads": torch.get_num_threads()}
        results.append(row)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{mode:>5} run {repeat}: median step {statistics.median(row['step_s']):.1f} s, rollout wait "
              f"{statistics.median(row['rollout_wait_s']):.1f} s, training {statistics.median(row['train_s']):.1f} s")
    for mode in ("sync", "async"):
        steps_s = [s for r in results if r["mode"] == mode for s in r["step_s"]]
        print(f"{mode}: median step {statistics.median(steps_s):.1f} s over {len(steps_s)} steps")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4, sys.argv[2] if len(sys.argv) > 2 else "runs/async_step_time.jsonl")
