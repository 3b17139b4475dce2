"""Both backends' wall time and peak with glibc as it is and with its mmap threshold pinned, alternating processes
(fixed 96-token completions, GSM8K prompt 0):

    for i in 1 2
    do OMP_NUM_THREADS=2 .venv/bin/python lab/probes/ab_time.py 32,64 dynamic;
      MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=2 .venv/bin/python lab/probes/ab_time.py 32,64 fixed128k
      done

Results: lab/memory.md."""

import json
import sys

import torch

from cbkit.train.setup import set_up_run

torch.set_num_threads(2)
setup = set_up_run("smollm2-offline", "gsm8k-local", 1, seed=0, dtype=None)
model, prompts = setup.model, setup.prompts
s = setup.sampling(96, temperature=1.0, seed=0)
tag = sys.argv[2]
for b in ["generate", "continuous"]:
    be = setup.backend(b)
    be.generate(prompts, 2, s, target_lengths=[4, 4])
    for n in [int(x) for x in sys.argv[1].split(",")]:
        r = be.generate(prompts, n, s, target_lengths=[96] * n)
        print(
            json.dumps(dict(tag=tag, backend=b, N=n, wall=round(r.wall_s, 2), peak=r.peak_mem_bytes)),
            flush=True,
        )
