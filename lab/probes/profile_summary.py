"""Shares of a rollout's time by what it was doing, from a py-spy raw (folded) profile.

Each sample is put in the category of its innermost frame that names one (a q/k/v projection counts as a linear
layer, not as attention), then shares are over the samples of the rollout's working thread: the engine thread
for transformers' driver, the caller's thread otherwise. Only rollout samples count (under a backend's
`generate`, or the engine's loop); model loading and warm-up set-up do not.
Usage: python lab/probes/profile_summary.py PROFILE.txt [--rollouts-only]
"""

from __future__ import annotations

import collections
import re
import sys

# (category, frame-name patterns), matched innermost first.
CATEGORIES = [
    ("linear layers (q/k/v/o, MLP, LM head)", ("Linear.forward",)),
    ("attention (cbkit varlen / SDPA)", ("varlen_attention", "per_sequence_attention", "sdpa_attention_forward",
                                         "_batched_decode", "paged_attention_forward")),
    ("KV cache write + gather", ("PagedAttentionCache.update", "DynamicLayer.update", "DynamicCache.update",
                                 "Cache.update")),
    ("sampling + logits processing", ("ModelRunner._sample", "ModelRunner._process_logit", "LogitsProcessor",
                                      "TemperatureLogitsWarper", "_process_logits", "multinomial")),
    ("RMSNorm", ("LlamaRMSNorm.forward",)),
    ("rotary embedding", ("apply_rotary_pos_emb", "LlamaRotaryEmbedding.forward", "rotate_half")),
    ("activation + residual (other model ops)", ("LlamaMLP.forward", "LlamaDecoderLayer.forward")),
    ("embedding lookup", ("Embedding.forward",)),
    ("engine: schedule + pack the batch", ("prepare_next_batch", "get_model_kwargs", "prepare_batch_tensors")),
    ("engine: update requests, deliver outputs", ("update_batch", "deliver_batch")),
    ("generate(): stopping criteria, cache bookkeeping", ("StoppingCriteria", "_update_model_kwargs",
                                                          "prepare_inputs_for_generation", "_has_unfinished")),
    ("model forward: other", ("LlamaForCausalLM.forward",)),
    ("engine set-up / tear-down (pool, processor, gc)", ("_create_batch_processor", "PagedAttentionCache.__init__",
                                                         "gc.collect", "__del__", "init_continuous_batching",
                                                         "_stop", "destroy")),
]
ROLLOUT = ("GenerateBackend.generate", "ContinuousBackend.generate", "_run_generation_loop")


def categorise(frames: list[str]) -> str:
    names = [re.sub(r" \(.*", "", f) for f in frames]
    for name in reversed(names):  # innermost first
        for category, patterns in CATEGORIES:
            if any(p in name for p in patterns):
                return category
    return "other Python (loop, queue, glue)"


def summarise(path: str) -> str:
    by_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(any(r in f for r in ROLLOUT) for f in frames):
            continue
        thread = "engine thread" if any("_run_generation_loop" in f for f in frames) else "caller thread"
        by_thread[thread][categorise(frames[1:])] += int(count)
    out = []
    if len(by_thread) > 1:  # the whole rollout: what the caller's thread does around the engine thread counts too
        by_thread["all threads"] = sum(by_thread.values(), collections.Counter())
    for thread, counts in sorted(by_thread.items()):
        total = sum(counts.values())
        out.append(f"{thread}: {total} samples")
        for category, n in counts.most_common():
            out.append(f"  {n / total:6.1%}  {category}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summarise(sys.argv[1]))
