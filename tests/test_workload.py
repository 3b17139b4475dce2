"""Length workloads: parsing, the shipped GSM8K lengths, scaling, seeded draws and the statistics, by hand."""

from __future__ import annotations

import pytest

from cbkit.measure.workload import (
    decode_padding_share,
    gsm8k_solution_lengths,
    length_stats,
    p95,
    parse_lengths,
    scale_to_limit,
)


def test_p95_is_the_nearest_rank():
    assert p95(list(range(1, 21))) == 19  # rank ceil(0.95 * 20) = 19
    assert p95([40, 10, 30, 20]) == 40  # rank ceil(3.8) = 4
    assert p95([5]) == 5


def test_scaling_maps_p95_to_the_limit_and_clips():
    # p95 of [3, 7, 10, 40] is 40; x 16/40: 1.2 -> 1, 2.8 -> 3, 4.0 -> 4, 16
    assert scale_to_limit([3, 7, 10, 40], 16) == [1, 3, 4, 16]
    # p95 of [1, 50, 100] is 100; x 10/100: 0.1 rounds to 0 and is clipped up to 1
    assert scale_to_limit([1, 50, 100], 10) == [1, 5, 10]
    # lengths above the p95 are cut at the limit: p95 of 1..20 is 19, x 38/19 = 2x, so 20 -> 40 -> 38
    assert scale_to_limit(list(range(1, 21)), 38)[-2:] == [38, 38]


def test_length_stats_and_padding_share_by_hand():
    s = length_stats([2, 4, 6])
    assert s["length_mean"] == 4 and s["length_max"] == 6
    assert s["length_cv"] == pytest.approx((8 / 3) ** 0.5 / 4)  # population sd sqrt(8/3) over mean 4
    # one batch: 3 rows x 6 steps = 18 slots for 12 useful tokens
    assert decode_padding_share([2, 4, 6]) == pytest.approx(1 / 3)
    assert decode_padding_share([5, 5, 5]) == 0


def test_shipped_gsm8k_lengths():
    """The packaged file holds every GSM8K train solution; its statistics are the ones measured when the workload
    was designed, before this file existed (SmolLM2 tokenizer: mean 125, CV 0.44, p95 232, max 454)."""
    lengths = gsm8k_solution_lengths()
    assert len(lengths) == 7473
    s = length_stats(lengths)
    assert round(s["length_mean"]) == 125 and round(s["length_cv"], 2) == 0.44 and s["length_max"] == 454
    assert p95(lengths) == 232


def test_kinds_and_draws():
    natural, fixed, gsm = parse_lengths("natural"), parse_lengths("fixed"), parse_lengths("replay:gsm8k")
    assert natural.targets(8, 96, seed=0) is None
    assert fixed.targets(5, 96, seed=0) == [96] * 5
    t = gsm.targets(64, 96, seed=3)
    assert len(t) == 64 and all(1 <= x <= 96 for x in t) and len(set(t)) > 10
    assert t == gsm.targets(64, 96, seed=3)  # both backends at one point get the same targets
    assert t != gsm.targets(64, 96, seed=4)
    pool = set(scale_to_limit(gsm.source_lengths, 96))
    assert set(t) <= pool
    # Scaled so p95 is the limit: ~5% of the distribution is at the limit, and a static batch with these
    # lengths wastes about 47% of its decode slots (the estimate made for this scaling when the workload was designed).
    dist = gsm.distribution(96)
    assert p95(dist) == 96 and 0.05 <= dist.count(96) / len(dist) < 0.07
    assert round(decode_padding_share(dist), 2) == 0.47
    assert "scaled x96/232" in gsm.describe(96) and "EOS ignored" in fixed.describe(96)


def test_bad_specs_say_what_to_choose():
    for spec in ("gsm8k", "replay", "replay:lengths.txt", "uniform", ""):
        with pytest.raises(ValueError, match="natural, fixed, replay:gsm8k"):
            parse_lengths(spec)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        parse_lengths("fixed").targets(4, 0, seed=0)


def test_pad_id_falls_back_to_eos_and_refuses_neither():
    from types import SimpleNamespace

    from cbkit.train.setup import pad_token_id

    assert pad_token_id(SimpleNamespace(pad_token_id=7, eos_token_id=2)) == 7
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    with pytest.raises(ValueError, match="neither a pad nor an EOS token"):
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None))


def test_run_setup_is_what_the_loop_sweep_and_demo_share(tiny):
    from cbkit.tasks.data import chat_prompt_ids, load_problems
    from cbkit.train.setup import set_up_run

    tiny.model.generation_config.eos_token_id = [tiny.tokenizer.eos_token_id, 5]
    try:
        run = set_up_run("tiny", "synthetic", 3, seed=4, policy=tiny)
        assert run.stop_ids == (tiny.tokenizer.eos_token_id, 5)  # the tokenizer's EOS and the model's, in that order
    finally:
        tiny.model.generation_config.eos_token_id = tiny.tokenizer.eos_token_id
    problems = load_problems("synthetic", n=3, seed=4)
    assert [p.question for p in run.problems] == [p.question for p in problems]
    assert run.prompts == [chat_prompt_ids(tiny.tokenizer, p) for p in problems]
    sp = run.sampling(12, temperature=0.5, seed=3)
    assert (sp.max_new_tokens, sp.temperature, sp.eos_token_id, sp.pad_token_id, sp.seed) == (
        12, 0.5, run.stop_ids, run.pad_token_id, 3)
