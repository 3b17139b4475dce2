"""What transformers' CB engine scheduled, step by step, read from the engine itself: an opt-in recorder.

The timeline (``record_timestamps``) says when each request ran, not what one forward held nor which KV blocks a
request used; `record_engine_steps` reads both inside the engine (`upstream.watch_batches`), for every batch scheduled
inside its ``with`` block, in whatever thread the engine runs. Per step and request: the query tokens it brought and
from which position (a prefill chunk, or one decode token), packed back to back without padding, and its block table
as it stands after this step's allocation. From those, `EngineTrace` reads who was admitted when, who waited, which
block passed from a finished request to another (recycling) and who was offloaded and restarted. Requests whose ids
start with `cbkit.rollout.engine.HELPER_PREFIX` (the first prefill of a shared prompt) are marked ``helper``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cbkit.rollout.engine import is_helper
from cbkit.rollout.upstream import watch_batches

__all__ = ["BlockReuse", "EngineStep", "EngineTrace", "RequestLife", "ScheduledRequest", "record_engine_steps"]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of one engine step."""

    request_id: str
    prompt_len: int
    prompt_hash: int  # the same for the N requests of one prompt
    past_len: int  # tokens already in its KV cache before this step
    query_len: int  # tokens it brings to this step's forward: a prefill chunk, or 1 when decoding
    blocks: tuple[int, ...]  # the engine's block ids this request reads and writes, in order

    @property
    def phase(self) -> str:
        return "prefill" if self.past_len < self.prompt_len else "decode"

    @property
    def helper(self) -> bool:
        """cbkit's own prefill of a shared prompt, not a completion (`cbkit.rollout.engine.HELPER_PREFIX`)."""
        return is_helper(self.request_id)


@dataclass(frozen=True)
class EngineStep:
    index: int
    t: float  # perf_counter seconds when the batch was scheduled
    requests: tuple[ScheduledRequest, ...]  # in the order the engine packed them

    @property
    def tokens(self) -> int:
        return sum(r.query_len for r in self.requests)


@dataclass(frozen=True)
class BlockReuse:
    """A block one request held and released, later held by another: recycling, as the engine did it."""

    block: int
    released_by: str
    last_step: int  # the last step the first request held it
    taken_by: str
    first_step: int  # the first step the second request held it


@dataclass(frozen=True)
class RequestLife:
    """One request's life as the scheduler lived it, in engine steps (indices into ``EngineTrace.steps``)."""

    request_id: str
    helper: bool
    first_step: int  # the first step that gave it query tokens: its admission
    first_token_step: int | None  # the step whose forward completed its prompt and sampled its first token
    last_step: int  # the last step it was in: it finished (or the recording ended) after this one
    skipped: tuple[int, ...]  # steps between first and last it was left out of: it waited (starved or offloaded)


@dataclass
class EngineTrace:
    """Every step the engine scheduled inside ``record_engine_steps``, and the pool it scheduled them into."""

    steps: list[EngineStep] = field(default_factory=list)
    pool_blocks: int | None = None
    page_size: int | None = None

    def mixed_step(self) -> EngineStep:
        """The step that best shows the packing: prefill chunks next to decode tokens, most requests first."""
        if not self.steps:
            raise ValueError("the trace has no step: run the engine inside `with record_engine_steps() as trace:`.")

        def score(step: EngineStep) -> tuple[int, int, int]:
            phases = {r.phase for r in step.requests}
            return (len(phases), len(step.requests), step.tokens)

        return max(self.steps, key=score)

    def lives(self) -> dict[str, RequestLife]:
        """request -> its `RequestLife`, in the order the engine first scheduled them."""
        seen: dict[str, list[int]] = {}
        token: dict[str, int] = {}
        helper: dict[str, bool] = {}
        for step in self.steps:
            for r in step.requests:
                seen.setdefault(r.request_id, []).append(step.index)
                helper[r.request_id] = r.helper
                if r.request_id not in token and r.past_len + r.query_len >= r.prompt_len:
                    token[r.request_id] = step.index
        out = {}
        for rid, idx in seen.items():
            present = set(idx)
            skipped = tuple(i for i in range(idx[0], idx[-1] + 1) if i not in present)
            out[rid] = RequestLife(rid, helper[rid], idx[0], token.get(rid), idx[-1], skipped)
        return out

    def blocks_in_use(self) -> list[int]:
        """Blocks held by some request's block table at each step: the table it was last scheduled with, from its
        first step to its last (a request that waits keeps its blocks), none while it was offloaded (from the step
        after its last one before a restart from a lower position, to the restart). A shared page counts once.
        Blocks the prefix cache keeps for no running request are not counted: the engine evicts them for room."""
        seen: dict[str, list[tuple[int, ScheduledRequest]]] = {}
        for step in self.steps:
            for r in step.requests:
                seen.setdefault(r.request_id, []).append((step.index, r))
        held_at: dict[int, set[int]] = {step.index: set() for step in self.steps}
        for apps in seen.values():
            for (i, r), nxt in zip(apps, [*apps[1:], None], strict=True):
                if nxt is None:
                    held_at[i] |= set(r.blocks)
                    continue
                j, later = nxt
                offloaded = later.past_len < r.past_len + r.query_len  # it restarts at j: nothing held before j
                for k in range(i, i + 1 if offloaded else j):
                    held_at[k] |= set(r.blocks)
        return [len(held_at[step.index]) for step in self.steps]

    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON-ready data (`from_dict` reads it back): a run recorded once, read again in a test."""
        return {"pool_blocks": self.pool_blocks, "page_size": self.page_size,
                "steps": [{"index": s.index, "t": s.t, "requests": [
                    [r.request_id, r.prompt_len, r.prompt_hash, r.past_len, r.query_len, list(r.blocks)]
                    for r in s.requests]} for s in self.steps]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineTrace:
        steps = [EngineStep(s["index"], s["t"], tuple(ScheduledRequest(rid, n, h, past, q, tuple(blocks))
                                                      for rid, n, h, past, q, blocks in s["requests"]))
                 for s in data["steps"]]
        return cls(steps=steps, pool_blocks=data.get("pool_blocks"), page_size=data.get("page_size"))

    def restarts(self) -> dict[str, int]:
        """request -> KV tokens it had to compute again: under memory pressure the engine offloads a running
        request (its blocks go back to the pool) and later prefills its prompt and the tokens it had generated
        again, from position 0. Requests never restarted are absent."""
        reached: dict[str, int] = {}
        again: dict[str, int] = {}
        for step in self.steps:
            for r in step.requests:
                before = reached.get(r.request_id, 0)
                if r.past_len < before:
                    again[r.request_id] = again.get(r.request_id, 0) + before - r.past_len
                reached[r.request_id] = r.past_len + r.query_len
        return again

    def holdings(self) -> dict[str, dict[int, tuple[int, int, int]]]:
        """request -> block -> (first step, last step, position in its block table) for every block the
        request's block table held."""
        held: dict[str, dict[int, tuple[int, int, int]]] = {}
        for step in self.steps:
            for r in step.requests:
                mine = held.setdefault(r.request_id, {})
                for pos, b in enumerate(r.blocks):
                    first, _, _ = mine.get(b, (step.index, step.index, pos))
                    mine[b] = (first, step.index, pos)
        return held

    def reuses(self) -> list[BlockReuse]:
        """Each time a block passed to a request after the previous holder had stopped holding it, to hold
        other tokens: recycling. Not counted: a block two requests hold at once (prefix sharing), and a prompt
        page found again in the engine's prefix cache by a request of the same prompt at the same place (the
        same KV, kept, not recycled)."""
        info = {r.request_id: (r.prompt_hash, r.prompt_len) for step in self.steps for r in step.requests}
        page = self.page_size or 0
        spans = sorted((first, last, pos, b, rid) for rid, blocks in self.holdings().items()
                       for b, (first, last, pos) in blocks.items())
        last_holder: dict[int, tuple[str, int, int]] = {}
        out = []
        for first, last, pos, b, rid in spans:
            prev = last_holder.get(b)
            if prev is not None and prev[0] != rid and prev[1] < first:
                (h0, n0), (h1, _) = info[prev[0]], info[rid]
                cached_prompt_page = h0 == h1 and pos == prev[2] and page and pos < n0 // page
                if not cached_prompt_page:
                    out.append(BlockReuse(b, prev[0], prev[1], rid, first))
            if prev is None or last > prev[1]:
                last_holder[b] = (rid, last, pos)
        return out


@contextlib.contextmanager
def record_engine_steps() -> Iterator[EngineTrace]:
    """Record every batch transformers' CB engine schedules inside the block (see the module docstring)."""
    trace = EngineTrace()

    def record(requests, pool_blocks: int, page_size: int) -> None:
        trace.steps.append(EngineStep(index=len(trace.steps), t=time.perf_counter(), requests=tuple(
            ScheduledRequest(request_id=r.request_id, prompt_len=len(r.prompt), prompt_hash=hash(r.prompt),
                             past_len=r.past_len, query_len=r.query_len, blocks=r.blocks) for r in requests)))
        trace.pool_blocks, trace.page_size = pool_blocks, page_size

    with watch_batches(record):
        yield trace
