"""Who runs the CB engine's generation loop: transformers' background thread, or the caller's own thread.

transformers' `ContinuousBatchingManager.start()` runs the loop (schedule a batch, pack it, one forward, sample,
update the requests) in a background thread, and the caller waits on an output queue. A rollout has nothing else
to do while it waits, so the loop can as well run in the caller's thread: no second OpenMP team beside the
caller's, no queue hand-off per finished request, no `pause()` round trip to queue requests, one `gc.collect()`
fewer per call. That was the hypothesis of issue 20. On a quiet 2-core machine it holds: `scripts/engine_loop_ab.py`
(SmolLM2 fp32, one prompt, `fixed` lengths, the two drivers alternating in one process) measured the caller's loop
1.43x faster at N=8 x 96 tokens (8.1 s against 11.7 s, three pairs) and 1.29x at N=64 (23.5 s against 30.3 s), see
docs/small_n.md. On the same machine shared five ways (load 10-40) the opposite held, by far (13x), so the speed of
the main thread under heavy load is the price. `"auto"` runs the caller's loop on CPU, where the measurement was
made, and transformers' thread on a GPU, where cbkit has not measured the difference; `"thread"` (or the backend
`continuous-thread`) pins the thread.

`CallerLoop` drives the same loop body from the caller's thread: the manager's own `ContinuousBatchProcessor`
schedules, packs, runs and samples exactly as in the thread (same scheduler, cache, sampler, seeds and prefix
sharing), one step per iteration, until the requests asked for are done (`tests/test_engine_loop.py` checks it
draws the thread's tokens and logprobs). A failing step raises in the caller; with the thread, transformers logs
it, fails the requests and the caller reads the failure from the queue. It needs what the thread does without
async batching or tensor parallelism (`caller_loop_unsupported_reason`). The backend `continuous-thread` pins the
thread whatever `engine_loop` says; `scripts/profile_small_n.py continuous 8 --driver caller` runs the other side.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator, Mapping
from typing import Any

import torch

# "auto": the caller's loop on CPU (measured faster there, see the module docstring), transformers' thread elsewhere.
ENGINE_LOOPS = ("auto", "caller", "thread")


def resolve_engine_loop(engine_loop: str, device: torch.device, cb_overrides: Mapping[str, Any] | None = None) -> str:
    """"caller" or "thread" for a call on `device`: "auto" is the caller's loop on CPU and the thread elsewhere, and
    the thread wherever the caller's loop cannot run the engine as the thread does (async batching); an explicit
    "caller" is refused there."""
    if engine_loop not in ENGINE_LOOPS:
        raise ValueError(f"engine_loop must be one of {', '.join(ENGINE_LOOPS)}; got {engine_loop!r}.")
    if engine_loop == "caller" and (cb_overrides or {}).get("use_async_batching"):
        raise ValueError("engine_loop='caller' cannot run async batching (use_async_batching=True overlaps two "
                         "batches across the loop's iterations); use engine_loop='thread', or drop the override.")
    if engine_loop == "auto":
        return "caller" if device.type == "cpu" and not (cb_overrides or {}).get("use_async_batching") else "thread"
    return engine_loop


def caller_loop_unsupported_reason(manager) -> str | None:
    """Why the caller's thread cannot drive this manager's loop the way its thread would, or None."""
    cfg = manager.continuous_batching_config
    if getattr(cfg, "use_async_batching", False):
        return "async batching (it overlaps two batches across the loop's iterations)"
    helper = getattr(manager, "distributed_helper", None)
    if getattr(helper, "cpu_comm_group", None) is not None or not getattr(manager, "is_tp_driver", True):
        return "tensor parallelism (every rank's loop takes part in collectives)"
    return None


class ThreadLoop:
    """transformers' own driver: the loop in a background thread, results read from its output queue."""

    name = "thread"

    def __init__(self, model, persistent: bool, **engine_kwargs: Any) -> None:
        self._context = model.continuous_batching_context_manager(
            block=True, timeout=5, persistent_manager=persistent, **engine_kwargs)
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

    def collect(self, ids: list[str]) -> dict[str, Any]:
        """Wait for every request in `ids` to finish; raise on a failed one or a stopped engine."""
        manager, results = self.manager, {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(
                        f"The CB engine stopped after {len(results)} of {len(ids)} requests; see the log above.")
                continue
            if out.is_finished():
                _check(out)
                results[out.request_id] = out
        return results


class CallerLoop:
    """The manager's loop body, run in the caller's thread: one engine step per iteration until the asked-for
    requests are done. The manager's start/stop are replaced by what they do around the loop, minus the thread."""

    name = "caller"

    def __init__(self, model, persistent: bool, *, warmup: bool = True, **engine_kwargs: Any) -> None:
        self.model, self.persistent, self.warmup = model, persistent, warmup
        self.engine_kwargs = engine_kwargs
        self.manager: Any = None
        self.processor: Any = None

    def __enter__(self) -> CallerLoop:
        with torch.no_grad():
            manager = self.model.init_continuous_batching(**self.engine_kwargs)
        self.manager = manager
        try:
            reason = caller_loop_unsupported_reason(manager)
            if reason is not None:
                raise ValueError(f"engine_loop='caller' cannot drive an engine with {reason}; use "
                                 "engine_loop='thread' (or 'auto').")
            if self.warmup and not manager.warmed_up:
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
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        """What `manager.stop()` does once its thread has joined: keep or drop the processor, give the model its
        attention back; and what the context manager does after it for an engine that is not kept. Not its own
        `gc.collect()`: a dropped processor's `__del__` runs one already, and a full collection over a heap that
        holds torch, transformers and the model is a visible share of a short CPU rollout (docs/small_n.md)."""
        manager = self.manager
        manager.background_thread_status.mark_as_stopped()
        if self.persistent:
            self.model._cached_continuous_batching_manager = manager
        else:
            manager.batch_processor = None
        if manager._original_attn_impl is not None:
            self.model.set_attn_implementation(manager._original_attn_impl)
            manager._original_attn_impl = None
        self.processor = None  # the last reference: the processor's __del__ frees the pool (and runs gc.collect)
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
                if len(results) >= len(ids) and all(i in results for i in ids):
                    return results
                if not processor.prepare_next_batch():
                    missing = [i for i in ids if i not in results]
                    raise RuntimeError(f"The CB engine has no work left but {len(missing)} of {len(ids)} requests "
                                       f"never finished (first: {missing[0]}); see the log above.")
                manager._generation_step()
                manager.current_batch += 1
                processor.update_batch()


def _check(out) -> None:
    if out.error is not None:
        raise RuntimeError(f"The CB engine failed request {out.request_id}: {out.error}")


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def engine_loop(kind: str, model, persistent: bool, **engine_kwargs: Any) -> ThreadLoop | CallerLoop:
    """The driver `kind` ("caller" or "thread", see `resolve_engine_loop`) over a manager built from
    ``engine_kwargs`` (generation_config, continuous_batching_config, workload_hints)."""
    return CallerLoop(model, persistent, **engine_kwargs) if kind == "caller" else ThreadLoop(
        model, persistent, **engine_kwargs)
