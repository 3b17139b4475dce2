"""What transformers' CB engine scheduled, step by step (`record_engine_steps`): who waited, which block passed
between requests (recycling) and who was restarted, read from each step's requests and block tables."""

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
class BlockReuse:  # a block one request held and released, later held by another: recycling
    block: int
    released_by: str
    last_step: int  # the last step the first request held it
    taken_by: str
    first_step: int  # the first step the second request held it


@dataclass(frozen=True)
class RequestLife:  # in engine steps, indices into `EngineTrace.steps`
    request_id: str
    helper: bool
    first_step: int  # its admission
    first_token_step: int | None  # the step whose forward completed its prompt and sampled its first token
    last_step: int
    skipped: tuple[int, ...]  # steps between first and last it was left out of: it waited (starved or offloaded)


@dataclass
class EngineTrace:  # every step the engine scheduled inside `record_engine_steps`, and its pool
    steps: list[EngineStep] = field(default_factory=list)
    pool_blocks: int | None = None
    page_size: int | None = None

    def _appearances(self) -> dict[str, list[tuple[int, ScheduledRequest]]]:
        seen: dict[str, list[tuple[int, ScheduledRequest]]] = {}
        for step in self.steps:
            for r in step.requests:
                seen.setdefault(r.request_id, []).append((step.index, r))
        return seen

    def lives(self) -> dict[str, RequestLife]:  # in the order the engine first scheduled them
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

    def scheduler_inputs(self, token_budget: int, max_requests: int) -> list[tuple[int, tuple, list]]:
        """Per step: its index, what the scheduler chose from as `(candidates, token_budget, read_budget, max_requests)`,
        and what the engine scheduled (notebook 01's `schedule_step` exercise is graded on these).
        Candidates in `FIFOScheduler.schedule_batch`'s order: decoding, prefilling, then waiting ones in arrival order
        (cbkit's prefill helpers first); `fits` is False for one left out although both budgets had room."""
        assert self.pool_blocks and self.page_size, "no step recorded"
        read = self.pool_blocks * self.page_size  # the engine's cache read budget: the pool's tokens
        lives = self.lives()  # in the order first scheduled
        start = {r.request_id: r for s in reversed(self.steps) for r in s.requests}  # each request at its first step
        prompt = {rid: r.prompt_len for rid, r in start.items()}

        def arrival(rid: str) -> tuple[bool, int]:
            return (not lives[rid].helper, int(rid.replace("-", "_").rsplit("_", 1)[1]))

        helpers_done = 1 + max((life.last_step for life in lives.values() if life.helper), default=-1)
        reached: dict[str, int] = {}
        out = []
        for s in self.steps:
            alive = [rid for rid, life in lives.items() if rid in reached and life.last_step >= s.index]
            ordered = [(rid, reached[rid], 1) for rid in alive if reached[rid] >= prompt[rid]]
            ordered += [(rid, reached[rid], prompt[rid] - reached[rid]) for rid in alive if reached[rid] < prompt[rid]]
            ordered += [(rid, start[rid].past_len, prompt[rid] - start[rid].past_len) for rid in sorted(lives, key=arrival)
                        if lives[rid].first_step >= s.index and (lives[rid].helper or s.index >= helpers_done)]
            got = {r.request_id: r.query_len for r in s.requests}
            candidates, tokens, reads, n = [], token_budget, read, 0
            for rid, past, wants in ordered:
                open_ = tokens > 0 and reads > 0 and n < max_requests
                candidates.append((rid, past, wants, rid in got or not (open_ and reads >= past)))
                if rid in got and open_:
                    tokens, reads, n = tokens - got[rid], reads - past, n + 1
            out.append((s.index, (candidates, token_budget, read, max_requests), [(r.request_id, r.query_len)
                                                                                  for r in s.requests]))
            reached.update({r.request_id: r.past_len + r.query_len for r in s.requests})
        return out


@contextlib.contextmanager
def record_engine_steps() -> Iterator[EngineTrace]:
    trace = EngineTrace()

    def record(requests: list[ScheduledRequest], pool_blocks: int, page_size: int) -> None:
        trace.steps.append(EngineStep(len(trace.steps), time.perf_counter(), tuple(requests)))
        trace.pool_blocks, trace.page_size = pool_blocks, page_size

    with watch_batches(record):
        yield trace
