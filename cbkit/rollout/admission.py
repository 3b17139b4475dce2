"""Will a CB engine start on a GPU's memory? transformers' own verdict, answered on any machine (`admission`).

The engine's internals it runs (its config resolution, its cache and memory handler) are reached through
`cbkit.rollout.upstream.engine_footprint`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.rollout.engine_config import engine_attention, make_cb_config
from cbkit.rollout.upstream import engine_footprint, workload_hints
from cbkit.rollout.varlen_attention import varlen_unsupported_reason


@dataclass(frozen=True)
class Admission:
    """transformers' own verdict on starting a CB engine: its memory handler's footprint check, run on a GPU's memory
    as the engine would read it there."""

    fits: bool
    footprint_bytes: int  # what the engine reserves: the pool, its per-token buffers, the attention mask, ...
    available_bytes: int  # max_memory_percent x (total - max(allocated, reserved)): what it checks against
    num_blocks: int | None  # the pool it would build, in blocks of page_size tokens (None where it refuses)
    max_batch_tokens: int | None
    attention: str
    error: str | None  # the engine's own message where it refuses

    def line(self) -> str:
        verdict = "starts" if self.fits else "REFUSED"
        return (f"engine {verdict}: needs {self.footprint_bytes / 2**30:.2f} of {self.available_bytes / 2**30:.2f} "
                f"GiB it may take ({self.attention}" + (f", {self.num_blocks} blocks" if self.num_blocks else "") + ")")


def admission(config, overrides: Mapping[str, Any] | None, *, dtype: torch.dtype, rows: Sequence[Sequence[int]],
              max_new_tokens: int, total_bytes: int, used_bytes: int, capability: tuple[int, int] = (8, 0),
              flash: Sequence[int] = ()) -> Admission:
    """Would a CB engine start on a CUDA device of `total_bytes` with `used_bytes` already taken (weights, a
    trainer's state, other copies), for a model of `config` in `dtype` and this call's pool (`overrides`, `rows`,
    `max_new_tokens`, resolved as `Engine.run` resolves them)? Answered by transformers' own code, on any machine:
    the engine's config resolution, then its `PagedAttentionCache` built on the meta device (no memory touched) with
    the engine's memory reading (`get_device_and_memory_breakdown`) returning this device's numbers. The attention is
    `engine_attention`'s choice for that GPU (`capability`, importable flash-attn `flash`), as `Engine` applies it:
    the engine reserves a dense attention mask only where the model needs its own attention, and with flash-attn its
    block-table decode path's buffers."""
    attention = engine_attention("cuda", dtype, capability, flash, needs_own=varlen_unsupported_reason(config))
    cb = make_cb_config(overrides, device=torch.device("cuda"), rows=rows, max_new_tokens=max_new_tokens, warn=False)
    footprint, available, blocks, batch_tokens, error = engine_footprint(
        config, cb, attention=attention, dtype=dtype, hints=workload_hints(rows, max_new_tokens),
        total_bytes=total_bytes, used_bytes=used_bytes)
    return Admission(error is None, footprint, available, blocks, batch_tokens, attention, error)
