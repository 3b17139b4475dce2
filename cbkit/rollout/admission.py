"""The paged KV pool, modelled once: how large the engine makes it (`admission`: transformers' own sizing and memory
check, run on any machine) and how many blocks a group of completions needs (`blocks_needed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.rollout.engine_config import engine_attention, make_cb_config, page_size
from cbkit.rollout.upstream import engine_footprint, workload_hints
from cbkit.rollout.varlen_attention import varlen_unsupported_reason


@dataclass(frozen=True)
class Admission:
    """transformers' own verdict on starting a CB engine, and the pool it would build."""

    fits: bool
    footprint_bytes: int  # what the engine reserves: the pool, its per-token buffers, the attention mask, ...
    available_bytes: int  # max_memory_percent x (total - max(allocated, reserved)): what it checks against
    num_blocks: int | None  # the pool it would build, in blocks of page_size tokens (None where it refuses)
    max_batch_tokens: int | None
    attention: str
    error: str | None  # the engine's own message where it refuses
    page_size: int = 0
    cache_bytes: int = 0  # the cache tensor it allocates: the pool's sectors and two trash sectors
    mask_bytes: int = 0  # its dense attention masks (none with flash or cbkit's varlen attention)

    def line(self) -> str:
        verdict = "starts" if self.fits else "REFUSED"
        return (f"engine {verdict}: needs {self.footprint_bytes / 2**30:.2f} of {self.available_bytes / 2**30:.2f} "
                f"GiB it may take ({self.attention}" + (f", {self.num_blocks} blocks" if self.num_blocks else "") + ")")


def admission(config, overrides: Mapping[str, Any] | None, *, dtype: torch.dtype, rows: Sequence[Sequence[int]],
              max_new_tokens: int, total_bytes: int, used_bytes: int = 0, capability: tuple[int, int] = (8, 0),
              flash: Sequence[int] = (), device: str = "cuda", attention: str | None = None) -> Admission:
    """Would a CB engine start on a `device` of `total_bytes` with `used_bytes` taken, for a model of `config` in
    `dtype` and this call's pool (resolved as `Engine.run` does), and what pool would it build?"""
    attention = attention or engine_attention(device, dtype, capability, flash, needs_own=varlen_unsupported_reason(config))
    cb = make_cb_config(overrides, device=torch.device(device), rows=rows, max_new_tokens=max_new_tokens, warn=False)
    f = engine_footprint(config, cb, attention=attention, dtype=dtype, hints=workload_hints(rows, max_new_tokens),
                         total_bytes=total_bytes, used_bytes=used_bytes, device=device)
    return Admission(f["error"] is None, f["footprint"], f["available"], f["num_blocks"], f["max_batch_tokens"],
                     attention, f["error"], page_size(cb), f["cache_bytes"], f["mask"])


def pool_blocks(config: Any, pool_bytes: int, *, page_size: int, dtype_bytes: int) -> int:
    """The engine's ``num_blocks`` for a pool fixed at ``pool_bytes`` of KV, whatever the device's free memory."""
    from cbkit.telemetry import fmt_bytes, kv_bytes_per_token

    per_block = kv_bytes_per_token(config, dtype_bytes) * page_size
    if pool_bytes < per_block:
        raise ValueError(f"a pool of {fmt_bytes(pool_bytes)} holds no block of {page_size} tokens "
                         f"({fmt_bytes(per_block)}); give it more memory.")
    return pool_bytes // per_block


def blocks_needed(prompt_len: int, tokens: int, page: int, *, n: int = 1, share_prompt: bool = True) -> int:
    """Blocks a group of `n` sequences of one prompt holds at `tokens` past the prompt: with prefix sharing the
    prompt's complete pages once, each sequence its own pages after them."""
    shared = prompt_len // page if share_prompt and n > 1 else 0
    return shared + n * (-(-(prompt_len + tokens) // page) - shared)
