"""cbkit.teach.recycling (the tier planner's step model) on cases worked by hand."""

from __future__ import annotations

import pytest

from cbkit.teach.recycling import paged_pool, static_batch


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


@pytest.mark.parametrize(("call", "msg"), [
    (lambda: paged_pool(3, [4], page_size=0), "page_size must be >= 1"),
    (lambda: static_batch(-1, [4]), "prompt_len must be >= 0"),
])
def test_bad_input_says_what_to_change(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()
