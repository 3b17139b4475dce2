"""The findings notebook 01 prints about waiting, admission, hand-over and overlap, read from the engine's own record,
on a recorded CB rollout of the tiny model (tests/data/engine_trace_tiny_waits.json; `python
tests/test_engine_findings.py` records it again) where the naive readings are wrong: the engine's ``lifespan[0]``
says every request started before the first one finished, and the first block hand-over in the record is from
cbkit's helper prefill of a shared prompt, not from a completion. Each check compares against a clock the finding
does not read: the engine's per-token timestamps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cbkit.rollout.engine import is_helper
from cbkit.rollout.engine_trace import EngineTrace
from cbkit.teach import findings
from cbkit.teach.figures_engine import block_ids_figure, timeline_figure

DATA = Path(__file__).parent / "data" / "engine_trace_tiny_waits.json"


@pytest.fixture(scope="module")
def recorded():
    data = json.loads(DATA.read_text())
    return EngineTrace.from_dict(data["trace"]), data["timeline"]


def _first_end(timeline):
    return min(r["end"] for r in timeline["requests"])


def test_the_recording_is_one_where_lifespan_says_nobody_waited(recorded):
    """The trap the findings must not fall into: by lifespan[0] every request started before the first ended,
    while the per-token clocks show requests whose first token came after it."""
    trace, timeline = recorded
    end = _first_end(timeline)
    assert all(r["start"] < end for r in timeline["requests"])
    assert any(r["token_times"][0] > end for r in timeline["requests"])
    assert any(is_helper(r.request_id) for s in trace.steps for r in s.requests)


def test_admission_is_read_from_the_scheduler_not_from_lifespan(recorded):
    trace, timeline = recorded
    text = findings.timeline_findings(timeline, trace)
    assert "none waited" not in text and "All 8" not in text
    m = re.search(r"(\d+) of 8 completions were first scheduled only after another had finished \((\S+), at step",
                  text)
    assert m, text
    # Every completion first scheduled after the first one finished got its first token after that one's end, by the
    # engine's per-token clock; and as many got their first token that late.
    lives = trace.lives()
    first_done = min((life for life in lives.values() if not life.helper), key=lambda life: life.last_step)
    assert first_done.request_id == m.group(2)
    late = {life.request_id for life in lives.values() if not life.helper and life.first_step > first_done.last_step}
    by_engine = {r["engine_id"]: r for r in timeline["requests"]}
    end = by_engine[first_done.request_id]["end"]
    assert len(late) == int(m.group(1)) > 0
    assert all(by_engine[rid]["token_times"][0] > end for rid in late)
    assert "2 cbkit helper requests" in text  # counted apart from the 8 completions


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


def test_the_first_hand_over_named_is_from_a_finished_completion(recorded):
    trace, timeline = recorded
    reuses = trace.reuses()
    earliest = min(reuses, key=lambda r: (r.first_step, r.block))
    assert is_helper(earliest.released_by)  # what the old finding named as the first recycling
    text = findings.engine_trace_findings(trace)
    helpers = sum(is_helper(r.released_by) for r in reuses)
    assert f"{helpers} of them from cbkit's helper prefills" in text
    m = re.search(r"The first from a completion: block (\d+), held by (\S+) until step (\d+), taken by (\S+) at step "
                  r"(\d+)", text)
    assert m, text
    released_by = m.group(2)
    assert not is_helper(released_by)
    completion = {r["engine_id"]: r for r in timeline["requests"]}[released_by]  # a completion the rollout returned
    taker = {r["engine_id"]: r for r in timeline["requests"]}.get(m.group(4))
    # it was handed on after its holder's last token, by the engine's clock
    assert taker is None or completion["token_times"][-1] < taker["token_times"][-1]


def test_the_figures_label_helpers_and_start_bars_at_the_scheduled_step(recorded):
    trace, timeline = recorded
    fig = block_ids_figure(trace)
    lines = [t for t in fig.data if t.mode == "lines"]
    helpers = [t for t in lines if "cbkit helper" in t.name]
    assert len(helpers) == 2 and len({t.line.color for t in helpers}) == 1
    completions = [t for t in lines if t not in helpers]
    assert len(completions) == 8 and len({t.line.color for t in completions}) == 8  # one colour each
    assert helpers[0].line.color not in {t.line.color for t in completions}
    assert all(t.showlegend is not False for t in lines)
    tl = timeline_figure(timeline, trace=trace)
    first = {}
    for s in trace.steps:
        for r in s.requests:
            first.setdefault(r.request_id, s.t)
    bars = [t for t in tl.data if t.type == "bar" and t.name.startswith("group")]
    starts = {rid: b for t in bars for rid, b in zip(t.y, t.base, strict=True)}
    for r in timeline["requests"]:
        assert starts[r["id"]] == pytest.approx(first[r["engine_id"]] - timeline["t0"])
    moved = [r for r in timeline["requests"] if first[r["engine_id"]] - r["start"] > 1e-4]
    assert moved  # where lifespan[0] had them started before the scheduler gave them a token


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
    path.write_text(json.dumps({"trace": trace.to_dict(), "timeline": rollout.timeline}))


if __name__ == "__main__":
    _record()
