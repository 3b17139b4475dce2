"""What notebook 01 reads from the engine's own record, on a recorded CB rollout of the tiny model
(tests/data/engine_trace_tiny_waits.json; `python tests/test_engine_findings.py` records it again) where the naive
readings are wrong: the engine's ``lifespan[0]`` says every request started before the first one finished, and the
first block hand-over in the record is from cbkit's helper prefill of a shared prompt, not from a completion. Each
check compares against what the reading does not use: the engine's per-token timestamps, or the steps it took."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbkit.rollout.engine_trace import EngineStep, EngineTrace, ScheduledRequest
from scripts import solutions

DATA = Path(__file__).parent / "data" / "engine_trace_tiny_waits.json"


@pytest.fixture(scope="module")
def recorded():
    data = json.loads(DATA.read_text())
    trace = data["trace"]  # steps of [request_id, prompt_len, prompt_hash, past_len, query_len, blocks]
    steps = [EngineStep(s["index"], s["t"], tuple(ScheduledRequest(rid, n, h, past, q, tuple(blocks))
                                                  for rid, n, h, past, q, blocks in s["requests"]))
             for s in trace["steps"]]
    return EngineTrace(steps, trace["pool_blocks"], trace["page_size"]), data["timeline"]


def _first_end(timeline):
    return min(r["end"] for r in timeline["requests"])


def test_the_recording_is_one_where_lifespan_says_nobody_waited(recorded):
    """The trap the findings must not fall into: by lifespan[0] every request started before the first ended,
    while the per-token clocks show requests whose first token came after it."""
    trace, timeline = recorded
    end = _first_end(timeline)
    assert all(r["start"] < end for r in timeline["requests"])
    assert any(r["token_times"][0] > end for r in timeline["requests"])
    assert any(r.helper for s in trace.steps for r in s.requests)


def test_each_life_agrees_with_the_engines_token_clock(recorded):
    """The step a life says sampled a request's first token was scheduled before that token's timestamp, and the
    next step after it; a step it says the request was left out of does not hold it."""
    trace, timeline = recorded
    lives = trace.lives()
    for r in timeline["requests"]:
        life = lives[r["engine_id"]]
        i = life.first_token_step
        assert trace.steps[i].t < r["token_times"][0]
        if i + 1 < len(trace.steps):
            assert r["token_times"][0] < trace.steps[i + 1].t
        for k in life.skipped:
            assert r["engine_id"] not in {q.request_id for q in trace.steps[k].requests}
    assert any(life.skipped for life in lives.values())


def test_blocks_in_use_stay_within_the_pool_and_cover_every_scheduled_table(recorded):
    trace, _ = recorded
    held = trace.blocks_in_use()
    for step, n in zip(trace.steps, held, strict=True):
        assert len({b for r in step.requests for b in r.blocks}) <= n <= trace.pool_blocks
    # The timestamp model (cbkit.telemetry.occupancy) is what said "above the pool": the engine's tables never were.
    assert max(held) <= trace.pool_blocks


def test_the_first_hand_over_is_from_a_helper_and_completions_hand_over_too(recorded):
    trace, timeline = recorded
    reuses = trace.reuses()
    lives = trace.lives()
    assert lives[min(reuses, key=lambda r: (r.first_step, r.block)).released_by].helper
    ends = {r["engine_id"]: r["token_times"][-1] for r in timeline["requests"]}
    takers = {r["engine_id"]: r["token_times"][0] for r in timeline["requests"]}
    handed = [r for r in reuses if not lives[r.released_by].helper]
    assert handed  # a finished completion's block went to another request, after its last token by the engine's clock
    assert all(ends[r.released_by] < takers.get(r.taken_by, float("inf")) or r.taken_by not in takers
               or ends[r.released_by] < ends[r.taken_by] for r in handed)


def test_the_engines_steps_are_the_fifo_rule_with_its_read_budget(recorded):
    """Every recorded step is what 01's exercise answer (decode first, the token budget, the read budget of
    page_size x num_blocks tokens paid in past_len) chooses from the candidates rebuilt from the record; and in some
    step the reads exceed the blocks held: a shared prompt page is read once per request, so the read budget can bind
    while blocks are free."""
    trace, _ = recorded
    steps = trace.scheduler_inputs(token_budget=8192, max_requests=10**6)
    assert len(steps) == len(trace.steps)
    for i, args, engine in steps:
        assert solutions.schedule_step(*args) == engine, f"step {i}"
    held = trace.blocks_in_use()
    reads = [sum(r.past_len for r in s.requests) for s in trace.steps]
    assert any(read > h * trace.page_size for read, h in zip(reads, held, strict=True))


def _record(path: Path = DATA) -> None:
    """Record the fixture: 8 completions of two 89-token prompts, pages of 16, a pool for a quarter of them."""
    from cbkit.models.load import load_policy
    from cbkit.rollout import SamplingParams
    from cbkit.rollout.continuous import ContinuousBackend
    from cbkit.rollout.engine_config import workload_blocks
    from cbkit.rollout.engine_trace import record_engine_steps

    tiny = load_policy("tiny", seed=0, device="cpu")
    tok = tiny.tokenizer
    prompts = [tok.encode("Tom has 3 apples and buys 4 more apples at the market. How many apples does Tom have now?"),
               tok.encode("A train leaves at noon and travels 60 miles per hour for three hours. How far does it go?")]
    rows = [p for p in prompts for _ in range(4)]
    sp = SamplingParams(max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    backend = ContinuousBackend(tiny.model, {"page_size": 16, "num_blocks": workload_blocks(rows[:2], 24, 16)},
                                record_timestamps=True)
    with record_engine_steps() as trace:
        rollout = backend.generate(prompts, 4, sp, target_lengths=[4 + (7 * i) % 20 for i in range(len(rows))])
    steps = [{"index": s.index, "t": s.t, "requests": [[r.request_id, r.prompt_len, r.prompt_hash, r.past_len,
                                                        r.query_len, list(r.blocks)] for r in s.requests]}
             for s in trace.steps]
    data = {"trace": {"pool_blocks": trace.pool_blocks, "page_size": trace.page_size, "steps": steps},
            "timeline": rollout.timeline}
    path.write_text(json.dumps(data))


if __name__ == "__main__":
    _record()
