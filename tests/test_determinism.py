"""Run to run, the same seed draws the same tokens with the same logprobs: five rollouts, each in a fresh process.

A fresh process is what a rerun is: nothing of an earlier rollout (a kept engine, the global RNG, the allocator,
torch's thread pool) carries over. Compared bitwise (`float.hex`), on CPU at the default thread count.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ROLLOUT = """
import json, sys
from cbkit.models.load import load_policy
from cbkit.rollout import SamplingParams, make_backend
policy = load_policy("tiny", seed=0)
tok = policy.tokenizer
sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
prompts = [tok("hi there")["input_ids"], tok("what is 12 + 30? answer with a number")["input_ids"]]
out = {}
for name in ("continuous", "generate"):
    rollout = make_backend(name, policy.model, pad_token_id=tok.pad_token_id).generate(prompts, 4, sampling)
    out[name] = [[list(c.completion_ids), [x.hex() for x in c.sampling_logprobs]] for c in rollout.completions]
print(json.dumps(out))
"""


@pytest.mark.serial  # at torch's default thread count, which a parallel worker's share is not
def test_five_fresh_processes_draw_the_same_tokens_and_logprobs():
    """Each process runs both backends, CB first; every run must match run 0 exactly."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", ROLLOUT], capture_output=True, text=True, check=True,
                                      timeout=600).stdout.strip().splitlines()[-1]) for _ in range(5)]
    for backend in ("continuous", "generate"):
        first = runs[0][backend]
        assert len({tuple(c[0]) for c in first}) > 1, f"{backend} drew one sequence: the test cannot tell"
        different = [i for i, r in enumerate(runs) if r[backend] != first]
        assert not different, f"{backend}: runs {different} drew other tokens or logprobs than run 0"
