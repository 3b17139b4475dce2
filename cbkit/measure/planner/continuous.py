"""The CB engine's memory for one rollout.

The CB engine allocates one pool up front and keeps it, whatever the batch needs. The planner repeats the engine's own
sizing, step for step, so that it predicts the number of blocks the engine resolves (a test builds the engine and
checks this):

- the settings are the ones cbkit's ``continuous`` backend hands the engine (``make_cb_config``): on a
  GPU ``max_memory_percent=0.5`` of the free memory; on a CPU, unless ``num_blocks`` is given (``None``
  hands the sizing back to the engine), exactly enough blocks for every request at full length;
- transformers (``PagedAttentionCache.__init__`` and ``PagedAttentionMemoryHandler`` in
  ``generation/continuous_batching/cache.py``) turns those into *sectors*: the LCM of each attention
  type's block bytes and 128 bytes. ``num_blocks`` is rounded up to whole sectors. Without it,
  ``available = free memory x max_memory_percent`` pays first for the fixed overhead (two trash sectors,
  the LM-head rows of up to ``max_requests_per_batch`` requests) and ``max_batch_tokens`` (default 8192)
  x the per-batch-token cost (IO tensors + the larger of the attention and LM-head activation peaks);
  the rest becomes sectors, each charged its own bytes plus the cache-read buffers it implies, and
  finally enough sectors are given back to pay for the eager/SDPA attention mask
  [max_batch_tokens, cache tokens + max_batch_tokens];
- the workload hints (longest prompt, ``max_new_tokens``, number of requests) do **not** cap the pool in
  transformers 5.24 (``resolve_using_hints`` in ``initialization.py``): they only set
  ``max_blocks_per_request`` (the decode fast path's block table, kept only with a flash-attn kernel on
  CUDA, never with cbkit's varlen attention) and ``max_requests_per_batch = min(requests, 1024)``, whose LM-head rows are reserved before the
  pool is sized. On a GPU the pool is therefore about the same size at N=8 and at N=64 (1-2% smaller
  with more requests), which is why ``generate()`` is the lighter of the two at small N and the heavier
  at large N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from cbkit.measure.planner.shape import CacheShape
from cbkit.telemetry import fmt_bytes, kv_bytes_per_token

# transformers' defaults the engine falls back to (initialization.py FALLBACK_DEFAULTS, cache.py).
_DEFAULT_MAX_BATCH_TOKENS = 8192
_FALLBACK_MAX_REQUESTS_PER_BATCH = 1024
_SECTOR_ALIGN_BYTES = 128


@dataclass(frozen=True)
class ContinuousPlan:
    """The CB engine's memory for one rollout, bytes above the weights."""

    sized_by: Literal["num_blocks", "workload", "memory"]
    num_blocks: int  # whole-model blocks of page_size tokens, as the engine reports them
    num_sectors: int
    page_size: int
    max_batch_tokens: int
    pool_bytes: int  # num_blocks x page_size x KV bytes/token: the capacity (as telemetry reports it)
    cache_tensor_bytes: int  # the tensor actually allocated: sectors + the two trash sectors
    buffer_bytes: int  # IO tensors and attention masks, allocated up front for max_batch_tokens
    transient_bytes: int  # activations of a full batch, cache reads, LM-head rows
    engine_reserved_bytes: int  # what the engine budgets for itself (compute_memory_footprint)
    peak_bytes: int
    full_length_sequences: int  # how many sequences the pool holds at prompt + max_new_tokens at once
    fits: bool | None
    batch_tokens: int = 0  # the most tokens one forward runs (a prefill batch; prefix sharing shrinks it)


def plan_continuous(
    s: CacheShape,
    lens: list[int],
    n: int,
    max_new: int,
    mean_completion: float | None,
    budget: int | None,
    device: str,
    attn: str,
    logits_to_keep: bool,
    overrides: dict[str, Any],
) -> tuple[ContinuousPlan, list[str]]:
    import torch

    from cbkit.rollout.engine_config import make_cb_config, page_size

    notes: list[str] = []
    requests = len(lens) * n
    # What cbkit's continuous backend hands the engine, resolved by the same function from the same rows
    # (only their lengths matter to the sizing).
    rows = [range(p) for p in lens for _ in range(n)]
    cfg = make_cb_config(overrides, device=torch.device(device), rows=rows, max_new_tokens=max_new, warn=False)
    page = page_size(cfg)

    # resolve_using_hints / resolve_without_hints / ensure_decode_fast_path_is_available (initialization.py): the
    # block table only for a flash-attn kernel; cbkit's varlen attention, like flash, has no mask (attn_mask_is_needed)
    flash = attn in ("flash", "varlen")
    max_rpb = cfg.max_requests_per_batch or min(requests, _FALLBACK_MAX_REQUESTS_PER_BATCH)
    blocks_per_req = 0
    if device == "cuda" and attn == "flash" and cfg.max_blocks_per_request != 0:
        blocks_per_req = cfg.max_blocks_per_request or _hinted_blocks_per_request(max(lens) + max_new, page)
    # decide_use_cuda_graphs / decide_use_async_batching: graphs only on CUDA; async needs graphs and no mask.
    graphs = cfg.use_cuda_graph if cfg.use_cuda_graph is not None else flash
    graphs = device == "cuda" and (any(graphs) if isinstance(graphs, tuple | list) else bool(graphs))
    use_async = cfg.use_async_batching if cfg.use_async_batching is not None else (graphs and flash)
    mmp = cfg.max_memory_percent if cfg.max_memory_percent is not None else (0.6 if device == "cpu" else 0.8)
    m = cfg.max_batch_tokens or _DEFAULT_MAX_BATCH_TOKENS

    # PagedAttentionCache.__init__: sectors are the LCM of each attention type's block bytes and 128 bytes.
    page_bytes = s.kv_layer_token * page
    group_block_bytes = [k * page_bytes for k in (s.full_layers, s.sliding_layers) if k]
    sector = math.lcm(*group_block_bytes, _SECTOR_ALIGN_BYTES)
    tokens_per_sector = max((sector // b) * page for b in group_block_bytes)
    block = s.layers * page_bytes

    # PagedAttentionMemoryHandler (cache.py), mirrored: its constructor reads *this* machine's free memory (the plan is
    # for a budget, often another GPU's) and its inputs exist only inside PagedAttentionCache on a loaded model.
    i32, i64, groups = 4, 8, len(group_block_bytes)
    io_mult = 2 if use_async else 1
    kv_heads_at_peak = 2 * s.kv_heads if flash else 2 * s.heads + s.kv_heads
    masks = 0 if flash else (2 if s.sliding_layers else 1)
    lm_row = s.hidden * s.a + s.vocab * 4
    attention_peak = s.a * (s.hidden + s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim
                            + kv_heads_at_peak * s.head_dim)
    io_per_token = io_mult * (7 * i32 + 2 * i32 + groups * blocks_per_req * i32 + 2 * groups * i64)
    per_batch_token = max(0 if logits_to_keep else lm_row, attention_peak) + io_per_token
    per_cache_token = kv_heads_at_peak * s.head_dim * s.a + io_mult * groups * i64
    per_cache_sector = sector + tokens_per_sector * per_cache_token
    fixed = 2 * sector + (max_rpb * lm_row if logits_to_keep else 0)

    def mask_bytes(sectors: int) -> int:
        return io_mult * masks * s.a * m * (sectors * tokens_per_sector + m)

    sized_by: Literal["num_blocks", "workload", "memory"]
    if cfg.num_blocks is not None:
        sectors = max(1, math.ceil(cfg.num_blocks * block / sector))
        sized_by = "num_blocks" if "num_blocks" in overrides else "workload"
    else:
        if budget is None:
            raise ValueError(
                "The CB engine sizes its pool as a share of free memory: give budget_bytes (free memory after "
                "the weights), or num_blocks to fix the pool."
            )
        available = int(budget * mmp)
        sectors = (available - fixed - m * per_batch_token) // per_cache_sector
        masked = mask_bytes(sectors)
        sectors -= math.ceil(masked / (per_cache_sector + mask_bytes(sectors + 1) - masked))
        sized_by = "memory"
        if sectors <= 0:
            notes.append(f"CB: {mmp:.0%} of the budget does not cover the engine's buffers for "
                         f"max_batch_tokens={m}; the engine would refuse to start.")
            sectors = 0
    engine_reserved = fixed + m * per_batch_token + sectors * per_cache_sector + mask_bytes(sectors)

    resolved_blocks = sectors * sector // block
    pool_tokens = resolved_blocks * page
    full_len = max(lens) + max_new
    completion = mean_completion if mean_completion is not None else max_new
    # Tokens alive at once: every request at its (mean) full length if the pool holds them, else the pool.
    alive = min(pool_tokens, int(sum(n * (p + completion) for p in lens)))
    # A prefill batch is packed up to max_batch_tokens. With prefix sharing (the engine's default, full attention
    # only) cbkit's engine prefills each repeated prompt alone first; its N requests then compute only the tokens
    # past its last complete page (the last page again where the prompt fills its pages exactly).
    sharing = cfg.allow_block_sharing and not s.sliding_layers and n > 1
    if sharing:
        shared = [p for p in lens if p >= page]
        tails = sum(n * ((p % page) or page) if p >= page else n * p for p in lens)
        batch_tokens = min(m, max(sum(shared), tails))
    else:
        batch_tokens = min(m, sum(lens) * n)
    transient = (batch_tokens * s.forward_bytes_per_token() + alive * kv_heads_at_peak * s.head_dim * s.a
                 + min(requests, max_rpb) * lm_row)
    cache_tensor = (sectors + 2) * sector
    buffers = m * io_per_token + mask_bytes(sectors)
    if device == "cpu":
        # The mask is torch.empty: host pages become resident only where a batch writes its
        # [batch tokens, batch tokens + cache tokens read] corner, so RSS sees that corner, not the tensor.
        buffers = m * io_per_token + io_mult * masks * s.a * batch_tokens * (batch_tokens + alive)
        if mask_bytes(sectors):  # no mask at all with a varlen or flash attention
            notes.append(f"CPU: the engine reserves {fmt_bytes(mask_bytes(sectors))} of attention mask "
                         f"(max_batch_tokens={m} x cache tokens) but only the part a batch writes becomes resident.")
    peak = cache_tensor + buffers + transient
    if pool_tokens and pool_tokens < requests * full_len:
        notes.append(f"CB: the pool holds {pool_tokens // full_len} of {requests} sequences at full length; "
                     "the rest wait for recycled blocks (that is the point, not an error).")
    fits = None if budget is None else (sectors > 0 and peak <= budget)
    return ContinuousPlan(sized_by, resolved_blocks, sectors, page, m, resolved_blocks * block, cache_tensor,
                          buffers, transient, engine_reserved, peak, pool_tokens // full_len, fits,
                          batch_tokens), notes


def _hinted_blocks_per_request(max_len: int, page: int) -> int:
    blocks = math.ceil(max_len / page) + 1
    return blocks + blocks % 2



def pool_blocks(config: Any, pool_bytes: int, *, page_size: int, dtype_bytes: int) -> int:
    """The CB engine's ``num_blocks`` for a pool of ``pool_bytes`` of KV: a pool fixed in bytes, whatever the GPU's
    free memory (the engine's own sizing takes a share of whatever is free)."""
    per_block = kv_bytes_per_token(config, dtype_bytes) * page_size
    if pool_bytes < per_block:
        raise ValueError(f"a pool of {fmt_bytes(pool_bytes)} holds no block of {page_size} tokens "
                         f"({fmt_bytes(per_block)}); give it more memory.")
    return pool_bytes // per_block
