"""How the CPU page size and pool rule change the CB engine's KV use: one GSM8K prompt x N, EOS off.

Prints, per setting, the pool the backend resolved, the engine's least free capacity, its step count, how
many requests started late (queued for blocks) and the peak RSS above the post-load baseline.
Usage: python lab/probes/cpu_page_probe.py [N] [MAX_NEW_TOKENS]
"""

from __future__ import annotations

import sys

from transformers.generation.continuous_batching import continuous_api

from cbkit.models.load import load_policy
from cbkit.rollout import ContinuousBackend, SamplingParams
from cbkit.tasks.data import chat_prompt_ids, load_problems

seen = {"min_free": None, "steps": 0}
_update = continuous_api.ContinuousBatchProcessor.update_batch


def _watched_update(self) -> None:
    _update(self)
    free = self.cache.compute_free_capacity(relative=False)
    seen["steps"] += 1
    seen["min_free"] = free if seen["min_free"] is None else min(seen["min_free"], free)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    continuous_api.ContinuousBatchProcessor.update_batch = _watched_update
    policy = load_policy("smollm2-offline")
    prompts = [chat_prompt_ids(policy.tokenizer, p) for p in load_problems("gsm8k-local", n=1, seed=0)]
    sp = SamplingParams(max_new_tokens=new, eos_token_id=None, pad_token_id=0, seed=0)
    print(f"prompt tokens {len(prompts[0])}, N={n}, max_new_tokens={new}")
    for page in (256, 32):
        seen.update(min_free=None, steps=0)
        r = ContinuousBackend(policy.model, {"page_size": page}, record_timestamps=True).generate(prompts, n, sp)
        starts = sorted(q["start"] for q in r.timeline["requests"])
        late = sum(s - starts[0] > 0.5 for s in starts)
        print(f"page={page} pool={r.engine_config['num_blocks']} min_free={seen['min_free']} steps={seen['steps']} "
              f"late_starts={late} peak={r.peak_mem_bytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
