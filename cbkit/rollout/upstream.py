"""transformers' CB engine beyond its public API: every private name cbkit reaches lives in this module, and only here.

`cbkit.rollout.engine` drives the engine through the public API (`init_continuous_batching`,
`continuous_batching_context_manager`, the manager's `add_request(s)`, `get_result`, `pause`, `is_running`, `stop`,
`destroy`, `GenerationOutput`'s fields) and calls the functions below where the public API does not do the job:

* `CallerLoop`: the manager runs its loop only in its own thread; on a CPU that thread's OpenMP team, queue hand-offs
  and `pause()` round trips cost more than the steps (lab/small_n.md), so cbkit runs the same loop body in the caller's.
* `attach`, `forget_cached_kv`, `reseed`, `prefix_sharing`, `resolved_config`: a kept manager sits on the model under
  a private name, holds a prefix cache no public call empties, seeds itself only when built, and reports its resolved
  pool only on its cache; `supports_flash`: whether a model class runs flash-attn is a private class attribute.
* `scheduled`, `watch_batches`, `forward_stream`: no public call says what a step scheduled, nor on which stream it
  runs (notebook 01's engine trace, the async engine's token versions and weight copies).
* `workload_hints`, `engine_footprint`: the engine's hints type and its memory check live in its private modules.

Pinned, each by tests/test_engine_contract.py against the installed transformers (an upgrade that renames one fails
there, naming it; `PINNED` is read from this list, and no other cbkit module may reach one):
  model:     `model._cached_continuous_batching_manager` `model._supports_flash_attn`
  manager:   `manager._create_batch_processor` `manager._generation_step` `manager._original_attn_impl`
             `manager._use_prefix_sharing` `manager.batch_processor` `manager.background_thread_status`
             `manager.input_queue` `manager.output_router` `manager.warmed_up` `manager.distributed_helper`
             `manager.is_tp_driver` `manager.continuous_batching_config` `manager.model`
             `status.clear` `status.mark_as_stopped` `router.output_queue` `helper.set_tp_seed` `helper.cpu_comm_group`
  processor: `processor.prepare_next_batch` `processor.update_batch` `processor.cache` `processor.inputs_and_outputs`
             `cache.reset` `cache.num_blocks` `cache.max_batch_tokens` `cache.cache_allocators`
             `allocator.block_table` `allocator.tokens_per_page` `io.requests_in_batch` `io.compute_stream`
             `future.query_length` `future.state` `state.request_id` `state.position_offset` `state.initial_tokens`
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
import queue
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple
from unittest import mock

import torch

PINNED = tuple(re.findall(r"`(\w+\.[\w.]+)`", (__doc__ or "Pinned,").split("Pinned,")[1]))
CACHED_MANAGER = "_cached_continuous_batching_manager"  # where transformers keeps a persistent manager on the model


def workload_hints(rows: Sequence[Sequence[int]], max_new_tokens: int):
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return WorkloadHints(max_prompt_length=max(len(r) for r in rows), max_generated_length=max_new_tokens,
                         num_requests=len(rows))


# --- a kept manager -----------------------------------------------------------------------------------------------


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
    """Drop every KV block a kept manager holds, prefix cache included, before a call that may see new weights: the
    prefix cache's hashes cover token ids, not weights (docs/design.md, "A kept engine"). `cache.reset()` is the
    engine's own call for an empty pool, the one it makes after its warm-up."""
    cache = getattr(manager.batch_processor, "cache", None)
    if cache is not None:
        cache.reset()


def reseed(manager, seed: int | None) -> None:
    """Seed the sampler for this call, as a fresh manager seeds itself when its batch processor is built: a kept one
    would otherwise ignore every later call's seed, and a resumed run would not draw what the uninterrupted one did."""
    if seed is not None:
        manager.continuous_batching_config.seed = seed  # what `resolved_config` reports
        manager.distributed_helper.set_tp_seed(seed, manager.model.device)


def resolved_config(manager) -> dict[str, Any]:
    """The engine's settings after it resolved its automatic values: what actually ran."""
    cfg = manager.continuous_batching_config
    keys = ("page_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
            "use_cuda_graph", "use_async_batching", "scheduler_type", "seed", "allow_block_sharing")
    out = {k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None}
    cache = getattr(manager.batch_processor, "cache", None)
    for k in ("num_blocks", "max_batch_tokens"):
        if isinstance(v := getattr(cache, k, None), int):
            out[k] = v
    out["attn_implementation"] = manager.model.config._attn_implementation
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


# --- the loop in the caller's thread ------------------------------------------------------------------------------


class CallerLoop:
    """The manager's loop body (`_generation_loop_body`), run in the caller's thread: one engine step per iteration
    until the asked-for requests are done. Same scheduler, cache, sampler, seeds and prefix sharing as the thread;
    a failing step raises in the caller."""

    def __init__(self, model, persistent: bool, **engine_kwargs: Any) -> None:
        self.model, self.persistent, self.engine_kwargs = model, persistent, engine_kwargs
        self.manager: Any = None
        self.processor: Any = None

    def __enter__(self) -> CallerLoop:
        with torch.no_grad():
            self.manager = manager = self.model.init_continuous_batching(**self.engine_kwargs)
        try:
            if manager.continuous_batching_config.use_async_batching:
                raise ValueError("engine_loop='caller' cannot drive async batching (it overlaps two batches across "
                                 "the loop's iterations); use engine_loop='thread' (or 'auto').")
            if not manager.is_tp_driver or manager.distributed_helper.cpu_comm_group is not None:
                raise ValueError("engine_loop='caller' cannot drive tensor parallelism (every rank's loop takes part "
                                 "in collectives); use engine_loop='thread' (or 'auto').")
            if not manager.warmed_up:
                manager.warmup()
            # What start() and the head of the thread's loop do: clear the stop status, build (or reset) the batch
            # processor. Anything an earlier, failed call left queued is dropped, not run as part of this one.
            manager.background_thread_status.clear()
            for q in (manager.input_queue, manager.output_router.output_queue):
                with contextlib.suppress(queue.Empty):
                    while True:
                        q.get_nowait()
            self.processor = manager.batch_processor = manager._create_batch_processor()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """What `manager.stop()` does once its thread has joined, minus its full `gc.collect()` (a dropped processor's
        `__del__` runs one already), and what the context manager does after it for a manager not kept."""
        manager = self.manager
        manager.background_thread_status.mark_as_stopped()
        if self.persistent:
            attach(self.model, manager)
        else:
            manager.batch_processor = None
        if manager._original_attn_impl is not None:
            self.model.set_attn_implementation(manager._original_attn_impl)
            manager._original_attn_impl = None
        self.processor = None  # the last reference: the processor's __del__ frees the pool
        if not self.persistent:
            manager.destroy()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield  # nothing runs between two steps of this thread's own loop

    def collect(self, ids: list[str]) -> dict[str, Any]:
        """Step the engine until every request in `ids` has finished; a failed request or a failing step raises."""
        manager, processor = self.manager, self.processor
        outputs = manager.output_router.output_queue
        results: dict[str, Any] = {}
        with torch.no_grad():
            while True:
                while not outputs.empty():
                    finished(outputs.get_nowait(), results)
                if all(i in results for i in ids):
                    return results
                if not processor.prepare_next_batch():
                    missing = [i for i in ids if i not in results]
                    raise RuntimeError(f"The CB engine has no work left but {len(missing)} of {len(ids)} requests "
                                       f"never finished (first: {missing[0]}); see the log above.")
                manager._generation_step()
                processor.update_batch()


def finished(out, results: dict[str, Any]) -> None:
    """Keep `out` in `results` when its request finished; a failed request raises."""
    if out.is_finished():
        if out.error is not None:
            raise RuntimeError(f"The CB engine failed request {out.request_id}: {out.error}")
        results[out.request_id] = out


# --- what a step scheduled ----------------------------------------------------------------------------------------


class Scheduled(NamedTuple):
    """One request's part of the batch the engine is about to run."""

    request_id: str
    prompt: tuple[int, ...]
    past_len: int  # tokens already in its KV cache before this step
    query_len: int  # tokens this step computes for it: a prefill chunk, or 1 when decoding
    blocks: tuple[int, ...]  # its block table (full attention), when asked for


def scheduled(processor, blocks: bool = True) -> list[Scheduled]:
    """The requests of the batch `processor` (a manager's, or None) has just prepared, in the order it packed them."""
    if processor is None:
        return []
    allocator = next(iter(processor.cache.cache_allocators.values())) if blocks else None
    out = []
    for future in list(processor.inputs_and_outputs.requests_in_batch or ()):
        state, query = future.state, int(future.query_length)
        table = allocator.block_table.get(state.request_id, ()) if allocator is not None else ()
        out.append(Scheduled(str(state.request_id), tuple(state.initial_tokens),
                             int(state.position_offset) - query,  # prepare_next_batch has already advanced it
                             query, tuple(int(b) for b in table)))
    return out


def processor_of(manager) -> Any:
    return getattr(manager, "batch_processor", None)


def forward_stream(manager) -> torch.cuda.Stream | None:
    """The CUDA stream `manager`'s forwards run on, or None (on CPU; or no manager, or none built its processor yet).
    transformers enqueues each engine forward on a stream of its own, so whoever writes the weights the engine reads
    orders the write against this stream (`AsyncEngine.publish`); a Python lock orders only the enqueueing."""
    processor = processor_of(manager)
    return processor.inputs_and_outputs.compute_stream if processor is not None else None


@contextlib.contextmanager
def watch_batches(callback: Callable[[list[Scheduled], int, int], None]) -> Iterator[None]:
    """Call `callback(requests, pool_blocks, page_size)` for every batch any CB engine schedules inside the block, in
    whatever thread the engine runs; the engine's method is put back after."""
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


# --- the engine's memory check, on any machine --------------------------------------------------------------------


class Footprint(NamedTuple):
    footprint: int  # what the engine reserves: the pool, its per-token buffers, the attention mask, ...
    available: int  # max_memory_percent x (total - max(allocated, reserved)): what it checks against
    num_blocks: int | None  # None where it refuses
    max_batch_tokens: int | None
    error: str | None  # the engine's own message where it refuses
    cache_bytes: int = 0  # the cache tensor it allocates
    mask_bytes: int = 0  # its dense attention masks


def engine_footprint(config, cb_config, *, attention: str, dtype: torch.dtype, hints, total_bytes: int,
                     used_bytes: int, device: str = "cuda") -> Footprint:
    """transformers' own verdict on starting a CB engine for a model of `config` on a `device` of `total_bytes` with
    `used_bytes` taken: the engine's config resolution, then its `PagedAttentionCache` built on the meta device (no
    memory touched) with its memory reading returning that device's numbers."""
    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching import initialization
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    text = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    text._attn_implementation = attention
    where = torch.device(device)
    # On a GPU the resolution asks whether CUDA is there and, with flash attention, whether flash-attn's block-table
    # kernel imports (its decode path): answered as on that GPU.
    flash_kernel = ((None, None, lambda *a, **k: None, None, None), (None, None))
    gpu = device == "cuda"
    with (mock.patch("torch.cuda.is_available", return_value=True) if gpu else contextlib.nullcontext(),
          mock.patch.object(initialization, "lazy_import_flash_attention", lambda *a, **k: flash_kernel)
          if gpu else contextlib.nullcontext()):
        resolved = initialization.resolve_continuous_batching_config(
            config=text, cb_config=cb_config, workload_hints=hints, has_logit_processors=True, device=where)
    seen: dict[str, int] = {}
    handler = cache_module.PagedAttentionMemoryHandler
    original_check = handler._check_footprint

    def check(self, max_batch_tokens: int, num_blocks: int):
        seen.update(footprint=int(self.compute_memory_footprint(max_batch_tokens, num_blocks)),
                    available=int(self.available_memory), max_batch_tokens=int(max_batch_tokens),
                    mask=int(self.attention_mask_bytes(max_batch_tokens, num_blocks)))
        return original_check(self, max_batch_tokens, num_blocks)

    breakdown = (where, int(total_bytes), int(used_bytes), int(used_bytes))
    try:
        with (mock.patch.object(cache_module, "get_device_and_memory_breakdown", lambda: breakdown),
              mock.patch.object(handler, "_check_footprint", check)):
            built = cache_module.PagedAttentionCache(
                config=text, continuous_batching_config=resolved, device="meta", dtype=dtype,
                distributed_helper=DistributedHelper(device_mesh=None, cpu_group_timeout=None, tp_plan={}),
                model_supports_logits_to_keep=_keeps_logits(text))
    except (MemoryError, ValueError) as e:
        if "footprint" not in seen:
            raise
        return Footprint(seen["footprint"], seen["available"], None, None, str(e))
    return Footprint(seen["footprint"], seen["available"], int(built.num_blocks), seen["max_batch_tokens"], None,
                     int(built.cache_tensor.numel()), seen["mask"])


def _keeps_logits(config) -> bool:
    """Whether the model class of `config` slices hidden states before its LM head (`logits_to_keep`), as the engine
    asks the loaded model (`_supports_logits_to_keep`): it changes what the engine reserves for logits."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return cls is not None and "logits_to_keep" in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
