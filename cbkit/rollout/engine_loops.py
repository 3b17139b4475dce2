"""Who runs the CB manager's loop: transformers' background thread (`ThreadLoop`) or the caller's thread
(`CallerLoop`). Both drive the same manager, scheduler, cache and sampler; `Engine` picks one per call
(`engine_config.resolve_engine_loop`: the caller's loop on CPU, the thread elsewhere and for the async engine).
Part of the engine: this module reaches transformers' CB internals, listed in `cbkit/rollout/engine.py`.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from typing import Any

import torch

CACHED_MANAGER = "_cached_continuous_batching_manager"  # where transformers keeps a persistent manager on the model



class ThreadLoop:
    """transformers' own driver: the loop in a background thread, results read from its output queue."""

    def __init__(self, model, persistent: bool, *, warmup: bool = True, **engine_kwargs: Any) -> None:
        self._context = model.continuous_batching_context_manager(
            block=True, timeout=5, persistent_manager=persistent, warmup=warmup, **engine_kwargs)
        self.manager: Any = None

    def __enter__(self) -> ThreadLoop:
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


class CallerLoop:
    """The manager's loop body, run in the caller's thread: one engine step per iteration until the asked-for
    requests are done. Same scheduler, cache, sampler, seeds and prefix sharing as the thread, without the thread's
    OpenMP team, queue hand-offs and `pause()` round trips (lab/small_n.md has what that is worth on a CPU).
    A failing step raises in the caller."""

    def __init__(self, model, persistent: bool, **engine_kwargs: Any) -> None:
        self.model, self.persistent, self.engine_kwargs = model, persistent, engine_kwargs
        self.manager: Any = None
        self.processor: Any = None

    def __enter__(self) -> CallerLoop:
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
            setattr(self.model, CACHED_MANAGER, manager)
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
