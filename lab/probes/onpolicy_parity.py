"""The on-policy loop's metrics, to compare two versions of cbkit: 3 steps on the tiny model, both backends.

    git archive 811cb17 | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python lab/probes/onpolicy_parity.py /tmp/par_base
    PYTHONPATH=$PWD     python lab/probes/onpolicy_parity.py /tmp/par_new
    # then compare OUT/cb0/metrics.jsonl and OUT/cb1/metrics.jsonl without the timing keys

lab/async_step_time.md reports the comparison of the off-policy work against the commit before it.
"""
import string
import sys

import torch

import cbkit
from cbkit.models.load import load_policy
from cbkit.tasks.data import Problem
from cbkit.train.config import CBGRPOConfig
from cbkit.train.grpo import GRPOTrainer


def letters(completions, answers):
    return [sum(ch in string.ascii_lowercase for ch in c) / 8 for c in completions]


PROBLEMS = [Problem(f"p{i}", q, "1") for i, q in enumerate(["hi", "what is 2+2?", "ok", "go on"])]
torch.set_num_threads(1)
for cb in (False, True):
    cfg = CBGRPOConfig(model="tiny", system_prompt=None, prompts_per_step=2, num_generations=4, max_completion_length=8,
                       learning_rate=1e-2, max_steps=3, disable_tqdm=True, use_transformers_continuous_batching=cb,
                       save_steps=0, output_dir=f"{sys.argv[1]}/cb{int(cb)}")
    GRPOTrainer(cfg, policy=load_policy("tiny", seed=0), reward_funcs=[letters], problems=PROBLEMS).train()
print(cbkit.__file__)
