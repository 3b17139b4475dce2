"""Two of notebook 05's runs back to back through `train_runs` (which now releases each run's memory): resident memory
after loading and after each run.

    OMP_NUM_THREADS=1 .venv/bin/python lab/probes/nb05_free.py

Results: lab/memory.md."""
# Runs against cbkit as of commit 7648080 (`git worktree add /tmp/at-7648080 7648080`): the names it imports left the
# package after this probe was run; its result stays in lab/ with the command that made it.

import time

import torch
from cbkit.teach.offpolicy import resident_bytes, train_runs

from cbkit.models.load import load_policy
from cbkit.teach.notebook import SHORT_ANSWER_PROMPT
from cbkit.train.config import CBGRPOConfig

policy = load_policy("smollm2-offline", dtype=torch.float32, seed=0)
initial = {kk: v.detach().clone() for kk, v in policy.model.state_dict().items()}
loaded = resident_bytes()
print("loaded", loaded >> 20, "MiB", flush=True)
base = CBGRPOConfig(
    model="smollm2-offline",
    data="synthetic",
    num_problems=64,
    system_prompt=SHORT_ANSWER_PROMPT,
    prompts_per_step=2,
    num_generations=4,
    max_completion_length=32,
    temperature=1.0,
    learning_rate=5e-5,
    max_steps=2,
    save_steps=0,
    disable_tqdm=True,
    importance_sampling_mode="token_truncate",
    reward_funcs=["format", "correctness"],
)
for i in range(2):
    t = time.time()
    train_runs(policy, initial, base, {"k=1": {"rollout_staleness": 1}}, None, keep_final=False)
    print(f"after run {i + 1}: {resident_bytes() >> 20} MiB ({time.time() - t:.0f} s)", flush=True)
