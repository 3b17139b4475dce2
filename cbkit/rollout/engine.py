"""The engine: one class owns transformers' continuous batching manager, and only this module reaches inside it.

Every CB caller in cbkit goes through `Engine`: `ContinuousBackend` (a manager per rollout, or one kept between
rollouts), `AsyncEngine` (one kept running on a weight snapshot while the trainer trains) and the TRL bridge
(`cbkit.trl.trainers`). `Engine` owns

* the config: `make_cb_config` (`engine_config.py`: cbkit's defaults, the CPU pool rule) and the attention, cbkit's
  CPU varlen attention (`cpu_attention.py`) unless the model needs the engine's own;
* the manager's life: built for a call and destroyed after it, or kept (`persistent`), attached to the model only
  for its own calls (`_own`), its KV emptied before every call, since the weights may have changed since
  (`forget_cached_kv`), and reseeded every call;
* who runs the loop: transformers' background thread (`_ThreadLoop`) or the caller's thread (`_CallerLoop`);
* collecting (a failed request raises, where transformers' `generate_batch` logs it and returns fewer results),
  turning outputs into `Completion`s, and the timeline;
* what each step scheduled (`scheduled`, `watch_batches`), read by `engine_trace.py` and the async engine.

transformers internals relied on, pinned by tests/test_engine_contract.py against the installed version:
  model:     `_cached_continuous_batching_manager` (where a kept manager lives), `init_continuous_batching`,
             `continuous_batching_context_manager`, `set_attn_implementation`, `config._attn_implementation`
  manager:   `_create_batch_processor`, `_generation_step`, `_original_attn_impl`, `_use_prefix_sharing`,
             `batch_processor`, `background_thread_status` (`clear`, `mark_as_stopped`), `input_queue`,
             `output_router.output_queue`, `current_batch`, `warmed_up`, `warmup`, `distributed_helper`
             (`set_tp_seed`, `cpu_comm_group`), `is_tp_driver`, `continuous_batching_config`, `pause`,
             `add_request(s)`, `get_result`, `is_running`, `start`, `stop`, `destroy`
  processor: `ContinuousBatchProcessor.prepare_next_batch`, `update_batch`, `cache` (`reset`, `num_blocks`,
             `cache_allocators[...]` `.block_table`, `.tokens_per_page`), `inputs_and_outputs.requests_in_batch`
             (`future.query_length`, `future.state` `.request_id`, `.position_offset`, `.initial_tokens`),
             `inputs_and_outputs.compute_stream` (`compute_stream`)
  outputs:   `GenerationOutput` `.generated_tokens`, `.logprobs`, `.error`, `.lifespan`, `.timestamps`,
             `.is_finished()`, `.request_id`
  module:    `transformers.generation.continuous_batching.utils.WorkloadHints`
  admission: `initialization.resolve_continuous_batching_config` (`.lazy_import_flash_attention`),
             `cache.PagedAttentionCache` (`num_blocks`),
             `cache.get_device_and_memory_breakdown`, `PagedAttentionMemoryHandler._check_footprint`,
             `.compute_memory_footprint`, `.available_memory`, `distributed.DistributedHelper`
  attention: `ContinuousBatchingConfig.auto_switch_to_flash` (5.2x; 5.17 keeps an attention already "paged|...")
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from cbkit.rollout.base import Completion, SamplingParams, cut_completion
from cbkit.rollout.cpu_attention import CPU_ATTENTION, varlen_attention_for_engine, varlen_unsupported_reason
from cbkit.rollout.engine_config import cuda_attention, make_cb_config, page_size, resolve_engine_loop

_CACHED = "_cached_continuous_batching_manager"  # where transformers keeps a persistent manager on the model


class Engine:
    """One CB manager on one model: configured, attached, driven and read here (see the module docstring).

    `run` is one rollout's worth of requests, start to finish; `start` / `submit` / `take` / `stop` keep the
    manager running on transformers' thread between calls (the async engine)."""

    def __init__(self, model, cb_config: Mapping[str, Any] | None = None, *, persistent: bool = False,
                 cpu_attention: str = "batched", engine_loop: str = "auto", record_timestamps: bool = False) -> None:
        # On CPU, run the engine with cbkit's varlen attention instead of its dense block-diagonal mask, whose
        # cost grows with the square of the batch (cpu_attention.py says why).
        if cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION)}; got {cpu_attention!r}.")
        resolve_engine_loop(engine_loop, torch.device("cpu"), cb_config)  # checked now, resolved per call
        self.model, self.overrides = model, dict(cb_config or {})
        make_cb_config(self.overrides)  # fail at construction, not at the first rollout
        self.persistent, self.cpu_attention, self.engine_loop = persistent, cpu_attention, engine_loop
        self.record_timestamps = record_timestamps
        # transformers keeps one manager per model and hands it to whoever asks next; this engine attaches only its
        # own kept one, for the length of its own calls (`_own`).
        self._kept: Any = None
        self._key: tuple | None = None  # the sampling settings and config the kept manager was built with
        self._loop: _ThreadLoop | None = None  # the manager kept running by `start`
        self._stack: contextlib.ExitStack | None = None
        self._warned_varlen = False  # the note that this model needs the engine's own attention, once
        self._warned_pool = False  # make_cb_config's CPU pool warning, once per engine rather than per call

    @property
    def manager(self) -> Any:
        return self._loop.manager if self._loop is not None else self._kept

    # --- config and attention ---------------------------------------------------------------------------------

    def config(self, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None):
        """This call's `ContinuousBatchingConfig`: the CPU pool sized to `rows` at `max_new_tokens`."""
        cb = make_cb_config(self.overrides, seed=seed, device=self.model.device, rows=rows,
                            max_new_tokens=max_new_tokens, warn=not self._warned_pool)
        self._warned_pool = True
        return cb

    def _attention(self, cb_config) -> contextlib.AbstractContextManager:
        """The attention of the engine's run, the model's own restored after: on a GPU the one `cuda_attention`
        chooses; on CPU cbkit's varlen attention (or the engine's own)."""
        _refuse_softcap_on_cpu(self.model)
        if self.model.device.type == "cuda":
            flash_ok = bool(getattr(self.model, "_supports_flash_attn", False))
            return attention_for_engine(self.model, cuda_attention(self.model.dtype, flash=None if flash_ok else ()))
        if self.cpu_attention == "engine" or self.model.device.type != "cpu":
            return contextlib.nullcontext()
        unsupported = varlen_unsupported_reason(self.model)
        if unsupported:
            if not self._warned_varlen:
                warnings.warn(f"cbkit's CPU varlen attention has no {unsupported}: the CB engine runs with the "
                              "model's own attention instead (slower on CPU, same results).", UserWarning, stacklevel=4)
                self._warned_varlen = True
            return contextlib.nullcontext()
        if "max_blocks_per_request" not in self.overrides:
            cb_config.max_blocks_per_request = 0  # the block-table fast path calls a real flash-attn kernel
        return varlen_attention_for_engine(self.model, self.cpu_attention)

    # --- one rollout ------------------------------------------------------------------------------------------

    def run(self, rows: list[list[int]], gen_config, *, max_new_tokens: int, seed: int | None = None,
            targets: list[int] | None = None) -> tuple[list[Any], dict[str, Any]]:
        """Submit every row, collect every result; the outputs in row order and the config that ran.

        With ``targets`` each request gets its own max_new_tokens and EOS id -1, which the engine's RequestState
        drops (negative ids never match), so a request finishes exactly at its target and frees its blocks then."""
        cb_config = self.config(rows, max_new_tokens, seed)
        if self.persistent:  # a kept manager keeps its sampling settings and seed: rebuild it when they change
            key = (repr(gen_config.to_dict()), repr(sorted(self.overrides.items())))
            if self._key is not None and key != self._key:
                self.close()
            self._key = key
        attention = self._attention(cb_config)
        if self._kept is not None:
            forget_cached_kv(self._kept)
        loop = resolve_engine_loop(self.engine_loop, self.model.device, self.overrides)
        driver = (_CallerLoop if loop == "caller" else _ThreadLoop)(
            self.model, self.persistent, generation_config=gen_config, continuous_batching_config=cb_config,
            workload_hints=workload_hints(rows, max(targets) if targets else max_new_tokens))
        with attention, self._own(), driver:
            if getattr(driver.manager, "_use_prefix_sharing", False):
                # The engine shares a prompt's complete KV pages between requests, but only pages a finished forward
                # has written: N copies of a prompt admitted in one step all compute it. So each repeated prompt is
                # prefilled first, alone (two tokens, thrown away: the engine registers the pages of a request
                # still running after the forward, `mark_complete_blocks`), and its N completions find its pages.
                with driver.paused():
                    _reseed(driver.manager, seed)
                    prefill = [driver.manager.add_request(list(p), max_new_tokens=2, eos_token_id=-1)
                               for p in _shared_prompts(rows, page_size(cb_config))]
                driver.collect(prefill)
                seed = None  # seeded once per call, before its first request
            with driver.paused():  # all queued while the loop is parked: one drain, so a seeded order of draws
                ids = self.submit(driver, rows, max_new_tokens, seed, targets=targets)
            results = driver.collect(ids)
            resolved = resolved_config(driver.manager)
        return [results[i] for i in ids], resolved

    def submit(self, driver, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None,
               targets: Sequence[int] | None = None) -> list[str]:
        """Reseed the sampler, then queue `rows`; ids in row order. Call it with the loop paused."""
        manager = driver.manager
        _reseed(manager, seed)
        if targets is None:
            return list(manager.add_requests(inputs=[list(r) for r in rows], max_new_tokens=max_new_tokens,
                                             record_timestamps=self.record_timestamps))
        # `add_requests`' order (sorted by prompt when prefix sharing is on: cache hits), one limit per request.
        order = list(range(len(rows)))
        if getattr(manager, "_use_prefix_sharing", False):
            order.sort(key=lambda i: list(rows[i]), reverse=True)
        ids = [""] * len(rows)
        for i in order:
            rid = manager.add_request(list(rows[i]), max_new_tokens=int(targets[i]), eos_token_id=-1,
                                      record_timestamps=self.record_timestamps)
            if rid is None:
                raise RuntimeError(f"The CB engine refused request {i} (not accepting requests); see the log above.")
            ids[i] = rid
        return ids

    @contextlib.contextmanager
    def _own(self) -> Iterator[None]:
        """Attach exactly this engine's kept manager (or none) to the model for one call, then restore what was there.

        `init_continuous_batching` returns whatever manager is cached on the model, whoever built it: without this, a
        call that keeps nothing would run on another engine's kept manager (its config, its cache) and destroy it.
        On exit, even a failed one, the manager the call left attached is the one to keep, when persistent."""
        previous, mine = getattr(self.model, _CACHED, None), self._kept
        _attach(self.model, mine)
        try:
            yield
        finally:
            kept = getattr(self.model, _CACHED, None)
            self._kept = kept if self.persistent else None
            # Our own kept manager stays attached (engine_is_idle and close() look there); someone else's comes back.
            _attach(self.model, kept if previous is None or previous is mine else previous)

    def close(self) -> None:
        """Stop a running manager and free this engine's kept one (KV pool, buffers); another engine's is left."""
        if self._stack is not None:
            self._stack.close()
        self._stack = self._loop = None
        if self._kept is not None:
            if getattr(self.model, _CACHED, None) is self._kept:
                delattr(self.model, _CACHED)
            self._kept.destroy()
            self._kept = None
        self._key = None

    # --- kept running on transformers' thread (the async engine) ----------------------------------------------

    def start(self, gen_config, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None) -> None:
        """Build a manager whose pool fits `rows` at `max_new_tokens`, and start its thread; it runs until `close`."""
        self.close()
        cb_config = self.config(rows, max_new_tokens, seed)
        stack = contextlib.ExitStack()
        stack.enter_context(self._attention(cb_config))
        self._loop = stack.enter_context(_ThreadLoop(
            self.model, False, warmup=False, generation_config=gen_config, continuous_batching_config=cb_config,
            workload_hints=workload_hints(rows, max_new_tokens)))
        self._stack = stack
        weakref.finalize(self, stack.close)  # the engine thread is not a daemon: never leave it running at exit

    def paused(self) -> contextlib.AbstractContextManager:
        return self._loop.paused()

    def queue(self, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None,
              targets: Sequence[int] | None = None) -> list[str]:
        """`submit` to the running manager (hold `paused()` around it for a seeded order of draws); ``targets``
        as in `run`."""
        return self.submit(self._loop, rows, max_new_tokens, seed, targets=targets)

    def take(self, results: dict[str, Any], timeout: float, expected: int) -> None:
        """Wait up to `timeout` s for one result of the running manager; a finished one goes into `results`."""
        self._loop.take(results, timeout, expected)

    def scheduled(self) -> list[Scheduled]:
        """The requests of the batch the running manager is about to run (see `scheduled`)."""
        processor = getattr(self.manager, "batch_processor", None)
        return scheduled(processor, blocks=False) if processor is not None else []


# --- who runs the loop ----------------------------------------------------------------------------------------


class _ThreadLoop:
    """transformers' own driver: the loop in a background thread, results read from its output queue."""

    def __init__(self, model, persistent: bool, *, warmup: bool = True, **engine_kwargs: Any) -> None:
        self._context = model.continuous_batching_context_manager(
            block=True, timeout=5, persistent_manager=persistent, warmup=warmup, **engine_kwargs)
        self.manager: Any = None

    def __enter__(self) -> _ThreadLoop:
        self.manager = self._context.__enter__()
        return self

    def __exit__(self, *exc) -> bool | None:
        return self._context.__exit__(*exc)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Park the running loop while requests are queued, so it takes them in one drain: how they are grouped into
        batches, and so the order random numbers are drawn in, does not depend on thread timing."""
        pause = getattr(self.manager, "pause", None)  # transformers >= 5.2x; older engines take requests as they come
        with pause() if pause is not None else contextlib.nullcontext():
            yield

    def take(self, results: dict[str, Any], timeout: float, expected: int) -> None:
        out = self.manager.get_result(timeout=timeout)
        if out is None:
            if not self.manager.is_running():
                raise RuntimeError(f"The CB engine stopped after {len(results)} of {expected} requests; see the log "
                                   "above.")
        elif out.is_finished():
            _check(out)
            results[out.request_id] = out

    def collect(self, ids: list[str]) -> dict[str, Any]:
        """Wait for every request in `ids` to finish; raise on a failed one or a stopped engine."""
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            self.take(results, 1.0, len(ids))
        return results


class _CallerLoop:
    """The manager's loop body, run in the caller's thread: one engine step per iteration until the asked-for
    requests are done. Same scheduler, cache, sampler, seeds and prefix sharing as the thread, without the thread's
    OpenMP team, queue hand-offs and `pause()` round trips (docs/small_n.md has what that is worth on a CPU).
    A failing step raises in the caller."""

    def __init__(self, model, persistent: bool, **engine_kwargs: Any) -> None:
        self.model, self.persistent, self.engine_kwargs = model, persistent, engine_kwargs
        self.manager: Any = None
        self.processor: Any = None

    def __enter__(self) -> _CallerLoop:
        with torch.no_grad():
            self.manager = manager = self.model.init_continuous_batching(**self.engine_kwargs)
        try:
            reason = caller_loop_unsupported_reason(manager)
            if reason is not None:
                raise ValueError(f"engine_loop='caller' cannot drive an engine with {reason}; use "
                                 "engine_loop='thread' (or 'auto').")
            if not manager.warmed_up:
                manager.warmup()
            # What start() and the head of the thread's loop do: clear the stop status, build (or reset) the batch
            # processor. Anything an earlier, failed call left queued is dropped, not run as part of this one.
            manager.background_thread_status.clear()
            _drain(manager.input_queue)
            _drain(manager.output_router.output_queue)
            self.processor = manager._create_batch_processor()
            manager.batch_processor = self.processor
            manager.current_batch = 0
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """What `manager.stop()` does once its thread has joined, minus its full `gc.collect()` (a dropped
        processor's `__del__` runs one already), and what the context manager does after it for a manager not kept."""
        manager = self.manager
        manager.background_thread_status.mark_as_stopped()
        if self.persistent:
            setattr(self.model, _CACHED, manager)
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
                    out = outputs.get_nowait()
                    if out.is_finished():
                        _check(out)
                        results[out.request_id] = out
                if all(i in results for i in ids):
                    return results
                if not processor.prepare_next_batch():
                    missing = [i for i in ids if i not in results]
                    raise RuntimeError(f"The CB engine has no work left but {len(missing)} of {len(ids)} requests "
                                       f"never finished (first: {missing[0]}); see the log above.")
                manager._generation_step()
                manager.current_batch += 1
                processor.update_batch()


def caller_loop_unsupported_reason(manager) -> str | None:
    """Why the caller's thread cannot drive this manager's loop the way its thread would, or None."""
    if getattr(manager.continuous_batching_config, "use_async_batching", False):
        return "async batching (it overlaps two batches across the loop's iterations)"
    helper = getattr(manager, "distributed_helper", None)
    if getattr(helper, "cpu_comm_group", None) is not None or not getattr(manager, "is_tp_driver", True):
        return "tensor parallelism (every rank's loop takes part in collectives)"
    return None


def _check(out) -> None:
    if out.error is not None:
        raise RuntimeError(f"The CB engine failed request {out.request_id}: {out.error}")


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


# --- the manager's state --------------------------------------------------------------------------------------


def _attach(model, manager) -> None:
    if manager is not None:
        setattr(model, _CACHED, manager)
    elif hasattr(model, _CACHED):
        delattr(model, _CACHED)


def forget_cached_kv(manager) -> None:
    """Drop every KV block a kept manager holds, prefix cache included, before a call that may see new weights.

    The prefix cache's hashes cover token ids, not weights, so it must not outlive them (docs/design.md, "A kept
    engine"). Sharing inside one call (the N completions of a prompt) is kept; `cache.reset()` is the engine's own
    call for an empty pool, the one it makes after its warm-up.
    """
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if cache is not None:
        cache.reset()


def _reseed(manager, seed: int | None) -> None:
    """Seed the sampler for this call, as a fresh manager seeds itself when its batch processor is built: a kept
    one would otherwise ignore every later call's seed, and a resumed run would not draw what the uninterrupted
    one did."""
    if seed is None:
        return
    manager.continuous_batching_config.seed = seed  # what `resolved_config` reports
    helper = getattr(manager, "distributed_helper", None)
    if hasattr(helper, "set_tp_seed"):
        helper.set_tp_seed(seed, manager.model.device)
    else:
        torch.manual_seed(seed)


def engine_is_idle(model) -> bool:
    """True when no CB engine is running on the model and its attention is its own again, so a plain forward is an
    ordinary causal forward. A kept manager that is stopped counts as idle: stopping restores the attention."""
    manager = getattr(model, _CACHED, None)
    running = manager is not None and manager.is_running()
    return not running and not str(model.config._attn_implementation).startswith("paged")


def workload_hints(rows: Sequence[Sequence[int]], max_new_tokens: int):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:  # older engines size the pool without hints
        return None
    hints = dict(max_prompt_length=max(len(r) for r in rows), max_generated_length=max_new_tokens,
                 num_requests=len(rows))  # num_requests arrived in transformers 5.11
    known = {f.name for f in dataclasses.fields(WorkloadHints)}
    return WorkloadHints(**{k: v for k, v in hints.items() if k in known})


def resolved_config(manager) -> dict[str, Any]:
    """The engine's settings after it resolved its automatic values: what actually ran."""
    cfg = manager.continuous_batching_config
    keys = ("page_size", "block_size", "num_blocks", "max_batch_tokens", "max_memory_percent",
            "max_requests_per_batch", "use_cuda_graph", "use_async_batching", "scheduler_type", "seed",
            "allow_block_sharing")
    out = {k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None}
    cache = getattr(manager.batch_processor, "cache", None)
    for k in ("num_blocks", "page_size", "block_size", "max_batch_tokens"):
        v = getattr(cache, k, None)
        if isinstance(v, int):
            out[k] = v
    out["attn_implementation"] = manager.model.config._attn_implementation
    if "block_size" in out:  # transformers < 5.17 calls a page a "block"; cbkit reports it under one name
        out.setdefault("page_size", out.pop("block_size"))
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


@contextlib.contextmanager
def attention_for_engine(model, implementation: str) -> Iterator[None]:
    """Run the engine with `implementation` ("sdpa" or "flash_attention_N", `cuda_attention`'s choice), the model's
    own attention restored after. transformers 5.2x takes the choice as the model's attention with
    `auto_switch_to_flash=False` (`make_cb_config` sets it); 5.17 has no such switch and turns to flash whenever it
    is importable unless the attention is already a paged one, so there SDPA is given as "paged|sdpa"."""
    from transformers import ContinuousBatchingConfig

    original = model.config._attn_implementation
    switchable = "auto_switch_to_flash" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    target = implementation if switchable or implementation.startswith("flash") else f"paged|{implementation}"
    if target != original:
        model.set_attn_implementation(target)
    try:
        yield
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


def _refuse_softcap_on_cpu(model) -> None:
    """Gemma-2-style attention soft-capping has no CPU path in the engine: say so before sampling wrong tokens.

    On CPU the engine attends with `paged|eager`, which applies sinks but not `softcap`; cbkit's varlen attention
    has none either. Both would sample from another model than the one trained. Flash attention on a GPU applies it.
    """
    cap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    if cap is not None and model.device.type == "cpu":
        raise ValueError(
            f"This model uses attention logit soft-capping (attn_logit_softcapping={cap}), which transformers' "
            "continuous batching engine does not apply on CPU (its paged eager attention skips it), so rollouts "
            "would not come from this model. Use the 'generate' backend on CPU, or a GPU with flash attention."
        )


def _shared_prompts(rows: list[list[int]], page: int) -> list[tuple[int, ...]]:
    """Prompts that occur more than once and fill at least one KV page: the ones a first prefill helps."""
    counts: dict[tuple[int, ...], int] = {}
    for r in rows:
        counts[tuple(r)] = counts.get(tuple(r), 0) + 1
    return [p for p, n in counts.items() if n > 1 and len(p) >= page]


# --- admission: will the engine start on a GPU's memory? -------------------------------------------------------


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
    `cuda_attention`'s choice for that GPU (`capability`, importable flash-attn `flash`): it decides whether the
    engine reserves an attention mask, and with flash-attn its block-table decode path's buffers."""
    import copy
    from unittest import mock

    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching import initialization
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    text = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    attention = cuda_attention(dtype, capability, flash)
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
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


# --- what a step scheduled ------------------------------------------------------------------------------------


class Scheduled(NamedTuple):
    """One request's part of the batch the engine is about to run."""

    request_id: str
    prompt: tuple[int, ...]
    past_len: int  # tokens already in its KV cache before this step
    query_len: int  # tokens this step computes for it: a prefill chunk, or 1 when decoding
    blocks: tuple[int, ...]  # its block table (full attention), when asked for


def scheduled(processor, blocks: bool = True) -> list[Scheduled]:
    """The requests of the batch `processor` has just prepared, in the order the engine packed them."""
    allocator = next(iter(processor.cache.cache_allocators.values())) if blocks else None
    out = []
    for future in list(getattr(processor.inputs_and_outputs, "requests_in_batch", None) or ()):
        state, query = future.state, int(future.query_length)
        table = allocator.block_table.get(state.request_id, ()) if allocator is not None else ()
        out.append(Scheduled(str(state.request_id), tuple(state.initial_tokens),
                             int(state.position_offset) - query,  # prepare_next_batch has already advanced it
                             query, tuple(int(b) for b in table)))
    return out


def compute_stream(manager) -> torch.cuda.Stream | None:
    """The CUDA stream `manager`'s forwards run on, or None (on CPU; or no manager, or none built its processor
    yet). transformers enqueues each engine forward on a stream of its own, so whoever writes the weights the engine
    reads orders the write against this stream (`AsyncEngine.publish`); a Python lock orders only the enqueueing."""
    processor = getattr(manager, "batch_processor", None)
    return processor.inputs_and_outputs.compute_stream if processor is not None else None


@contextlib.contextmanager
def watch_batches(callback: Callable[[list[Scheduled], int, int], None]) -> Iterator[None]:
    """Call `callback(requests, pool_blocks, page_size)` for every batch any CB engine schedules inside the block,
    in whatever thread the engine runs."""
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

    ContinuousBatchProcessor.prepare_next_batch = prepare_next_batch
    try:
        yield
    finally:
        ContinuousBatchProcessor.prepare_next_batch = original


# --- outputs -> cbkit records ---------------------------------------------------------------------------------


def to_completions(rows: Sequence[Sequence[int]], outputs: Sequence[Any], num_generations: int,
                   sampling: SamplingParams, targets: Sequence[int] | None = None) -> list[Completion]:
    """One `Completion` per row (rows in group order), cut at EOS, the limit or the row's target."""
    completions = []
    for i, (row, out) in enumerate(zip(rows, outputs, strict=True)):
        keep, reason = cut_completion(out.generated_tokens, sampling, targets[i] if targets else None)
        logprobs = list(out.logprobs or [])
        if len(logprobs) < keep:
            raise RuntimeError(
                f"The CB engine returned {len(logprobs)} logprobs for {keep} tokens (request {i}); does this "
                "transformers version support ContinuousBatchingConfig.return_logprobs?"
            )
        completions.append(Completion(
            group=i // num_generations, prompt_ids=tuple(row), completion_ids=tuple(out.generated_tokens[:keep]),
            sampling_logprobs=tuple(float(x) for x in logprobs[:keep]), finish_reason=reason))
    return completions


def timeline(outputs: Sequence[Any], completions: Sequence[Completion], t0: float, resolved: Mapping[str, Any],
             swaps: Sequence[tuple[float, int]] | None = None) -> dict[str, Any]:
    """Engine clocks per request, in the shape `cbkit.telemetry.occupancy` and the timeline plots read; with the
    policy version of every token and when each update landed, where the completions carry versions."""
    requests = []
    for i, (out, c) in enumerate(zip(outputs, completions, strict=True)):
        start, end = out.lifespan
        request = {"id": i, "group": c.group, "prompt_len": len(c.prompt_ids), "start": start, "end": end,
                   "token_times": list(out.timestamps or [])[: len(c.completion_ids)]}
        if c.policy_versions is not None:
            request["token_versions"] = list(c.policy_versions)
        requests.append(request)
    out = {"page_size": resolved.get("page_size"), "pool_blocks": resolved.get("num_blocks"), "t0": t0,
           "prefix_sharing": bool(resolved.get("allow_block_sharing", False)), "requests": requests}
    if swaps is not None:
        out["swaps"] = list(swaps)
    return out
