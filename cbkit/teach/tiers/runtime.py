"""Does it finish in time? A notebook's runtime by the roofline (`cbkit.measure.roofline`'s ``estimated_*_seconds``:
the roof slowed to an assumed efficiency, never under a per-step launch floor): its training steps and its rollouts,
each decoding the sequences a static batch or the CB pool keeps running."""

from __future__ import annotations

import functools
import math
from typing import Any

from cbkit.measure import roofline
from cbkit.teach.tiers.table import PROMPT_LEN


def estimated_train_step(config: Any, rows: int, new_tokens: int, gpu: roofline.Machine, dtype: str) -> float:
    """The old-logprob forward and the loss's forward and backward of one step, by the roofline."""
    return roofline.estimated_train_seconds(config, rows=rows, tokens_per_row=PROMPT_LEN + new_tokens,
                                            machine=gpu, dtype=dtype, forwards=2)


def rollout_seconds(config, prompts, n, new, backend, lengths, pool, gpu, dtype, dtype_bytes) -> float:
    """A rollout's seconds, its matmuls priced in the dtype of the weights it samples from: fp32 weights (4 bytes)
    at the GPU's fp32 peak whatever the training forwards' autocast dtype (``dtype``), since the engine runs no
    autocast. Not TF32's: cbkit leaves `torch.backends.cuda.matmul.allow_tf32` at PyTorch's default, off, so that
    fp32 rollouts sample from the same fp32 products as the fp32 logprob checks."""
    dtype = "float32" if dtype_bytes == 4 else dtype
    running = _running(prompts * n, new, backend, lengths, pool["num_blocks"], pool["page_size"])
    return roofline.estimated_rollout_seconds(config, prompt_lens=[PROMPT_LEN] * prompts, running=running,
                                              context=PROMPT_LEN + new // 2, dtype_bytes=dtype_bytes, machine=gpu,
                                              dtype=dtype)


@functools.cache
def _running(rows: int, new: int, backend: str, lengths: str, num_blocks: int, page: int) -> tuple[int, ...]:
    """Sequences decoding at each step: a static batch runs every row until the longest ends; the pool admits
    what its blocks cover (`teach.recycling.paged_pool`, the same model the explorer draws)."""
    from cbkit.measure.workload import parse_lengths
    from cbkit.teach.recycling import paged_pool, static_batch

    targets = parse_lengths(lengths).targets(rows, new, seed=0) or [new] * rows
    if backend == "generate":
        return static_batch(PROMPT_LEN, targets).running
    worst = math.ceil((PROMPT_LEN + new) / page)
    return paged_pool(PROMPT_LEN, targets, page, pool_blocks=max(num_blocks, worst), max_len=new).running
