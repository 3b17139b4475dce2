"""``generate()``'s memory for one rollout.

``generate()`` keeps every row of the static batch until the *last* row finishes. Its cache grows step by step
(transformers' DynamicCache appends with ``torch.cat``), so the peak is reached at the end: rows x (longest prompt +
decode steps) tokens of KV, plus the per-step transients that scale with rows x vocabulary (the logits, their fp32
copy, the log-probs cbkit's recorder keeps, the sampling probabilities). The planner takes the decode steps to be
``max_new_tokens``: with many rows, one of them usually runs to the limit. That is an upper bound; a batch whose every
row stops early uses less. On a CPU, glibc keeps the blocks ``torch.cat`` frees resident between the new ones: the plan
adds that heap slack there (``CPU_HEAP_SLACK``, fitted on one machine: `cbkit.measure.fitted`), never on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbkit.measure.fitted import CPU_HEAP_SLACK, CPU_HEAP_SLACK_MAX, GLIBC_MMAP_THRESHOLD_MAX
from cbkit.measure.planner.shape import CacheShape


@dataclass(frozen=True)
class GeneratePlan:
    """`generate()`'s memory for one rollout, bytes above the weights."""

    rows: int
    padded_len: int  # longest prompt + decode steps: every row's KV length at the end
    kv_bytes: int
    prefill_bytes: int  # the first forward: prompt KV + activations of rows x longest prompt tokens
    decode_transient_bytes: int  # last step: logits and their copies, plus one layer's torch.cat
    peak_bytes: int
    fits: bool | None  # None without a budget
    # CPU only: what glibc's heap keeps resident beside the growing cache (`CPU_HEAP_SLACK`); 0 on a GPU, where the
    # peak is torch's allocated bytes, and on a CPU where each layer's K is above glibc's largest mmap threshold.
    cpu_heap_slack_bytes: int = 0


# generate() on a CPU: transformers' DynamicCache grows with torch.cat, so every step allocates each layer's K and V
# anew and frees the old ones; glibc's heap keeps the freed blocks resident beside the new ones. The plan adds that
# heap (`fitted.CPU_HEAP_SLACK` x the cache, capped), CPU only, and none where one layer's K is above glibc's largest
# mmap threshold (mmapped, handed back when freed).


def plan_generate(s: CacheShape, rows: int, prompt: int, max_new: int, budget: int | None,
                  device: str = "cuda") -> GeneratePlan:
    length = prompt + max_new
    # Sliding-window layers keep at most `window` tokens (DynamicSlidingWindowLayer).
    tokens_held = s.full_layers * length + s.sliding_layers * min(length, s.sliding_window or length)
    kv = rows * tokens_held * s.kv_layer_token
    layer_k = rows * length * s.kv_layer_token // 2  # one layer's K (or V) at the end, one tensor
    slack = (min(int(CPU_HEAP_SLACK * kv), CPU_HEAP_SLACK_MAX)
             if device == "cpu" and layer_k < GLIBC_MMAP_THRESHOLD_MAX else 0)
    # Last step: the model's logits (logits_to_keep=1), generate's fp32 copy, the log-probs cbkit's
    # recorder keeps, the softmax it samples from; and torch.cat holding one layer's old K beside the new.
    decode = rows * s.vocab * (s.a + 3 * 4) + rows * length * s.kv_layer_token // 2
    prefill = (rows * prompt * s.layers * s.kv_layer_token + rows * prompt * s.forward_bytes_per_token()
               + rows * prompt * prompt  # the 4-D boolean padding mask
               + rows * s.vocab * (s.a + 4))
    peak = max(kv + slack + decode, prefill)
    return GeneratePlan(rows, length, kv, prefill, decode, peak, None if budget is None else peak <= budget, slack)
