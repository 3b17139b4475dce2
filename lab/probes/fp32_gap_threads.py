"""02's fp32 gap (engine sampling logprobs vs the teacher-forced policy, section 1 at CI size) and a hash of the
tokens drawn, in a fresh process per call, at a given torch thread count:

    for t in 1 2 1 2; do OMP_NUM_THREADS=2 .venv/bin/python lab/probes/fp32_gap_threads.py $t; done

Result (2026-12-02, this project's CPU): the same tokens every time; max gap 1.53e-05 at 1 thread and 2.12e-05 at 2,
bitwise the same at each thread count. The 4.4e-4 one CI run printed was not reproduced."""

import hashlib
import sys

import torch

from cbkit.models.load import load_policy
from cbkit.rollout import SamplingParams, make_backend
from cbkit.tasks.data import chat_prompt_ids, load_problems
from cbkit.teach.notebook import setup
from cbkit.train.logprobs import teacher_forced_logprobs

torch.set_num_threads(int(sys.argv[1]))
env = setup("02_logprob_correctness", "ci")
S = env.sizes
policy = load_policy(S.model, dtype="float32")
model, tok = policy.model, policy.tokenizer
problems = load_problems(env.data, n=S.prompts)
prompts = [chat_prompt_ids(tok, p) for p in problems]
POOL = env.pool_config(model, [p for p in prompts for _ in range(S.n)], S.max_new_tokens)
plain = SamplingParams(max_new_tokens=S.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
cb = make_backend("continuous", model, pad_token_id=tok.pad_token_id, cb_config=POOL)
r = cb.generate(prompts, S.n, plain)
d = torch.cat([(torch.tensor(c.sampling_logprobs) - ref).abs()
               for c, ref in zip(r.completions, teacher_forced_logprobs(model, r.completions, plain), strict=True)])
h = hashlib.sha256(str([c.completion_ids for c in r.completions]).encode()).hexdigest()[:12]
print(f"threads={torch.get_num_threads()} tokens={h} n={len(d)} max={d.max():.2e} mean={d.mean():.2e}", flush=True)
