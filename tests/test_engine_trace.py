"""cbkit.rollout.engine_trace against the engine it reads: a real CB rollout of the tiny model, checked with the
rollout's own counts (tokens generated, prompt lengths) and the paging rule, and the recycling rule on a trace
worked by hand. The recorder reads transformers internals; these tests are where an upgrade that moves them
fails."""

from __future__ import annotations

import pytest

from cbkit.rollout import SamplingParams
from cbkit.rollout.continuous import ContinuousBackend
from cbkit.rollout.engine_config import workload_blocks
from cbkit.rollout.engine_trace import EngineStep, EngineTrace, ScheduledRequest, record_engine_steps
from cbkit.rollout.upstream import HELPER_PREFIX

PAGE = 16


def _run(tiny, prompts, n, pool, **cb):
    tok = tiny.tokenizer
    sp = SamplingParams(max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    targets = [4 + (7 * i) % 20 for i in range(len(prompts) * n)]  # 4..23 tokens, spread, all below the limit
    backend = ContinuousBackend(tiny.model, {"page_size": PAGE, "num_blocks": pool, **cb})
    with record_engine_steps() as trace:
        rollout = backend.generate(prompts, n, sp, target_lengths=targets)
    return rollout, trace


@pytest.fixture(scope="module")
def prompts(tiny):
    enc = tiny.tokenizer
    return [enc.encode("Tom has 3 apples and buys 4 more. How many now?"), enc.encode("what is 12 + 30, twice?")]


def test_the_trace_accounts_for_every_token_the_rollout_has(tiny, prompts):
    """No prefix sharing, so each request computes its whole prompt and then one token a step: every query token
    the trace saw is a prompt token, a completion token but the last (sampled, never fed back), or a token the
    engine computed again after offloading the request (this pool is small enough that it does)."""
    rows = [p for p in prompts for _ in range(4)]
    rollout, trace = _run(tiny, prompts, 4, workload_blocks(rows[:3], 24, PAGE), allow_block_sharing=False)
    ids = {r.request_id for s in trace.steps for r in s.requests}
    assert len(ids) == len(rows)
    queried = sum(r.query_len for s in trace.steps for r in s.requests)
    again = trace.restarts()
    assert queried - sum(again.values()) == sum(len(p) for p in rows) + rollout.completion_tokens - len(rows)
    assert again, "the pool was meant to force an offload; with none this test checks less than it says"
    assert trace.pool_blocks == rollout.engine_config["num_blocks"] and trace.page_size == PAGE
    for step in trace.steps:
        held = [b for r in step.requests for b in r.blocks]
        assert len(held) == len(set(held)), f"step {step.index}: two requests hold one block without sharing"
        for r in step.requests:  # the engine allocated exactly the pages the tokens so far fill
            assert len(r.blocks) == -(-(r.past_len + r.query_len) // PAGE)
            assert r.query_len == 1 or r.phase == "prefill"
        assert len({b for b in held}) <= trace.pool_blocks


def test_a_pool_smaller_than_the_workload_recycles_blocks(tiny, prompts):
    """8 requests need more blocks than a pool for 3 of them at full length: some block ids must pass from a
    finished request to another, and each hand-over comes after its first holder's last step."""
    rows = [p for p in prompts for _ in range(4)]
    _, trace = _run(tiny, prompts, 4, workload_blocks(rows[:3], 24, PAGE), allow_block_sharing=False)
    reuses = trace.reuses()
    assert reuses
    last_seen = {r.request_id: s.index for s in trace.steps for r in s.requests}
    again = trace.restarts()
    for r in reuses:
        assert r.last_step < r.first_step and r.released_by != r.taken_by
        # it released the block by finishing, or by being offloaded (and computed again later)
        assert last_seen[r.released_by] == r.last_step or r.released_by in again
    assert any(last_seen[r.released_by] == r.last_step for r in reuses)  # a finished request's block, reused
    # a later prompt joined decoding requests in one step
    assert any({r.phase for r in s.requests} == {"prefill", "decode"} for s in trace.steps)


def test_cbkits_helper_prefills_are_named_and_the_timeline_points_into_the_trace(tiny, prompts):
    """With prefix sharing cbkit prefills each shared prompt first, alone: the trace shows one helper per prompt,
    named so, computing the whole prompt before any completion is scheduled; the completions are the rollout's rows,
    and each timeline request names its engine id."""
    tok = tiny.tokenizer
    sp = SamplingParams(max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    long = [p * 3 for p in prompts]  # at least one complete page of 16, so the prompt is worth sharing
    backend = ContinuousBackend(tiny.model, {"page_size": PAGE}, record_timestamps=True)
    with record_engine_steps() as trace:
        rollout = backend.generate(long, 2, sp)
    lives = trace.lives()
    helpers = [life for life in lives.values() if life.helper]
    assert sorted(h.request_id for h in helpers) == ["cbkit-prefill-0", "cbkit-prefill-1"]
    assert all(h.request_id.startswith(HELPER_PREFIX) for h in helpers)
    first_completion = min(life.first_step for life in lives.values() if not life.helper)
    assert all(h.first_token_step < first_completion for h in helpers)
    completions = {life.request_id for life in lives.values() if not life.helper}
    assert completions == {r["engine_id"] for r in rollout.timeline["requests"]} and len(completions) == 4


def _req(rid, blocks, prompt=1, prompt_len=32, past=40):
    return ScheduledRequest(rid, prompt_len, prompt, past, 1, tuple(blocks))


def test_reuses_by_hand_sharing_and_cached_prompt_pages_are_not_recycling():
    """Pages of 16, prompts of 32 tokens (2 complete pages). a and b share prompt pages 7 and 8 (held at once:
    sharing). a ends after step 1; c, of the same prompt, finds 7 at the same place (the prefix cache: the same
    KV) and takes 9, a's private page, for its own tokens: one recycling. d, another prompt, takes 8 at page 0:
    a second one."""
    steps = [EngineStep(0, 0.0, (_req("a", [7, 8, 9]), _req("b", [7, 8, 5]))),
             EngineStep(1, 0.1, (_req("a", [7, 8, 9]), _req("b", [7, 8, 5]))),
             EngineStep(2, 0.2, (_req("c", [7, 3, 9]),)),
             EngineStep(3, 0.3, (_req("d", [8], prompt=2),))]
    trace = EngineTrace(steps=steps, pool_blocks=10, page_size=16)
    got = sorted((r.block, r.taken_by, r.first_step) for r in trace.reuses())
    assert got == [(8, "d", 3), (9, "c", 2)]
    assert {r.block: r.released_by for r in trace.reuses()}[9] == "a"
