"""What goes into the CB engine and what comes out of it: the workload hints a call hands it, the settings it
resolved, what each step scheduled, and its outputs turned into cbkit's `Completion`s and timeline.

Part of the engine: this module reads transformers' CB internals, listed in `cbkit/rollout/engine.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from cbkit.rollout.base import Completion, SamplingParams, cut_completion

# cbkit's own requests to the engine that are not completions: the prefill of each shared prompt `Engine.run` submits
# before the completions (two thrown-away tokens). Their ids start with this, so a trace, a finding or a figure can
# tell them from the completions a rollout asked for.
HELPER_PREFIX = "cbkit-prefill-"


def is_helper(request_id: str) -> bool:
    """True for a request cbkit submitted for its own purposes (a shared prompt's prefill), not a completion."""
    return str(request_id).startswith(HELPER_PREFIX)


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

    # Patching upstream's method on the class is the point here (mypy's method-assign forbids it in general).
    ContinuousBatchProcessor.prepare_next_batch = prepare_next_batch  # type: ignore[method-assign]
    try:
        yield
    finally:
        ContinuousBatchProcessor.prepare_next_batch = original  # type: ignore[method-assign]


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
        # "start" is the engine's lifespan[0]: when the request left PENDING, which a prefix-cache match does even in
        # a step that then fails to schedule it; who was scheduled when is in the engine trace, under "engine_id".
        request = {"id": i, "engine_id": str(out.request_id), "group": c.group, "prompt_len": len(c.prompt_ids),
                   "start": start, "end": end,
                   "token_times": list(out.timestamps or [])[: len(c.completion_ids)]}
        if c.policy_versions is not None:
            request["token_versions"] = list(c.policy_versions)
        requests.append(request)
    out = {"page_size": resolved.get("page_size"), "pool_blocks": resolved.get("num_blocks"), "t0": t0,
           "prefix_sharing": bool(resolved.get("allow_block_sharing", False)), "requests": requests}
    if swaps is not None:
        out["swaps"] = list(swaps)
    return out
