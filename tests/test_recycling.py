"""cbkit.teach.recycling (the model notebook 01 draws) on cases worked by hand, independent of the notebook's numbers."""

from __future__ import annotations

import pytest

from cbkit.teach.recycling import completion_lengths, paged_pool, static_batch


def test_paged_pool_by_hand_with_a_running_cap():
    """prompt 3, lengths [4, 1, 2], pages of 2 tokens, at most 2 running, by hand:

    step 1: seqs 0 and 1 admitted, 1 token each: ceil(4/2) + ceil(4/2) = 4 blocks = 8 slots; seq 1 ends.
    step 2: seq 2 takes the freed slot: seq 0 at 5 tokens (3 blocks), seq 2 at 4 (2 blocks) = 10 slots.
    step 3: 6 tokens (3 blocks) + 5 tokens (3 blocks) = 12 slots; seq 2 ends.
    step 4: seq 0 alone at 7 tokens, 4 blocks = 8 slots; done.
    """
    occ = paged_pool(3, [4, 1, 2], page_size=2, max_running=2)
    assert occ.held_tokens == (8, 10, 12, 8)
    assert occ.running == (2, 2, 2, 1)
    assert (occ.steps, occ.peak_tokens, occ.token_steps) == (4, 12, 38)


def test_static_batch_by_hand():
    """Same lengths in a static batch: 3 rows x (3 + step) slots for all 4 steps, finished rows included."""
    occ = static_batch(3, [4, 1, 2])
    assert occ.held_tokens == (12, 15, 18, 21)
    assert occ.running == (3, 2, 1, 1)


def test_pool_admission_is_first_in_first_out_and_waits_for_a_full_reservation():
    """Pool of 6 blocks of 4 tokens, prompt 4, limit 8: each admission reserves ceil(12/4) = 3 blocks, so two run
    at once. The long first sequence holds its reservation, so the third waits for the *second* to end."""
    occ = paged_pool(4, [8, 2, 2, 2], page_size=4, pool_blocks=6)
    assert occ.running[:2] == (2, 2)  # seqs 0 and 1
    assert occ.running[2:4] == (2, 2)  # seq 1 ended after step 2; seq 2 took its reservation
    assert occ.steps == 8 and sum(occ.running) == 8 + 2 + 2 + 2
    assert occ.peak_tokens <= 6 * 4


def test_completion_lengths_are_seeded_and_within_the_spread():
    a = completion_lengths(50, 100, 0.3, seed=4)
    assert a == completion_lengths(50, 100, 0.3, seed=4) != completion_lengths(50, 100, 0.3, seed=5)
    assert min(a) >= 70 and max(a) <= 100
    assert completion_lengths(3, 1, 1.0) == [1, 1, 1]  # never below one token


@pytest.mark.parametrize(("call", "msg"), [
    (lambda: paged_pool(3, [4], page_size=0), "page_size must be >= 1"),
    (lambda: static_batch(-1, [4]), "prompt_len must be >= 0"),
    (lambda: completion_lengths(0, 10, 0.5), "need n >= 1"),
])
def test_bad_input_says_what_to_change(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def test_engine_admission_by_hand_shares_the_prompt_and_reserves_nothing():
    """prompt 8, pages of 8, completions of 8 tokens, a pool of 8 blocks. Engine rule: the group's one complete
    prompt page is held once, and each sequence needs one page of its own for its first token: 1 + 7 = 8 blocks
    admit 7 at once in step 1 (the 8th finds none free). Worst-case reservation: each reserves ceil((8 + 8) / 8) = 2
    blocks, its own prompt page included: 4 at once. Step 1 by hand: engine 8 blocks = 64 slots, reserve 4 x 2 =
    8 blocks = 64 slots as well, but for 4 sequences."""
    engine = paged_pool(8, [8] * 8, 8, pool_blocks=8, admission="engine")
    reserve = paged_pool(8, [8] * 8, 8, pool_blocks=8, admission="reserve")
    assert (engine.running[0], reserve.running[0]) == (7, 4)
    assert engine.held_tokens[0] == reserve.held_tokens[0] == 64
    # Every step the engine's sequences fit the pool: 7 finish after 8 steps, then the last runs alone.
    assert max(engine.held_tokens) <= 8 * 8 and engine.steps == 16 and reserve.steps == 16
    # Without sharing, each sequence also holds its own prompt page: 2 blocks each, 4 admitted, as reserved.
    assert paged_pool(8, [8] * 8, 8, pool_blocks=8, admission="engine", share_prompt=False).running[0] == 4


def test_engine_admission_offloads_when_every_sequence_is_starved():
    """Two sequences of one 1-token prompt, pages of 2, a 3-block pool, no sharing, lengths 5: both admitted (1
    block each for 2 tokens), then both cross page boundaries together; with one block free, the first takes it and
    the second waits; the model never holds more than the pool and every token is generated."""
    occ = paged_pool(1, [5, 5], 2, pool_blocks=3, admission="engine", share_prompt=False, safety_margin=0.0)
    assert max(occ.held_tokens) <= 3 * 2
    assert occ.steps > 5  # someone waited a step


def test_engine_admission_matches_the_engine_s_first_step(tiny):
    """The real engine, no prefix sharing, 8 requests of a 41-token prompt, pages of 16, a 12-block pool: in its
    first step it admits as many requests as the model's engine rule (each needs 3 blocks: 4), where worst-case
    reservation for 24 new tokens (ceil(65 / 16) = 5 blocks each) admits 2."""
    from cbkit.rollout import SamplingParams
    from cbkit.rollout.continuous import ContinuousBackend
    from cbkit.rollout.engine_trace import record_engine_steps

    tok = tiny.tokenizer
    prompt = (tok.encode("Tom has 3 apples and buys 4 more. How many now? Count them twice, then once more.") * 3)[:41]
    sp = SamplingParams(max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    backend = ContinuousBackend(tiny.model, {"page_size": 16, "num_blocks": 12, "allow_block_sharing": False})
    with record_engine_steps() as trace:
        backend.generate([prompt], 8, sp, target_lengths=[24] * 8)
    assert trace.pool_blocks == 12
    lengths = [24] * 8
    model = paged_pool(41, lengths, 16, pool_blocks=12, admission="engine", share_prompt=False)
    reserve = paged_pool(41, lengths, 16, pool_blocks=12, admission="reserve")
    assert len(trace.steps[0].requests) == model.running[0] == 4
    assert reserve.running[0] == 2
