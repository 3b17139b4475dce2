"""generate() alone, every completion run to 96 tokens on GSM8K prompt 0: its measured peak beside the planner's
terms (KV, last-step transients, first forward). Run as it was, twice, once with glibc's mmap threshold pinned:

    OMP_NUM_THREADS=2 .venv/bin/python lab/probes/gen_mem.py 8,16,32,64
    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=2 .venv/bin/python lab/probes/gen_mem.py 8,32,64

Results: lab/memory.md."""

import json
import sys

import torch

from cbkit.measure.planner import plan
from cbkit.rollout.generate import GenerateBackend
from cbkit.train.setup import set_up_run

torch.set_num_threads(2)
setup = set_up_run("smollm2-offline", "gsm8k-local", 1, seed=0, dtype=None)
model, prompts = setup.model, setup.prompts
s = setup.sampling(96, temperature=1.0, seed=0)
be = GenerateBackend(model, pad_token_id=setup.tokenizer.pad_token_id)
be.generate(prompts, 2, s, target_lengths=[4, 4])  # warm
for n in [int(x) for x in sys.argv[1].split(",")]:
    r = be.generate(prompts, n, s, target_lengths=[96] * n)
    p = plan(
        model.config,
        num_prompts=1,
        num_generations=n,
        prompt_len=[len(x) for x in prompts],
        max_new_tokens=96,
        dtype_bytes=4,
        device="cpu",
    )
    g = p.generate
    print(
        json.dumps(
            dict(
                N=n,
                measured=r.peak_mem_bytes,
                planned=g.peak_bytes,
                err=r.peak_mem_bytes / g.peak_bytes - 1,
                kv=g.kv_bytes,
                decode=g.decode_transient_bytes,
                prefill=g.prefill_bytes,
                prompt=len(prompts[0]),
            )
        ),
        flush=True,
    )
