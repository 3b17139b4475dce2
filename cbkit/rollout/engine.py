"""The engine: one class owns transformers' continuous batching manager; the engine's modules alone reach inside it.

Every CB caller in cbkit goes through `Engine`: `ContinuousBackend` (a manager per rollout, or one kept between
rollouts), `AsyncEngine` (one kept running on a weight snapshot while the trainer trains) and the TRL bridge
(`cbkit.trl.trainers`). `Engine` owns

* the config: `make_cb_config` (`engine_config.py`: cbkit's defaults, the CPU pool rule) and the attention,
  `engine_attention`'s choice on every device: flash-attn where it can run, else cbkit's varlen attention
  (`varlen_attention.py`), unless the model needs the engine's own;
* the manager's life: built for a call and destroyed after it, or kept (`persistent`), attached to the model only
  for its own calls (`_own`), its KV emptied before every call, since the weights may have changed since
  (`forget_cached_kv`), and reseeded every call;
* who runs the loop: transformers' background thread or the caller's thread (`engine_loops.py`);
* collecting (a failed request raises, where transformers' `generate_batch` logs it and returns fewer results).

Beside it: `engine_io.py` (the workload hints, the resolved settings, what each step scheduled -- read by
`engine_trace.py` and the async engine -- and outputs turned into `Completion`s and the timeline) and
`admission.py` (would the engine start on a GPU's memory: transformers' own check, run on any machine).

These four modules (engine, engine_loops, engine_io, admission) are the only ones that touch transformers' CB
internals; what they rely on is pinned by tests/test_engine_contract.py against the installed version:
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
             and, by name, `utils.attn_mask_is_needed` and `is_flash_attention_requested` (cbkit's varlen attention)
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from cbkit.rollout.engine_config import (
    ENGINE_OWN,
    engine_attention,
    make_cb_config,
    page_size,
    resolve_engine_loop,
)
from cbkit.rollout.engine_io import HELPER_PREFIX, Scheduled, resolved_config, scheduled, workload_hints
from cbkit.rollout.engine_loops import CACHED_MANAGER, CallerLoop, ThreadLoop
from cbkit.rollout.varlen_attention import NAME as VARLEN
from cbkit.rollout.varlen_attention import varlen_attention_for_engine, varlen_unsupported_reason


class Engine:
    """One CB manager on one model: configured, attached, driven and read here (see the module docstring).

    `run` is one rollout's worth of requests, start to finish; `start` / `submit` / `take` / `stop` keep the
    manager running on transformers' thread between calls (the async engine)."""

    def __init__(self, model, cb_config: Mapping[str, Any] | None = None, *, persistent: bool = False,
                 engine_loop: str = "auto", record_timestamps: bool = False) -> None:
        # engine_loop: who runs the manager's loop ("auto": the caller's thread on CPU, transformers' elsewhere;
        # the async engine asks for the thread, which decodes while the trainer trains).
        resolve_engine_loop(engine_loop, torch.device("cpu"), cb_config)  # checked now, resolved per call
        self.model, self.overrides = model, dict(cb_config or {})
        make_cb_config(self.overrides)  # fail at construction, not at the first rollout
        self.persistent, self.engine_loop = persistent, engine_loop
        self.record_timestamps = record_timestamps
        # transformers keeps one manager per model and hands it to whoever asks next; this engine attaches only its
        # own kept one, for the length of its own calls (`_own`).
        self._kept: Any = None
        self._key: tuple | None = None  # the sampling settings and config the kept manager was built with
        self._loop: ThreadLoop | None = None  # the manager kept running by `start`
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
        """The attention of the engine's run, `engine_attention`'s choice, the model's own restored after: flash-attn
        where it can run; else cbkit's varlen attention, whose cost grows with the batch where the engine's dense
        block-diagonal mask grows with its square (varlen_attention.py); else the engine's own where a model needs
        it."""
        _refuse_softcap_on_cpu(self.model)
        unsupported = varlen_unsupported_reason(self.model)
        flash_ok = bool(getattr(self.model, "_supports_flash_attn", False))
        choice = engine_attention(self.model.device, self.model.dtype, flash=None if flash_ok else (),
                                  needs_own=unsupported)
        if choice == VARLEN:
            graphs = cb_config.use_cuda_graph
            if self.model.device.type == "cuda" and (any(graphs) if isinstance(graphs, tuple | list) else graphs):
                raise ValueError("use_cuda_graph cannot run with cbkit's varlen attention, which reads each batch's "
                                 "sequence boundaries on the host (a captured graph replays none of that); drop "
                                 "use_cuda_graph from the continuous batching config, or load fp16/bf16 weights on "
                                 "a GPU with flash-attn installed.")
            if "max_blocks_per_request" not in self.overrides:
                cb_config.max_blocks_per_request = 0  # the block-table fast path calls a real flash-attn kernel
            return varlen_attention_for_engine(self.model)
        if unsupported and choice == ENGINE_OWN and not self._warned_varlen:
            warnings.warn(f"cbkit's varlen attention has no {unsupported}: the CB engine runs with its own attention "
                          "instead (a dense mask that grows with the square of the batch; same results).",
                          UserWarning, stacklevel=4)
            self._warned_varlen = True
        if choice == ENGINE_OWN and self.model.config._attn_implementation == "eager":
            return contextlib.nullcontext()  # eager is the engine's other dense path ("paged|eager"), with sinks
        return attention_for_engine(self.model, choice)

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
        driver = (CallerLoop if loop == "caller" else ThreadLoop)(
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
                    prefill = [driver.manager.add_request(list(p), request_id=f"{HELPER_PREFIX}{k}",
                                                          max_new_tokens=2, eos_token_id=-1)
                               for k, p in enumerate(_shared_prompts(rows, page_size(cb_config)))]
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
        previous, mine = getattr(self.model, CACHED_MANAGER, None), self._kept
        _attach(self.model, mine)
        try:
            yield
        finally:
            kept = getattr(self.model, CACHED_MANAGER, None)
            self._kept = kept if self.persistent else None
            # Our own kept manager stays attached (engine_is_idle and close() look there); someone else's comes back.
            _attach(self.model, kept if previous is None or previous is mine else previous)

    def close(self) -> None:
        """Stop a running manager and free this engine's kept one (KV pool, buffers); another engine's is left."""
        if self._stack is not None:
            self._stack.close()
        self._stack = self._loop = None
        if self._kept is not None:
            if getattr(self.model, CACHED_MANAGER, None) is self._kept:
                delattr(self.model, CACHED_MANAGER)
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
        self._loop = stack.enter_context(ThreadLoop(
            self.model, False, warmup=False, generation_config=gen_config, continuous_batching_config=cb_config,
            workload_hints=workload_hints(rows, max_new_tokens)))
        self._stack = stack
        weakref.finalize(self, stack.close)  # the engine thread is not a daemon: never leave it running at exit

    def _running(self) -> ThreadLoop:
        if self._loop is None:
            raise RuntimeError("No engine manager is running: call start() first (close() stops it).")
        return self._loop

    def paused(self) -> contextlib.AbstractContextManager:
        return self._running().paused()

    def queue(self, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None,
              targets: Sequence[int] | None = None) -> list[str]:
        """`submit` to the running manager (hold `paused()` around it for a seeded order of draws); ``targets``
        as in `run`."""
        return self.submit(self._running(), rows, max_new_tokens, seed, targets=targets)

    def take(self, results: dict[str, Any], timeout: float, expected: int) -> None:
        """Wait up to `timeout` s for one result of the running manager; a finished one goes into `results`."""
        self._running().take(results, timeout, expected)

    def scheduled(self) -> list[Scheduled]:
        """The requests of the batch the running manager is about to run (see `scheduled`)."""
        processor = getattr(self.manager, "batch_processor", None)
        return scheduled(processor, blocks=False) if processor is not None else []


# --- the manager's state --------------------------------------------------------------------------------------


def _attach(model, manager) -> None:
    if manager is not None:
        setattr(model, CACHED_MANAGER, manager)
    elif hasattr(model, CACHED_MANAGER):
        delattr(model, CACHED_MANAGER)


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
    set_tp_seed = getattr(getattr(manager, "distributed_helper", None), "set_tp_seed", None)
    if set_tp_seed is not None:
        set_tp_seed(seed, manager.model.device)
    else:
        torch.manual_seed(seed)


def engine_is_idle(model) -> bool:
    """True when no CB engine is running on the model and its attention is its own again, so a plain forward is an
    ordinary causal forward. A kept manager that is stopped counts as idle: stopping restores the attention."""
    manager = getattr(model, CACHED_MANAGER, None)
    running = manager is not None and manager.is_running()
    return not running and not str(model.config._attn_implementation).startswith("paged")


@contextlib.contextmanager
def attention_for_engine(model, implementation: str) -> Iterator[None]:
    """Run the engine with `implementation` ("sdpa" or "flash_attention_N", `engine_attention`'s choice), the model's
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
