"""transformers' CB engine beyond its public API: every private name cbkit reaches lives here, and only here, to
keep a manager between calls, report what a step scheduled and on which stream, and run the memory check anywhere.

Pinned, each by tests/test_engine_contract.py against the installed transformers (an upgrade that renames one fails
there, naming it; `PINNED` is read from this list, and no other cbkit module may reach one):
  model:     `model._cached_continuous_batching_manager` `model._supports_flash_attn`
  manager:   `manager._use_prefix_sharing` `manager.batch_processor` `manager.distributed_helper` `manager.model`
             `manager.continuous_batching_config` `helper.set_tp_seed`
  processor: `processor.prepare_next_batch` `processor.cache` `processor.inputs_and_outputs` `cache.reset`
             `cache.num_blocks` `cache.cache_allocators` `allocator.block_table` `allocator.tokens_per_page`
             `io.requests_in_batch` `io.compute_stream` `future.query_length` `future.state` `state.request_id`
             `state.position_offset` `state.initial_tokens`
  modules:   `cb.utils.WorkloadHints` `cb.continuous_api.ContinuousBatchProcessor` `cb.cache.PagedAttentionCache`
             `cb.cache.PagedAttentionMemoryHandler` `cb.cache.get_device_and_memory_breakdown`
             `cb.initialization.resolve_continuous_batching_config` `cb.initialization.lazy_import_flash_attention`
             `cb.distributed.DistributedHelper` `handler._check_footprint` `handler.compute_memory_footprint`
             `handler.available_memory` `handler.attention_mask_bytes` `cache.cache_tensor`
             `transformers.AutoModelForCausalLM._model_mapping`
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

PINNED = tuple(re.findall(r"`(\w+\.[\w.]+)`", (__doc__ or "Pinned,").split("Pinned,")[1]))
CACHED_MANAGER = "_cached_continuous_batching_manager"  # where transformers keeps a persistent manager on the model
# cbkit's own requests (the first prefill of a shared prompt, `Engine.run`), not completions.
HELPER_PREFIX = "cbkit-prefill-"


def workload_hints(rows: Sequence[Sequence[int]], max_new_tokens: int):
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return WorkloadHints(max_prompt_length=max(len(r) for r in rows), max_generated_length=max_new_tokens,
                         num_requests=len(rows))


def attached(model) -> Any:
    return getattr(model, CACHED_MANAGER, None)


def attach(model, manager) -> None:
    """Make `manager` (or none) the one `init_continuous_batching` hands out next."""
    if manager is not None:
        setattr(model, CACHED_MANAGER, manager)
    elif hasattr(model, CACHED_MANAGER):
        delattr(model, CACHED_MANAGER)


def supports_flash(model) -> bool:
    """Whether the model's class runs flash attention at all (transformers asks the same before it switches)."""
    return bool(getattr(model, "_supports_flash_attn", False))


def prefix_sharing(manager) -> bool:
    return bool(manager._use_prefix_sharing)


def forget_cached_kv(manager) -> None:
    """Empty a kept manager's pool and prefix cache (its hashes cover token ids, not weights)."""
    cache = getattr(manager.batch_processor, "cache", None)
    if cache is not None:
        cache.reset()


def reseed(manager, seed: int | None) -> None:
    """Seed the sampler for this call: a kept manager would ignore later seeds."""
    if seed is not None:
        manager.continuous_batching_config.seed = seed  # what `resolved_config` reports
        manager.distributed_helper.set_tp_seed(seed, manager.model.device)


def resolved_config(manager) -> dict[str, Any]:
    """The engine's settings after it resolved its automatic values: what actually ran."""
    cfg = manager.continuous_batching_config
    keys = ("page_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
            "use_cuda_graph", "use_async_batching", "scheduler_type", "seed", "allow_block_sharing")
    out = {k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None}  # the cache's sizes, once built
    out["attn_implementation"] = manager.model.config._attn_implementation
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of one engine step."""

    request_id: str
    prompt_len: int
    prompt_hash: int  # the same for the N requests of one prompt
    past_len: int  # tokens already in its KV cache before this step
    query_len: int  # tokens this step computes for it: a prefill chunk, or 1 when decoding
    blocks: tuple[int, ...]  # its block table (full attention), when asked for

    @property
    def phase(self) -> str:
        return "prefill" if self.past_len < self.prompt_len else "decode"

    @property
    def helper(self) -> bool:
        return self.request_id.startswith(HELPER_PREFIX)


def scheduled(processor, blocks: bool = True) -> list[ScheduledRequest]:
    """The requests of the batch `processor` (a manager's, or None) has just prepared, in the order it packed them."""
    if processor is None:
        return []
    allocator = next(iter(processor.cache.cache_allocators.values())) if blocks else None
    out = []
    for future in list(processor.inputs_and_outputs.requests_in_batch or ()):
        state, query = future.state, int(future.query_length)
        prompt = tuple(state.initial_tokens)
        table = allocator.block_table.get(state.request_id, ()) if allocator is not None else ()
        out.append(ScheduledRequest(str(state.request_id), len(prompt), hash(prompt),
                                    int(state.position_offset) - query,  # prepare_next_batch has advanced it
                                    query, tuple(int(b) for b in table)))
    return out


def processor_of(manager) -> Any:
    return getattr(manager, "batch_processor", None)


def forward_stream(manager) -> torch.cuda.Stream | None:
    """The CUDA stream `manager`'s forwards run on (None on CPU or before it built one)."""
    processor = processor_of(manager)
    return processor.inputs_and_outputs.compute_stream if processor is not None else None


@contextlib.contextmanager
def watch_batches(callback: Callable[[list[ScheduledRequest], int, int], None]) -> Iterator[None]:
    """Call `callback(requests, pool_blocks, page_size)` for every batch any CB engine schedules inside the block."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    lock = threading.Lock()
    original = ContinuousBatchProcessor.prepare_next_batch

    def prepare_next_batch(self, *args, **kwargs):
        ready = original(self, *args, **kwargs)
        if ready:
            with lock:
                page = int(next(iter(self.cache.cache_allocators.values())).tokens_per_page)
                callback(scheduled(self), int(self.cache.num_blocks), page)
        return ready

    ContinuousBatchProcessor.prepare_next_batch = prepare_next_batch  # type: ignore[method-assign]
    try:
        yield
    finally:
        ContinuousBatchProcessor.prepare_next_batch = original  # type: ignore[method-assign]


def engine_footprint(config, cb_config, *, attention: str, dtype: torch.dtype, hints, total_bytes: int,
                     used_bytes: int, device: str = "cuda") -> dict[str, Any]:
    """transformers' own verdict on starting a CB engine on a `device` of `total_bytes` with `used_bytes` taken: its
    config resolution, then its cache built on the meta device, reading that device's memory."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching import initialization
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    text = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    text._attn_implementation = attention
    where = torch.device(device)
    # On a GPU the resolution asks for CUDA and flash-attn's block-table kernel: answered as on that GPU.
    flash_kernel = ((None, None, lambda *a, **k: None, None, None), (None, None))
    gpu = device == "cuda"
    with (mock.patch("torch.cuda.is_available", return_value=True) if gpu else contextlib.nullcontext(),
          mock.patch.object(initialization, "lazy_import_flash_attention", lambda *a, **k: flash_kernel)
          if gpu else contextlib.nullcontext()):
        resolved = initialization.resolve_continuous_batching_config(
            config=text, cb_config=cb_config, workload_hints=hints, has_logit_processors=True, device=where)
    seen: dict[str, Any] = {}
    handler = cache_module.PagedAttentionMemoryHandler
    original_check = handler._check_footprint

    def check(self, max_batch_tokens: int, num_blocks: int):
        seen.update(footprint=int(self.compute_memory_footprint(max_batch_tokens, num_blocks)),
                    available=int(self.available_memory), max_batch_tokens=int(max_batch_tokens),
                    mask=int(self.attention_mask_bytes(max_batch_tokens, num_blocks)))
        return original_check(self, max_batch_tokens, num_blocks)

    breakdown = (where, int(total_bytes), int(used_bytes), int(used_bytes))
    model_class: Any = AutoModelForCausalLM._model_mapping.get(type(text), None)  # the engine sizes its logits by it
    keeps_logits = model_class is not None and "logits_to_keep" in inspect.signature(model_class.forward).parameters
    try:
        with (mock.patch.object(cache_module, "get_device_and_memory_breakdown", lambda: breakdown),
              mock.patch.object(handler, "_check_footprint", check)):
            built = cache_module.PagedAttentionCache(
                config=text, continuous_batching_config=resolved, device="meta", dtype=dtype,
                distributed_helper=DistributedHelper(device_mesh=None, cpu_group_timeout=None, tp_plan={}),
                model_supports_logits_to_keep=keeps_logits)
    except (MemoryError, ValueError) as e:
        if "footprint" not in seen:
            raise
        return {**seen, "num_blocks": None, "max_batch_tokens": None, "cache_bytes": 0, "mask": 0, "error": str(e)}
    return {**seen, "num_blocks": int(built.num_blocks), "cache_bytes": int(built.cache_tensor.numel()), "error": None}
