"""Continuous batching: the same job as `generate.py`, through transformers' CB engine.

Read this file next to `generate.py`. Instead of one padded batch decoded in lock-step, the P*N requests
go into a queue. The engine keeps a fixed pool of KV-cache blocks (sized once, as a share of free memory),
and at every step builds a batch from whatever is running: prefill chunks of new requests and one decode
token for each running one, packed without padding. When a sequence hits EOS its blocks go back to the
pool and a waiting request takes them (*recycling*), so memory follows the tokens actually alive rather
than P*N*max_len.

Two things cbkit does that TRL's CB path (1.16) does not:

* it asks the engine for sampling logprobs (`return_logprobs=True`) and keeps them, so the loop's
  importance-sampling correction has something to correct with;
* it raises when a request fails instead of logging and returning fewer completions.

Like TRL 1.16 it passes the sampling parameters explicitly as a GenerationConfig (TRL issue #5783, fixed by
1.16: without them the engine falls back to the model's defaults and sampling goes near-greedy). Its engine
defaults are its own: `max_memory_percent=0.5` (TRL's CB default too) and `use_cuda_graph=False` (TRL leaves
that to the engine).

A kept engine (`persistent=True`) must not sample on KV of weights the optimizer has since changed: it empties its
prefix cache before every call (`forget_cached_kv`), is attached to the model only for its own calls
(`_own_engine`), is reseeded each call, and queues a call's requests while paused. docs/design.md tells why;
`tests/test_persistent_engine.py` checks each against `generate()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cbkit.rollout.base import Completion, Rollout, SamplingParams, check_request, cut_completion
from cbkit.rollout.cpu_attention import CPU_ATTENTION, varlen_attention_for_engine, varlen_unsupported_reason
from cbkit.rollout.engine_loop import engine_loop, resolve_engine_loop
from cbkit.telemetry import PeakMemory

# cbkit's defaults, overridable key by key like TRL's `transformers_continuous_batching_config`.
# max_memory_percent: half the free memory for the KV pool leaves the other half to the training step
# that shares the process (transformers' own default, 0.9, assumes inference alone).
# use_cuda_graph: graphs are captured per shape and re-captured as shapes drift; with weights changing
# every step and short runs, capture time is rarely paid back.
CB_DEFAULTS: dict[str, Any] = {"max_memory_percent": 0.5, "use_cuda_graph": False}
# Tokens per KV page on CPU, where no kernel wants large pages (cbkit's attention gathers keys by index). A page is
# the unit a request allocates and a group's prompt is shared in: with the engine's 256, a GSM8K prompt is never
# shared and every request holds 256 tokens from its first (docs/cpu_results.md has the RSS it costs).
CPU_PAGE_SIZE = 32


def cb_config_keys() -> list[str]:
    from transformers import ContinuousBatchingConfig

    return sorted(f.name for f in dataclasses.fields(ContinuousBatchingConfig))


def cb_config_values(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """cbkit's defaults + the user's keys + `return_logprobs=True`, checked: the device-independent part of
    `make_cb_config`, and what the TRL bridge writes into TRL's config."""
    overrides = dict(overrides or {})
    valid = cb_config_keys()
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"Unknown continuous batching config key(s) {unknown}. transformers' ContinuousBatchingConfig "
            f"accepts: {', '.join(valid)}."
        )
    if overrides.get("return_logprobs") is False:
        raise ValueError(
            "return_logprobs=False would drop the sampling logprobs the importance-sampling correction needs; "
            "remove it from the continuous batching config (cbkit always sets it to True)."
        )
    values = {**CB_DEFAULTS, **overrides, "return_logprobs": True}
    mmp = values.get("max_memory_percent")
    if mmp is not None and not (isinstance(mmp, int | float) and 0 < mmp <= 1):
        raise ValueError(
            f"max_memory_percent must be a fraction in (0, 1] of free memory, got {mmp!r}; e.g. 0.5 for half."
        )
    return values


def make_cb_config(
    overrides: Mapping[str, Any] | None = None,
    *,
    seed: int | None = None,
    device: torch.device | None = None,
    rows: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int | None = None,
    warn: bool = True,
):
    """cbkit's defaults + the user's overrides + what cbkit requires, validated with errors that say what to change.

    On CPU the engine would size its pool as a share of *host RAM*: gigabytes of zeroed KV for a small model. There
    cbkit sizes the pool to the workload instead: enough blocks for every request (`rows`) to run to
    `max_new_tokens` at once (the generation limit, never a replayed length, which a real engine cannot know in
    advance), unless the user set `num_blocks`. Pages are `CPU_PAGE_SIZE` tokens there unless the user set a size.
    `max_memory_percent` means a share of free *GPU* memory wherever it is written (TRL's CB config too), so on CPU
    it is ignored with a warning; `{"num_blocks": None}` lets the engine size the pool from memory anyway.
    docs/cpu_results.md has what the host-RAM sizing cost.
    """
    from transformers import ContinuousBatchingConfig

    overrides = dict(overrides or {})
    values = cb_config_values(overrides)
    cpu = device is not None and torch.device(device).type == "cpu"
    key = _page_key()
    if cpu and "page_size" not in overrides and "block_size" not in overrides:
        values[key] = CPU_PAGE_SIZE
    mmp_default = CB_DEFAULTS["max_memory_percent"]
    workload = workload_blocks(rows, max_new_tokens, page_size(values)) if rows and max_new_tokens else None
    if cpu and workload and "num_blocks" not in overrides:
        # A max_memory_percent equal to cbkit's default is the default, not a choice (configs merge defaults in).
        if warn and overrides.get("max_memory_percent", mmp_default) != mmp_default:
            warnings.warn(
                f"max_memory_percent={overrides['max_memory_percent']} is a share of free GPU memory; on a CPU the "
                f"engine would take that share of host RAM. cbkit sizes the CPU pool to the workload "
                f"({workload} blocks) instead. Set num_blocks to fix the pool yourself, or num_blocks=None "
                "to let the engine size it from max_memory_percent.",
                UserWarning, stacklevel=3,
            )
        values["num_blocks"] = workload
    if seed is not None and "seed" not in overrides:
        values["seed"] = seed
    return ContinuousBatchingConfig(**values)


class ContinuousBackend:
    name = "continuous"

    def __init__(
        self,
        model,
        cb_config: Mapping[str, Any] | None = None,
        *,
        record_timestamps: bool = False,
        persistent: bool = False,
        cpu_attention: str = "batched",
        engine_loop: str = "auto",
    ) -> None:
        self.model = model
        # On CPU, run the engine with cbkit's varlen attention instead of its dense block-diagonal mask, whose
        # cost grows with the square of the batch (cbkit/rollout/cpu_attention.py says why and by how much).
        if cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION)}; got {cpu_attention!r}.")
        self.cpu_attention = cpu_attention
        # Who runs the engine's loop: the caller's thread on CPU, transformers' background thread elsewhere
        # (cbkit/rollout/engine_loop.py says why, with what was measured). Checked now, resolved per call.
        resolve_engine_loop(engine_loop, torch.device("cpu"), cb_config)
        self.engine_loop = engine_loop
        self.cb_overrides = dict(cb_config or {})
        self.record_timestamps = record_timestamps  # per-token clocks for the engine timeline
        # persistent: keep the engine's cache and buffers between calls (a GRPO step each) instead of
        # building them anew; the engine thread still stops after every call and the model's attention is
        # restored, so training forwards in between are plain causal forwards.
        self.persistent = persistent
        self._engine_key: tuple | None = None
        # This backend's kept engine. transformers keeps one manager per model (`_cached_continuous_batching_manager`)
        # and hands it to whoever asks next; cbkit attaches only its own for the length of a call (`_own_engine`).
        self._manager: Any = None
        self._warned_varlen = False  # the note that this model needs the engine's own attention, once
        self._warned_pool = False  # the CPU pool warning of make_cb_config, once per backend rather than per step
        make_cb_config(self.cb_overrides)  # fail at construction, not at the first rollout

    def close(self) -> None:
        """Free this backend's persistent engine (its KV pool and buffers); another backend's is left alone."""
        if self._manager is not None:
            if getattr(self.model, _CACHED, None) is self._manager:
                delattr(self.model, _CACHED)
            self._manager.destroy()
            self._manager = None
        self._engine_key = None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        num_generations: int,
        sampling: SamplingParams,
        *,
        prompt_names: Sequence[str] | None = None,
        target_lengths: Sequence[int] | None = None,
    ) -> Rollout:
        check_request(prompts, num_generations, sampling, self.model, prompt_names, target_lengths)
        gen_config = sampling.generation_config()
        # Each prompt submitted N times in a row; results are put back in this order below, whatever
        # order the engine finishes them in.
        rows = [list(p) for p in prompts for _ in range(num_generations)]
        targets = [int(t) for t in target_lengths] if target_lengths is not None else None
        cb_config = make_cb_config(
            self.cb_overrides,
            seed=sampling.seed,
            device=self.model.device,
            rows=rows,
            max_new_tokens=sampling.max_new_tokens,
            warn=not self._warned_pool,
        )
        self._warned_pool = True

        if self.persistent:
            # A kept engine keeps the sampling settings and seed it was built with: rebuild it when they change.
            key = (repr(gen_config.to_dict()), repr(sorted(self.cb_overrides.items())))
            if self._engine_key is not None and key != self._engine_key:
                self.close()
            self._engine_key = key

        _refuse_softcap_on_cpu(self.model)
        varlen = self.cpu_attention != "engine" and self.model.device.type == "cpu"
        unsupported = varlen_unsupported_reason(self.model) if varlen else None
        if unsupported:
            varlen = False
            if not self._warned_varlen:
                warnings.warn(f"cbkit's CPU varlen attention has no {unsupported}: the CB engine runs with the "
                              "model's own attention instead (slower on CPU, same results).", UserWarning, stacklevel=2)
                self._warned_varlen = True
        if varlen and "max_blocks_per_request" not in self.cb_overrides:
            cb_config.max_blocks_per_request = 0  # the block-table fast path calls a real flash-attn kernel
        attention = varlen_attention_for_engine(self.model, self.cpu_attention) if varlen else contextlib.nullcontext()

        if self._manager is not None:
            # The weights may have changed since the last call (an optimizer step): KV computed with them must not
            # be read again. See `forget_cached_kv`.
            forget_cached_kv(self._manager)
        with PeakMemory(self.model.device) as mem, attention, _own_engine(self):
            start = time.perf_counter()
            outputs, resolved = _run_engine(
                self.model, rows, gen_config, cb_config, sampling.max_new_tokens, self.record_timestamps,
                persistent=self.persistent, targets=targets,
                loop=resolve_engine_loop(self.engine_loop, self.model.device, self.cb_overrides),
            )
            mem.synchronize()
            wall = time.perf_counter() - start

        completions = []
        for i, (row, out) in enumerate(zip(rows, outputs, strict=True)):
            keep, reason = cut_completion(out.generated_tokens, sampling, targets[i] if targets else None)
            if len(out.logprobs) < keep:
                raise RuntimeError(
                    f"The CB engine returned {len(out.logprobs)} logprobs for {keep} tokens (request {i}); "
                    "is return_logprobs supported by this transformers version?"
                )
            completions.append(
                Completion(
                    group=i // num_generations,
                    prompt_ids=tuple(row),
                    completion_ids=tuple(out.generated_tokens[:keep]),
                    sampling_logprobs=tuple(float(x) for x in out.logprobs[:keep]),
                    finish_reason=reason,
                )
            )
        return Rollout(
            completions=completions,
            num_generations=num_generations,
            backend=self.name,
            wall_s=wall,
            peak_mem_bytes=mem.peak_bytes,
            peak_mem_kind=mem.kind,
            engine_config=resolved,
            timeline=_timeline(outputs, completions, resolved, start) if self.record_timestamps else None,
        ).validate()


def _run_engine(
    model, rows: list[list[int]], gen_config, cb_config, max_new_tokens: int, record_timestamps: bool,
    persistent: bool = False,
    targets: list[int] | None = None,
    loop: str = "thread",
):
    """Submit every row, collect every result, and return them in submission order with the resolved config.

    This is what `generate_batch` does, minus its habit of logging a failed request and returning fewer
    results than were asked for. With ``targets`` each request gets its own max_new_tokens and EOS id -1,
    which the engine's RequestState drops (negative ids never match), so a request finishes exactly at its
    target (`update_and_check_completion` in transformers' requests.py) and its blocks are freed then.
    """
    hints = _workload_hints(rows, max(targets) if targets else max_new_tokens)
    with engine_loop(loop, model, persistent, generation_config=gen_config, continuous_batching_config=cb_config,
                     workload_hints=hints) as engine:
        manager = engine.manager
        # With prefix sharing on (`allow_block_sharing`, the engine's default), each prompt is prefilled once.
        prefill_once = bool(getattr(manager, "_use_prefix_sharing", False))
        if prefill_once:
            # The engine shares a prompt's complete KV pages between requests, but only pages that a finished
            # forward has already written: N copies of a prompt admitted in the same step all compute it. So each
            # distinct prompt is prefilled first, alone, and its N completions then find its pages in the cache
            # and compute only their last, incomplete page. Two tokens, thrown away: the engine registers the
            # pages a forward completed only for a request still running after it (`mark_complete_blocks`).
            with engine.paused():
                _reseed(manager, cb_config.seed)
                prefill = [manager.add_request(list(p), max_new_tokens=2, eos_token_id=-1)
                           for p in _shared_prompts(rows, page_size(cb_config))]
            engine.collect(prefill)
        with engine.paused():
            # All requests are queued while the loop is parked, so it takes them in one drain: how they are grouped
            # into batches, and so the order random numbers are drawn in, no longer depends on thread timing.
            if not prefill_once:
                _reseed(manager, cb_config.seed)
            if targets is None:
                ids = manager.add_requests(inputs=rows, max_new_tokens=max_new_tokens,
                                           record_timestamps=record_timestamps)
            else:
                ids = _add_with_targets(manager, rows, targets, record_timestamps)
        results = engine.collect(ids)
        resolved = _resolved_config(manager)
    return [results[i] for i in ids], resolved


def _shared_prompts(rows: list[list[int]], page: int) -> list[tuple[int, ...]]:
    """Prompts that occur more than once and fill at least one KV page: the ones a first prefill helps."""
    counts: dict[tuple[int, ...], int] = {}
    for r in rows:
        counts[tuple(r)] = counts.get(tuple(r), 0) + 1
    return [p for p, n in counts.items() if n > 1 and len(p) >= page]


def _add_with_targets(manager, rows: list[list[int]], targets: list[int], record_timestamps: bool) -> list[str]:
    """`add_requests` with one max_new_tokens per request and EOS disabled; ids returned in row order.
    Submitted in the order `add_requests` would use: sorted by prompt when prefix sharing is on (cache hits)."""
    order = list(range(len(rows)))
    if getattr(manager, "_use_prefix_sharing", False):
        order.sort(key=lambda i: rows[i], reverse=True)
    ids: list[str] = [""] * len(rows)
    for i in order:
        request_id = manager.add_request(rows[i], max_new_tokens=targets[i], record_timestamps=record_timestamps,
                                         eos_token_id=-1)
        if request_id is None:
            raise RuntimeError(f"The CB engine refused request {i} (not accepting requests); see the log above.")
        ids[i] = request_id
    return ids


_CACHED = "_cached_continuous_batching_manager"  # where transformers keeps a persistent manager on the model


@contextlib.contextmanager
def _own_engine(backend: ContinuousBackend):
    """Attach exactly this backend's kept manager (or none) to the model for one call, then restore what was there.

    `init_continuous_batching` returns whatever manager is cached on the model, whoever built it: without this, a
    non-persistent backend would run on a persistent one's engine (its config, its cache) and destroy it. On exit,
    even a failed one, the backend records the manager the call left attached: the one to keep, when persistent.
    """
    model, mine = backend.model, backend._manager
    previous = getattr(model, _CACHED, None)
    _attach(model, mine)
    try:
        yield
    finally:
        kept = getattr(model, _CACHED, None)
        backend._manager = kept if backend.persistent else None
        # Our own kept engine stays attached (engine_is_idle and close() look there); someone else's comes back.
        _attach(model, kept if previous is None or previous is mine else previous)


def _attach(model, manager) -> None:
    if manager is not None:
        setattr(model, _CACHED, manager)
    elif hasattr(model, _CACHED):
        delattr(model, _CACHED)


def forget_cached_kv(manager) -> None:
    """Drop every KV block a kept engine holds, prefix cache included, before a call that may see new weights.

    The prefix cache's hashes cover token ids, not weights, so it must not outlive them (docs/design.md, "A kept
    engine"). Sharing inside one call (the N completions of a prompt) is kept; `cache.reset()` is the engine's own
    call for an empty pool, the one it makes after its warm-up.
    """
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if cache is not None:
        cache.reset()


def _reseed(manager, seed: int | None) -> None:
    """Seed the engine's sampler for this call, as a fresh engine seeds itself when it is built.

    A kept engine was seeded once, when it was built; without this it would ignore every later call's seed and a
    resumed run would not draw what the uninterrupted one did.
    """
    if seed is None:
        return
    manager.continuous_batching_config.seed = seed  # what `_resolved_config` reports
    helper = getattr(manager, "distributed_helper", None)
    if hasattr(helper, "set_tp_seed"):
        helper.set_tp_seed(seed, manager.model.device)
    else:
        torch.manual_seed(seed)


def workload_blocks(rows: Sequence[Sequence[int]], max_new_tokens: int, page_size: int) -> int:
    """Blocks for every request at full length at once, plus one spare (the engine reserves a trash block).
    Always the generation limit, never replayed targets: an engine cannot know a completion's length ahead."""
    return sum(-(-(len(r) + max_new_tokens) // page_size) for r in rows) + 1


def _page_key() -> str:
    from transformers import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    return "page_size" if "page_size" in names else "block_size"  # block_size before transformers 5.17


def page_size(config) -> int:
    """Tokens per KV page of a resolved ContinuousBatchingConfig or a dict of engine keys (the engine's default
    where none is set). The one page-size lookup: the backend, the planner and the TRL bridge call it."""
    from transformers import ContinuousBatchingConfig

    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    for key in ("page_size", "block_size"):
        if get(key):
            return int(get(key))
    return int(getattr(ContinuousBatchingConfig(), _page_key()))


def _timeline(outputs, completions, resolved: dict, t0: float) -> dict[str, Any]:
    """Engine clocks per request, in the shape `cbkit.telemetry.occupancy` and the timeline plot read."""
    requests = []
    for i, (out, c) in enumerate(zip(outputs, completions, strict=True)):
        start, end = out.lifespan
        requests.append({"id": i, "group": c.group, "prompt_len": len(c.prompt_ids), "start": start, "end": end,
                         "token_times": list(out.timestamps or [])[: len(c.completion_ids)]})
    return {"page_size": resolved.get("page_size"), "pool_blocks": resolved.get("num_blocks"), "t0": t0,
            "prefix_sharing": bool(resolved.get("allow_block_sharing", False)), "requests": requests}


def _workload_hints(rows, max_new_tokens):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:  # older engines size the pool without hints
        return None
    hints = dict(max_prompt_length=max(len(r) for r in rows), max_generated_length=max_new_tokens,
                 num_requests=len(rows))  # num_requests arrived in transformers 5.11
    known = {f.name for f in dataclasses.fields(WorkloadHints)}
    return WorkloadHints(**{k: v for k, v in hints.items() if k in known})


def _resolved_config(manager) -> dict[str, Any]:
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
    # transformers < 5.17 calls a page a "block" (block_size); cbkit reports it under one name.
    if "block_size" in out:
        out.setdefault("page_size", out.pop("block_size"))
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


def _refuse_softcap_on_cpu(model) -> None:
    """Gemma-2-style attention soft-capping has no CPU path in the engine: say so before sampling wrong tokens.

    On CPU the engine attends with `paged|eager` (transformers/integrations/eager_paged.py), which applies sinks but
    not `softcap`; cbkit's varlen attention has none either. Both would sample from another model than the one
    trained (on the tiny Gemma-2-style test model, logprobs off by 0.03 nats). Flash attention on a GPU applies it.
    """
    cap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    if cap is not None and model.device.type == "cpu":
        raise ValueError(
            f"This model uses attention logit soft-capping (attn_logit_softcapping={cap}), which transformers' "
            "continuous batching engine does not apply on CPU (its paged eager attention skips it), so rollouts "
            "would not come from this model. Use the 'generate' backend on CPU, or a GPU with flash attention."
        )


def engine_is_idle(model) -> bool:
    """True when no CB engine is running on the model and its attention is its own again, so a plain forward
    is an ordinary causal forward. A persistent engine that is kept but stopped counts as idle: stopping
    restores the attention implementation (tests/test_persistent_engine.py checks the forward is unchanged).
    """
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    running = manager is not None and manager.is_running()
    return not running and not str(model.config._attn_implementation).startswith("paged")




class ThreadedContinuousBackend(ContinuousBackend):
    """The CB engine on transformers' background thread whatever `engine_loop` says: a backend of its own, so one
    sweep can measure it beside `continuous` run with another loop (`engine_loop.py`)."""

    name = "continuous-thread"

    def __init__(self, model, cb_config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(model, cb_config, engine_loop="thread", **kwargs)
