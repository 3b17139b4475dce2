"""What transformers' CB engine scheduled, step by step: an opt-in recorder.

Per forward and request: its query tokens, from which position, and its block table (`upstream.watch_batches`).
`EngineTrace` reads from them who waited, which block passed between requests (recycling) and who was restarted.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from cbkit.rollout.upstream import ScheduledRequest, watch_batches

__all__ = ["BlockReuse", "EngineStep", "EngineTrace", "RequestLife", "ScheduledRequest", "record_engine_steps"]


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
    """One request's life in engine steps (indices into ``EngineTrace.steps``)."""

    request_id: str
    helper: bool
    first_step: int  # its admission
    first_token_step: int | None  # the step whose forward completed its prompt and sampled its first token
    last_step: int
    skipped: tuple[int, ...]  # steps between first and last it was left out of: it waited (starved or offloaded)


@dataclass
class EngineTrace:
    """Every step the engine scheduled inside ``record_engine_steps``, and the pool it scheduled them into."""

    steps: list[EngineStep] = field(default_factory=list)
    pool_blocks: int | None = None
    page_size: int | None = None

    def _appearances(self) -> dict[str, list[tuple[int, ScheduledRequest]]]:
        seen: dict[str, list[tuple[int, ScheduledRequest]]] = {}
        for step in self.steps:
            for r in step.requests:
                seen.setdefault(r.request_id, []).append((step.index, r))
        return seen

    def lives(self) -> dict[str, RequestLife]:
        """request -> its `RequestLife`, in the order the engine first scheduled them."""
        out = {}
        for rid, apps in self._appearances().items():
            idx = [i for i, _ in apps]
            token = next((i for i, r in apps if r.past_len + r.query_len >= r.prompt_len), None)
            skipped = tuple(sorted(set(range(idx[0], idx[-1] + 1)) - set(idx)))
            out[rid] = RequestLife(rid, apps[0][1].helper, idx[0], token, idx[-1], skipped)
        return out

    def blocks_in_use(self) -> list[int]:
        """Blocks held at each step, a shared one once: a waiting request keeps its last table, an offloaded none."""
        held_at: dict[int, set[int]] = {step.index: set() for step in self.steps}
        for apps in self._appearances().values():
            for (i, r), nxt in zip(apps, [*apps[1:], None], strict=True):
                # offloaded when it comes back at a lower position: it held nothing until then
                end = i + 1 if nxt is None or nxt[1].past_len < r.past_len + r.query_len else nxt[0]
                for k in range(i, end):
                    held_at[k] |= set(r.blocks)
        return [len(held_at[step.index]) for step in self.steps]

    def restarts(self) -> dict[str, int]:
        """request -> KV tokens it computed again after the engine offloaded it; requests never restarted absent."""
        again: dict[str, int] = {}
        for rid, apps in self._appearances().items():
            for (_, r), (_, later) in itertools.pairwise(apps):
                if later.past_len < r.past_len + r.query_len:
                    again[rid] = again.get(rid, 0) + r.past_len + r.query_len - later.past_len
        return again

    def reuses(self) -> list[BlockReuse]:
        """Each time a block passed to a request after its previous holder released it: recycling. Not sharing (held
        at once), nor a cached prompt page handed to a request of the same prompt at the same place (the same KV)."""
        held: dict[str, dict[int, tuple[int, int, int]]] = {}  # request -> block -> (first, last step, position)
        for step in self.steps:
            for r in step.requests:
                mine = held.setdefault(r.request_id, {})
                for pos, b in enumerate(r.blocks):
                    mine[b] = (mine.get(b, (step.index,))[0], step.index, pos)
        info = {r.request_id: (r.prompt_hash, r.prompt_len) for step in self.steps for r in step.requests}
        page = self.page_size or 0
        spans = sorted((first, last, pos, b, rid) for rid, blocks in held.items()
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
    trace = EngineTrace()

    def record(requests: list[ScheduledRequest], pool_blocks: int, page_size: int) -> None:
        trace.steps.append(EngineStep(len(trace.steps), time.perf_counter(), tuple(requests)))
        trace.pool_blocks, trace.page_size = pool_blocks, page_size

    with watch_batches(record):
        yield trace
