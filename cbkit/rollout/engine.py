"""The engine: one class owns transformers' continuous batching manager and drives it through the public API.

`ContinuousBackend`, `AsyncEngine` and the TRL bridge all go through `Engine`: its config, its attention and the
manager's life (per call, or kept); the loop runs in transformers' own thread. Not `generate_batch`: it drops failed
requests, queues without `pause()` (seeded draws would depend on thread timing) and has no per-request length.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from cbkit.rollout import upstream, varlen_attention
from cbkit.rollout.base import Completion, SamplingParams, cut_completion
from cbkit.rollout.engine_config import ENGINE_OWN, engine_attention, make_cb_config, page_size


def take(manager, results: dict[str, Any], timeout: float, expected: int) -> None:
    """Wait up to `timeout` s for one result of transformers' loop; a failed request or a stopped loop raises."""
    out = manager.get_result(timeout=timeout)
    if out is not None and out.error is not None:
        raise RuntimeError(f"The CB engine failed request {out.request_id}: {out.error}")
    if out is not None and out.is_finished():
        results[out.request_id] = out
    elif out is None and not manager.is_running():
        raise RuntimeError(f"The CB engine stopped after {len(results)} of {expected} requests; see the log above.")


def collect(manager, ids: list[str], results: dict[str, Any] | None = None) -> dict[str, Any]:
    results = {} if results is None else results
    while not results.keys() >= set(ids):  # by id: a result of another request never stands in for one of these
        take(manager, results, 1.0, len(ids))
    return results


class Engine:
    """One CB manager on one model. `run` is one rollout, start to finish; `start` keeps one running until `close`
    (the async engine)."""

    def __init__(self, model, cb_config: Mapping[str, Any] | None = None, *, persistent: bool = False,
                 record_timestamps: bool = False) -> None:
        self.model, self.overrides = model, dict(cb_config or {})
        make_cb_config(self.overrides)  # fail at construction, not at the first rollout
        self.persistent, self.record_timestamps = persistent, record_timestamps
        self._kept: Any = None  # this engine's kept manager, attached to the model only during its calls (`_own`)
        self._key: tuple | None = None  # the sampling settings and config the kept manager was built with
        self._running: Any = None  # the manager kept running by `start`
        self._stack: contextlib.ExitStack | None = None
        self._warned_varlen = self._warned_pool = False  # each note once per engine, not per call

    @property
    def manager(self) -> Any:
        return self._running if self._running is not None else self._kept

    def config(self, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None):
        cb = make_cb_config(self.overrides, seed=seed, device=self.model.device, rows=rows,
                            max_new_tokens=max_new_tokens, warn=not self._warned_pool)
        self._warned_pool = True
        return cb

    @contextlib.contextmanager
    def _attention(self, cb_config) -> Iterator[None]:
        """`engine_attention`'s choice for this run, the model's own restored after. Varlen is set on the config:
        `set_attn_implementation` would read the "flash" in its name as a request for flash-attn."""
        cap = getattr(self.model.config.get_text_config(), "attn_logit_softcapping", None)
        if cap is not None and self.model.device.type == "cpu":  # neither CPU attention of the engine applies it
            raise ValueError(f"This model uses attention logit soft-capping (attn_logit_softcapping={cap}), which "
                             "transformers' continuous batching engine does not apply on CPU, so rollouts would not "
                             "come from this model. Use the 'generate' backend on CPU, or a GPU with flash attention.")
        unsupported = varlen_attention.varlen_unsupported_reason(self.model)
        choice = engine_attention(self.model.device, self.model.dtype,
                                  flash=None if upstream.supports_flash(self.model) else (), needs_own=unsupported)
        if choice == varlen_attention.NAME:
            graphs = cb_config.use_cuda_graph
            if self.model.device.type == "cuda" and (any(graphs) if isinstance(graphs, tuple | list) else graphs):
                raise ValueError("use_cuda_graph cannot run with cbkit's varlen attention, which reads each batch's "
                                 "sequence boundaries on the host (a captured graph replays none of that); drop "
                                 "use_cuda_graph from the continuous batching config, or load fp16/bf16 weights on "
                                 "a GPU with flash-attn installed.")
            if "max_blocks_per_request" not in self.overrides:
                cb_config.max_blocks_per_request = 0  # the block-table fast path calls a real flash-attn kernel
        elif unsupported and not self._warned_varlen:
            warnings.warn(f"cbkit's varlen attention has no {unsupported}: the CB engine runs with its own attention "
                          "instead (a dense mask that grows with the square of the batch; same results).",
                          UserWarning, stacklevel=5)
            self._warned_varlen = True
        original = self.model.config._attn_implementation
        if choice == ENGINE_OWN and original == "eager":
            choice = original  # eager is the engine's other dense path ("paged|eager"), with sinks
        if choice == varlen_attention.NAME:
            self.model.config._attn_implementation = varlen_attention.register()
        elif choice != original:
            self.model.set_attn_implementation(choice)
        try:
            yield
        finally:
            if choice == varlen_attention.NAME:
                self.model.config._attn_implementation = original
            elif self.model.config._attn_implementation != original:
                self.model.set_attn_implementation(original)

    def run(self, rows: list[list[int]], gen_config, *, max_new_tokens: int, seed: int | None = None,
            targets: list[int] | None = None) -> tuple[list[Any], dict[str, Any]]:
        """Submit every row, collect every result: the outputs in row order and the config that ran. With ``targets``
        each request stops at exactly its own length (EOS id -1 never matches) and frees its blocks then."""
        cb_config = self.config(rows, max_new_tokens, seed)
        if self.persistent:  # a kept manager keeps its sampling settings and seed: rebuild it when they change
            key = (repr(gen_config.to_dict()), repr(sorted(self.overrides.items())))
            if self._key is not None and key != self._key:
                self.close()
            self._key = key
        if self._kept is not None:
            upstream.forget_cached_kv(self._kept)
        loop = self.model.continuous_batching_context_manager(
            block=True, timeout=5, persistent_manager=self.persistent, generation_config=gen_config,
            continuous_batching_config=cb_config,
            workload_hints=upstream.workload_hints(rows, max(targets) if targets else max_new_tokens))
        with self._attention(cb_config), self._own(), loop as manager:
            # The engine shares only pages a finished forward wrote: N copies of a prompt admitted together would all
            # compute it. So each repeated prompt of a page or more is prefilled first, alone (two tokens, discarded).
            page = page_size(cb_config)
            shared = [p for p, n in collections.Counter(map(tuple, rows)).items() if n > 1 and len(p) >= page]
            if upstream.prefix_sharing(manager) and shared:
                with manager.pause():
                    upstream.reseed(manager, seed)
                    prefill = [manager.add_request(list(p), request_id=f"{upstream.HELPER_PREFIX}{k}", max_new_tokens=2,
                                                   eos_token_id=-1) for k, p in enumerate(shared)]
                collect(manager, prefill)
                seed = None  # seeded once per call, before its first request
            with manager.pause():  # all queued while the loop is parked: one drain, so a seeded order of draws
                ids = self.submit(manager, rows, max_new_tokens, seed, targets=targets)
            results = collect(manager, ids)
            resolved = upstream.resolved_config(manager)
        return [results[i] for i in ids], resolved

    def submit(self, manager, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None,
               targets: Sequence[int] | None = None) -> list[str]:
        """Reseed the sampler, then queue `rows`; ids in row order. Call it with the loop paused."""
        upstream.reseed(manager, seed)
        if targets is None:
            return list(manager.add_requests(inputs=[list(r) for r in rows], max_new_tokens=max_new_tokens,
                                             record_timestamps=self.record_timestamps))
        # `add_requests`' order (sorted by prompt when prefix sharing is on: cache hits), one limit per request.
        order = sorted(range(len(rows)), key=lambda i: list(rows[i]), reverse=True) \
            if upstream.prefix_sharing(manager) else range(len(rows))
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
        """Attach this engine's kept manager (or none) for one call, then restore what was there."""
        previous, mine = upstream.attached(self.model), self._kept
        upstream.attach(self.model, mine)
        try:
            yield
        finally:
            kept = upstream.attached(self.model)
            self._kept = kept if self.persistent else None
            upstream.attach(self.model, kept if previous is None or previous is mine else previous)

    def close(self) -> None:
        """Stop a running manager and free this engine's kept one; another engine's is left."""
        if self._stack is not None:
            self._stack.close()
        self._stack = self._running = None
        if self._kept is not None:
            if upstream.attached(self.model) is self._kept:
                upstream.attach(self.model, None)
            self._kept.destroy()
            self._kept = None
        self._key = None

    def start(self, gen_config, rows: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None) -> None:
        """Start a manager sized for `rows` on its thread; it runs until `close`."""
        self.close()
        cb_config = self.config(rows, max_new_tokens, seed)
        stack = contextlib.ExitStack()
        stack.enter_context(self._attention(cb_config))
        self._running = stack.enter_context(self.model.continuous_batching_context_manager(
            block=True, timeout=5, warmup=False, generation_config=gen_config, continuous_batching_config=cb_config,
            workload_hints=upstream.workload_hints(rows, max_new_tokens)))
        self._stack = stack
        weakref.finalize(self, stack.close)  # the engine thread is not a daemon: never leave it running at exit


def to_completions(rows: Sequence[Sequence[int]], outputs: Sequence[Any], num_generations: int,
                   sampling: SamplingParams, targets: Sequence[int] | None = None) -> list[Completion]:
    """One `Completion` per row (rows in group order), cut at EOS, the limit or the row's target."""
    completions = []
    for i, (row, out) in enumerate(zip(rows, outputs, strict=True)):
        keep, reason = cut_completion(out.generated_tokens, sampling, targets[i] if targets else None)
        completions.append(Completion(
            group=i // num_generations, prompt_ids=tuple(row), completion_ids=tuple(out.generated_tokens[:keep]),
            sampling_logprobs=tuple(float(x) for x in out.logprobs[:keep]), finish_reason=reason))
    return completions


def timeline(outputs: Sequence[Any], completions: Sequence[Completion], t0: float, resolved: Mapping[str, Any],
             swaps: Sequence[tuple[float, int]] | None = None) -> dict[str, Any]:
    """Engine clocks per request (`cbkit.teach.figures.async_timeline` reads them), with policy versions if any."""
    requests = []
    for i, (out, c) in enumerate(zip(outputs, completions, strict=True)):
        start, end = out.lifespan  # start: when it left PENDING (a prefix-cache match does that before it is scheduled)
        request = {"id": i, "engine_id": str(out.request_id), "group": c.group, "prompt_len": len(c.prompt_ids),
                   "start": start, "end": end, "token_times": list(out.timestamps or [])[: len(c.completion_ids)]}
        if c.policy_versions is not None:
            request["token_versions"] = list(c.policy_versions)
        requests.append(request)
    out = {"page_size": resolved.get("page_size"), "pool_blocks": resolved.get("num_blocks"), "t0": t0,
           "prefix_sharing": bool(resolved.get("allow_block_sharing", False)), "requests": requests}
    if swaps is not None:
        out["swaps"] = list(swaps)
    return out


def engine_is_idle(model) -> bool:
    """True when no CB engine runs on the model and its attention is its own again (a stopped kept one is idle)."""
    manager = upstream.attached(model)
    running = manager is not None and manager.is_running()
    return not running and not str(model.config._attn_implementation).startswith("paged")

