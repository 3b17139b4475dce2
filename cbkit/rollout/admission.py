"""Will a CB engine start on a GPU's memory? transformers' own verdict, answered on any machine (`admission`).

Part of the engine: this module reaches transformers' CB internals (its config resolution, its cache and memory
handler), listed in `cbkit/rollout/engine.py` and pinned by tests/test_engine_contract.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.rollout.engine_config import engine_attention, make_cb_config
from cbkit.rollout.engine_io import workload_hints
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
    import copy
    from unittest import mock

    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching import initialization
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    text = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    attention = engine_attention("cuda", dtype, capability, flash, needs_own=varlen_unsupported_reason(config))
    text._attn_implementation = attention
    cb = make_cb_config(overrides, device=torch.device("cuda"), rows=rows, max_new_tokens=max_new_tokens, warn=False)
    # The resolution asks whether CUDA is there and, with flash attention, whether flash-attn's block-table kernel
    # imports (its decode path): answered as on that GPU.
    flash_kernel = ((None, None, lambda *a, **k: None, None, None), (None, None))
    with (mock.patch("torch.cuda.is_available", return_value=True),
          mock.patch.object(initialization, "lazy_import_flash_attention", lambda *a, **k: flash_kernel)):
        resolved = _call(initialization.resolve_continuous_batching_config, config=text, cb_config=cb,
                         workload_hints=workload_hints(rows, max_new_tokens), has_logit_processors=True,
                         device=torch.device("cuda"))
    seen: dict[str, int] = {}
    handler = cache_module.PagedAttentionMemoryHandler
    original_check = handler._check_footprint

    def check(self, max_batch_tokens: int, num_blocks: int):
        seen.update(footprint=int(self.compute_memory_footprint(max_batch_tokens, num_blocks)),
                    available=int(self.available_memory), max_batch_tokens=int(max_batch_tokens))
        return original_check(self, max_batch_tokens, num_blocks)

    breakdown = (torch.device("cuda"), int(total_bytes), int(used_bytes), int(used_bytes))
    helper = _call(DistributedHelper, device_mesh=None, cpu_group_timeout=None, tp_plan={})
    try:
        with (mock.patch.object(cache_module, "get_device_and_memory_breakdown", lambda: breakdown),
              mock.patch.object(handler, "_check_footprint", check)):
            built = _call(cache_module.PagedAttentionCache, config=text, continuous_batching_config=resolved,
                          device="meta", distributed_helper=helper, tp_plan={}, dtype=dtype,
                          model_supports_logits_to_keep=_keeps_logits(text))
    except (MemoryError, ValueError) as e:
        if "footprint" not in seen:
            raise
        return Admission(False, seen["footprint"], seen["available"], None, None, attention, str(e))
    return Admission(True, seen["footprint"], seen["available"], int(built.num_blocks), seen["max_batch_tokens"],
                     attention, None)


def _call(fn, **kwargs):
    """`fn` with the keyword arguments its signature takes: the engine's internals differ across transformers
    5.17-5.2x by a parameter here and there (tests/test_engine_contract.py pins each)."""
    import inspect

    names = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in names})


def _keeps_logits(config) -> bool:
    """Whether the model class of `config` slices hidden states before its LM head (`logits_to_keep`), as the engine
    asks the loaded model (`_supports_logits_to_keep`): it changes what the engine reserves for logits."""
    import inspect

    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return False
    # transformers annotates every lazy auto mapping's value as the tokenizer mapping's (slow, fast) pair; a model
    # mapping's value is the model class.
    return "logits_to_keep" in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
