"""One of notebook 05's staleness runs at its CPU size, resident memory before and after (VmHWM, VmRSS):

    OMP_NUM_THREADS=1 .venv/bin/python lab/probes/nb05_mem.py 4 5 8 48   # k=4, 5 steps, N=8, 48 tokens

Run before `train_runs` released memory between runs. Results: lab/memory.md."""
# Runs against cbkit as of commit 7648080 (`git worktree add /tmp/at-7648080 7648080`): the names it imports left the
# package after this probe was run; its result stays in lab/ with the command that made it.

import sys
import time

import torch
from cbkit.teach.offpolicy import train_runs

from cbkit.models.load import load_policy
from cbkit.teach.notebook import SHORT_ANSWER_PROMPT
from cbkit.train.config import CBGRPOConfig


def hwm():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmHWM", "VmRSS")):
                print(" ", line.strip(), end="")
    print(flush=True)


def reset():
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM


k = int(sys.argv[1])
steps = int(sys.argv[2])
n = int(sys.argv[3])
toks = int(sys.argv[4])
policy = load_policy("smollm2-offline", dtype=torch.float32, seed=0)
initial = {kk: v.detach().clone() for kk, v in policy.model.state_dict().items()}
print("loaded", end="")
hwm()
base = CBGRPOConfig(
    model="smollm2-offline",
    data="synthetic",
    num_problems=64,
    system_prompt=SHORT_ANSWER_PROMPT,
    prompts_per_step=2,
    num_generations=n,
    max_completion_length=toks,
    temperature=1.0,
    learning_rate=5e-5,
    max_steps=steps,
    save_steps=0,
    disable_tqdm=True,
    importance_sampling_mode="token_truncate",
    reward_funcs=["format", "correctness"],
)
t = time.time()
reset()
out = train_runs(policy, initial, base, {f"k={k}": {"rollout_staleness": k}}, None)
print(f"run k={k} {time.time() - t:.1f}s", end="")
hwm()
