"""cbkit.teach.why_cb: CB's win split by source. The split on records worked by hand, where a naive reading is wrong
(a win with no padding credited to padding, a padding share read as a padding cost, all requests running at once read
as recycling, cbkit's prefill helper read as a finished completion), and the records read from a real rollout of the
tiny model, checked against what went in (the prompt, the targets)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from cbkit.rollout.engine_trace import EngineStep, EngineTrace, ScheduledRequest
from cbkit.teach.why_cb import _observe_cb, measure_why_cb, split_lines, split_win, why_cb_conclusion


def _rec(variant: str, wall: float, *, workload: str = "fixed", n: int = 4, prefill_s: float = 0.0,
         steps: list[tuple[int, float]] = (), padded: int = 0, slots: int = 64, prefill_tokens: int = 400,
         helper: int = 0, reused: int = 0, running: int = 4) -> dict:
    return {"variant": variant, "workload": workload, "N": n, "repeat": 0, "wall_s": wall, "rows": n,
            "completion_tokens": slots - padded, "prefill_tokens": prefill_tokens, "helper_prefill_tokens": helper,
            "prefill_s": prefill_s, "decode_steps": len(steps), "decode_step_rows": [r for r, _ in steps],
            "decode_step_s": [s for _, s in steps], "padded_slots": padded, "slots": slots,
            "reused_blocks": reused, "refilled_requests": min(reused, 1), "max_running": running}


def test_a_win_with_no_padding_is_not_credited_to_padding():
    """`fixed`: CB 2x faster, but generate() decoded no finished row. The whole saving is the shared prefill (CB
    without sharing is as slow as generate()); padding gets exactly zero, the conclusion names the prefill."""
    full = [(4, 0.1)] * 15
    recs = [_rec("generate", 4.0, prefill_s=2.5, steps=full, prefill_tokens=400),
            _rec("cb", 2.0, prefill_s=0.5, steps=full, prefill_tokens=136, helper=100),
            _rec("cb_no_sharing", 4.0, prefill_s=2.5, steps=full, prefill_tokens=400)]
    s = split_win(recs)
    assert (s.total_s, s.sharing_s, s.padding_s, s.rest_s) == (2.0, 2.0, 0.0, 0.0)
    assert s.speed == 2.0 and s.padding_share == 0
    text = split_lines(s) + "\n" + why_cb_conclusion([s])
    assert "nothing to save" in text and "the largest part was prefilling the group's prompt once" in text
    assert "the prompt once (100, cbkit's prefill request), then 9 per completion" in text  # (136 - 100) / 4


def test_a_padding_share_is_not_a_padding_cost_when_a_step_costs_the_same_at_any_rows():
    """Half of generate()'s decode slots were finished rows, but CB's decode steps took 0.1 s with 4 rows as with 1:
    a padded row cost nothing, so padding gets nothing (share x decode time would have credited it 1 s)."""
    flat = [(4, 0.1), (3, 0.1), (2, 0.1), (1, 0.1)] * 5
    recs = [_rec("generate", 3.0, workload="replay", prefill_s=1.0, steps=[(4, 0.1)] * 20, padded=32),
            _rec("cb", 2.0, workload="replay", prefill_s=0.5, steps=flat),
            _rec("cb_no_sharing", 2.5, workload="replay", prefill_s=1.0, steps=flat)]
    s = split_win(recs)
    assert s.padding_share == 0.5 and s.row_share == 0.0 and s.padding_s == 0.0
    assert s.sharing_s == 0.5 and s.rest_s == pytest.approx(0.5)


def test_padding_costs_its_share_when_a_step_costs_in_proportion_to_its_rows():
    """Steps at 0.025 s a row: a row is a quarter of a 4-row step and padding the whole per-row share, so half the
    slots padded cost half of generate()'s 2 s of decoding: 1 s, worked by hand."""
    prop = [(4, 0.1), (3, 0.075), (2, 0.05), (1, 0.025)] * 5
    recs = [_rec("generate", 3.0, workload="replay", prefill_s=1.0, steps=[(4, 0.1)] * 20, padded=32),
            _rec("cb", 1.5, workload="replay", prefill_s=0.5, steps=prop),
            _rec("cb_no_sharing", 1.5, workload="replay", prefill_s=0.5, steps=prop)]
    s = split_win(recs)
    assert s.row_share == pytest.approx(1.0) and s.padding_s == pytest.approx(1.0)
    assert s.padding_cost_share == pytest.approx(0.5) and s.rest_s == pytest.approx(0.5)
    assert "one row is 25.0% of a 4-row decode step's time" in split_lines(s)


def test_every_request_running_at_once_is_not_recycling():
    recs = [_rec("generate", 3.0), _rec("cb", 2.0), _rec("cb_no_sharing", 2.5)]
    assert "all 4 ran at once, so none waited for a freed slot" in split_lines(split_win(recs))


def test_the_split_refuses_missing_variants_and_mixed_points():
    with pytest.raises(ValueError, match="cb_no_sharing"):
        split_win([_rec("generate", 3.0), _rec("cb", 2.0)])
    with pytest.raises(ValueError, match="one \\(workload, N\\)"):
        split_win([_rec("generate", 3.0), _rec("cb", 2.0), _rec("cb_no_sharing", 2.5, n=8)])


def _req(rid: str, past: int, query: int, blocks: tuple[int, ...]) -> ScheduledRequest:
    return ScheduledRequest(rid, 40, 7, past, query, blocks)


def test_the_helper_request_prefills_but_its_handover_is_not_recycling():
    """A trace worked by hand, pages of 32, a 40-token prompt: cbkit's helper h prefills it alone (steps 0-1) and
    finishes; a and b find its first page and prefill the other 8 tokens each, and a takes h's released block 1.
    That is the helper's hand-over, not a finished completion's: no recycling. Then a finishes and c takes its
    block 3: one real hand-over."""
    steps = [EngineStep(0, 0.0, (_req("h", 0, 40, (0, 1)),)),
             EngineStep(1, 1.0, (_req("h", 40, 1, (0, 1)),)),
             EngineStep(2, 2.0, (_req("a", 32, 8, (0, 1)), _req("b", 32, 8, (0, 2)))),
             EngineStep(3, 2.5, (_req("a", 40, 1, (0, 1, 3)), _req("b", 40, 1, (0, 2)))),
             EngineStep(4, 3.0, (_req("b", 41, 1, (0, 2)), _req("c", 32, 8, (0, 3))))]
    trace = EngineTrace(steps=steps, pool_blocks=8, page_size=32)
    rollout = SimpleNamespace(completions=[None] * 3, completion_tokens=9)
    seen = _observe_cb(rollout, trace, end=3.4)
    assert seen["prefill_tokens"] == 40 + 8 + 8 + 8 and seen["helper_prefill_tokens"] == 40
    assert seen["reused_blocks"] == 1 and seen["refilled_requests"] == 1  # block 3, a -> c; not h's block 1
    assert seen["max_running"] == 2
    # Steps with a prefill chunk (0, 2, 4: c's) are prefill time; the helper's one decode step is a real 1-row step.
    assert seen["prefill_s"] == pytest.approx(1.0 + 0.5 + 0.4)
    assert seen["decode_step_rows"] == [1, 2] and seen["decode_step_s"] == pytest.approx([1.0, 0.5])


def test_measured_records_agree_with_what_went_in(tiny):
    """One real point on the tiny model (pages of 16): generate()'s prefill is every row's whole prompt, as is CB's
    without sharing (read from the engine trace, not computed); CB with sharing prefills the prompt once in cbkit's
    helper and less than generate() in all; generate()'s padded slots are its rows x longest target - the targets."""
    from cbkit.measure.sweep_config import SweepConfig

    cfg = SweepConfig(model="tiny", data="synthetic", num_prompts=1, ns=(4,), repeats=1, max_new_tokens=8,
                      dtype="float32", lengths="replay:gsm8k", cb_config={"page_size": 16})
    records = measure_why_cb(cfg, tiny, [4], ["replay:gsm8k"])
    by = {r["variant"]: r for r in records}
    from cbkit.train.setup import set_up_run

    prompt = len(set_up_run("tiny", "synthetic", 1, policy=tiny).prompts[0])
    assert prompt > 16, "the test needs a prompt of more than one page to share"
    targets = cfg.workload.targets(4, 8, seed=cfg.seed)
    assert by["generate"]["prefill_tokens"] == 4 * prompt == by["cb_no_sharing"]["prefill_tokens"]
    assert by["cb"]["helper_prefill_tokens"] == prompt
    assert prompt + 4 <= by["cb"]["prefill_tokens"] < 4 * prompt
    assert by["generate"]["padded_slots"] == 4 * max(targets) - sum(targets)
    assert by["generate"]["completion_tokens"] == sum(targets) == by["cb"]["completion_tokens"]
    s = split_win(records)
    assert math.isclose(s.total_s, s.sharing_s + s.padding_s + s.rest_s)


def _points(speeds: dict[int, float]) -> list[dict]:
    return [{"backend": b, "N": n, "status": "ok", "speed_vs_generate": s if b == "continuous" else 1.0}
            for n, s in speeds.items() for b in ("continuous", "generate")]


def test_the_guide_check_says_when_the_spread_did_not_move_the_crossover():
    """TRL's guide asks for variable lengths; both workloads ahead from N=8 (N=4 is within the 5% margin on fixed,
    which is no crossover) means the spread did not decide."""
    from cbkit.teach.why_cb import guide_check

    same = guide_check({"fixed": _points({4: 1.04, 8: 1.3}), "replay:gsm8k": _points({4: 0.9, 8: 1.6})})
    assert "fixed: from N=8; replay:gsm8k: from N=8" in same and "did not decide" in same
    moved = guide_check({"fixed": _points({4: 0.8, 8: 1.3}), "replay:gsm8k": _points({4: 1.2, 8: 1.6})})
    assert "fixed: from N=8; replay:gsm8k: from N=4" in moved and "did not decide" not in moved


def test_the_conclusion_names_the_spread_only_when_the_parts_say_so():
    """Fixed: the win is the shared prefill. Replay: padding is the larger part. The leads differ, so the conclusion
    must not say the spread is not what pays; it states padding's seconds on the replay."""
    full = [(4, 0.1)] * 15
    fixed = split_win([_rec("generate", 4.0, prefill_s=2.5, steps=full), _rec("cb", 3.0, steps=full),
                       _rec("cb_no_sharing", 3.5, steps=full)])
    prop = [(4, 0.1), (3, 0.075), (2, 0.05), (1, 0.025)] * 5
    replay = split_win([_rec("generate", 3.0, workload="replay", prefill_s=1.0, steps=[(4, 0.1)] * 20, padded=32),
                        _rec("cb", 1.8, workload="replay", steps=prop), _rec("cb_no_sharing", 2.0, workload="replay",
                                                                              steps=prop)])
    text = why_cb_conclusion([fixed, replay])
    assert "not the spread" not in text
    assert "the largest part was not decoding padding (+1.00 s of +1.20 s)" in text
    assert "On replay the spread left 50% of generate()'s decode slots to finished rows" in text


def test_the_noise_baseline_is_the_largest_gap_between_two_timings_of_one_rollout():
    from cbkit.teach.why_cb import noise_line

    s = split_win([_rec("generate", 4.0), _rec("cb", 2.0), _rec("cb_no_sharing", 3.0)])
    sweep = {"fixed": [{"backend": "generate", "N": 4, "status": "ok", "rollout_s": 5.0},
                       {"backend": "continuous", "N": 4, "status": "ok", "rollout_s": 2.1}]}
    assert "differ by up to 20% (generate, fixed, N=4: 5.00 s, then 4.00 s)" in noise_line([s], sweep)
    assert "no noise baseline" in noise_line([s], {"fixed": []})
