"""Held-out evaluation in the loop: a fixed set, no training problem in it, its metrics where they belong, and a
run with evaluation trains exactly as the same run without it. Nothing here depends on whether a run learns."""

from __future__ import annotations

import json

import pytest
import torch

from cbkit.models.load import load_policy
from cbkit.tasks.data import load_problems
from cbkit.tasks.rewards import verified_reward
from cbkit.train.config import CBGRPOConfig
from cbkit.train.evaluate import EVAL_SEED, question_key, without_held_out
from cbkit.train.grpo import GRPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

# Two one-digit terms, + and -: 200 distinct questions, so 256 training draws and 64 held-out ones must collide.
SMALL_TASK = dict(data="reasoning-gym:chain_sum",
                  data_options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
TIMING = ("seconds", "tokens_per_s", "peak_mem_bytes")


def config(**kw) -> CBGRPOConfig:
    base = dict(model="tiny", system_prompt=None, prompts_per_step=2, num_generations=2, max_completion_length=6,
                learning_rate=1e-2, max_steps=3, disable_tqdm=True, save_steps=0, reward_funcs=["verified"],
                eval_steps=2, eval_num_problems=8, eval_num_generations=2, **SMALL_TASK)
    return CBGRPOConfig(**{**base, **kw})


def run(cfg: CBGRPOConfig, tmp_path, name: str) -> list[dict]:
    cfg.output_dir = str(tmp_path / name)
    GRPOTrainer(cfg, policy=load_policy("tiny", seed=0)).train()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_evaluation_rows_at_step_0_every_k_steps_and_the_last(tmp_path):
    rows = run(config(), tmp_path, "eval")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    evaluated = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evaluated == [0, 2, 3]  # before training, every eval_steps=2, and after the last step
    assert set(rows[0]) == {"step", "eval/accuracy", "eval/verified", "eval/mean_length", "eval/truncated_frac",
                            "eval/completions", "eval/seconds"}
    assert rows[0]["eval/completions"] == 8 * 2
    for r in rows:
        if "eval/accuracy" in r:
            assert 0 <= r["eval/accuracy"] <= 1 and 1 <= r["eval/mean_length"] <= 6 and r["eval/seconds"] > 0


def test_no_held_out_question_is_trained_on():
    raw = load_problems(SMALL_TASK["data"], n=256, seed=0, options=SMALL_TASK["data_options"])
    trainer = GRPOTrainer(config(num_problems=256, eval_num_problems=64), policy=load_policy("tiny", seed=0))
    held_out = {question_key(p) for p in trainer.held_out.problems}
    assert len(held_out) == len(trainer.held_out.problems) > 40  # distinct questions (64 draws of 200 collide)
    # The raw training draw does contain held-out questions, so the split has something to remove.
    assert sum(question_key(p) in held_out for p in raw) > 10
    assert not held_out & {question_key(p) for p in trainer.problems}
    assert len(trainer.problems) == len(trainer.prompt_ids) == sum(question_key(p) not in held_out for p in raw)


def test_the_held_out_set_is_the_same_for_every_seed_of_a_recipe():
    a = GRPOTrainer(config(seed=0), policy=load_policy("tiny", seed=0)).held_out
    b = GRPOTrainer(config(seed=1), policy=load_policy("tiny", seed=0)).held_out
    assert [p.question for p in a.problems] == [p.question for p in b.problems]
    assert a.prompts == b.prompts
    trained = GRPOTrainer(config(seed=1), policy=load_policy("tiny", seed=0)).problems
    assert trained != GRPOTrainer(config(seed=0), policy=load_policy("tiny", seed=0)).problems


def test_evaluation_changes_nothing_the_run_trains(tmp_path):
    """Same weights and training metrics with and without evaluating after every step: the evaluation samples with
    its own seed and restores the RNG state around it. Both runs hold out the same problems (the split comes with
    the config); one of them never evaluates them."""
    trainers = {}
    for name in ("evaluated", "silent"):
        trainer = GRPOTrainer(config(eval_steps=1, output_dir=str(tmp_path / name)), policy=load_policy("tiny", seed=0))
        if name == "silent":
            trainer.held_out.every = 0  # the same held-out split, never evaluated
        trainer.train()
        trainers[name] = trainer
    for p, q in zip(trainers["evaluated"].model.parameters(), trainers["silent"].model.parameters(), strict=True):
        assert torch.equal(p, q)

    def trained(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("eval/") and not k.endswith(TIMING)}
                for r in rows if r["step"] > 0]

    assert trained("evaluated") == trained("silent")
    assert trainers["evaluated"].state.step == 3


def test_evaluating_twice_on_the_same_weights_gives_the_same_numbers():
    trainer = GRPOTrainer(config(), policy=load_policy("tiny", seed=0))
    a, b = trainer.held_out.evaluate(), trainer.held_out.evaluate()
    assert {k: v for k, v in a.items() if k != "eval/seconds"} == {k: v for k, v in b.items() if k != "eval/seconds"}


def test_a_generate_run_is_evaluated_through_the_cb_engine():
    trainer = GRPOTrainer(config(use_transformers_continuous_batching=False), policy=load_policy("tiny", seed=0))
    assert trainer.backend.name == "generate" and trainer.held_out.backend.name == "continuous"


def test_without_held_out_refuses_to_leave_nothing():
    problems = load_problems(SMALL_TASK["data"], n=4, seed=EVAL_SEED, options=SMALL_TASK["data_options"])
    with pytest.raises(ValueError, match="Lower eval_num_problems"):
        without_held_out(problems, problems)


@pytest.mark.parametrize("kw, match", [
    (dict(eval_steps=-1), "eval_steps=-1"),
    (dict(eval_num_problems=0), "eval_num_problems=0"),
    (dict(async_rollouts=True), "eval_steps with async_rollouts"),
    (dict(data="synthetic"), "data_options are knobs of a reasoning-gym source"),
])
def test_bad_evaluation_settings_say_what_to_change(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_an_unknown_reasoning_gym_option_names_the_dataset():
    with pytest.raises(ValueError, match="chain_sum"):
        load_problems("reasoning-gym:chain_sum", n=2, options={"min_digitz": 1})


@pytest.mark.parametrize("text, gold, expected", [
    ("7 + 5 = 12", "12", 1.0),
    ("The answer is 12. Then 3 + 4 = 7", "12", 0.0),  # the last number is what the completion ends on
    ("\\boxed{-4} and some text 9", "-4", 1.0),
    ("#### 12", "12", 1.0),
    ("twelve", "12", 0.0),
    # What a run learned to game: ending on the question's expression, which math-verify would evaluate to 14.
    ("7 + 7 equals 8. The answer to 7 + 7 is", "14", 0.0),
    ("1 + 9 equals 2. Therefore, the answer to 1 + 9 is", "10", 0.0),
    ("It's 1,234 apples", "1234", 1.0),
    ("", "3", 0.0),
])
def test_verified_reward_reads_the_final_answer(text, gold, expected):
    assert verified_reward([text], [gold]) == [expected]


def test_the_trl_bridge_evaluates_every_eval_steps_updates_and_at_the_start():
    from cbkit.trl.config import trl_grpo_config

    args = trl_grpo_config(config(eval_steps=5, eval_num_generations=4, num_iterations=2), output_dir="unused")
    assert (args.eval_strategy, args.eval_steps, args.eval_on_start) == ("steps", 10, True)  # TRL counts updates
    assert args.num_generations_eval == 4
    assert trl_grpo_config(config(eval_steps=0), output_dir="unused").eval_strategy == "no"


def test_cbkit_tiers_plans_04s_held_out_evaluation(monkeypatch):
    import dataclasses

    from cbkit.teach.tiers.plan import plan_notebook
    from cbkit.teach.tiers.table import NOTEBOOKS

    spec = NOTEBOOKS["04_grpo_live"]
    with_eval = plan_notebook(spec.name, "t4")
    no_eval = dataclasses.replace(spec, sizes={t: dataclasses.replace(s, eval_every=0) for t, s in spec.sizes.items()})
    monkeypatch.setitem(NOTEBOOKS, spec.name, no_eval)
    without = plan_notebook(spec.name, "t4")
    held_out = [s for s in with_eval.starts if "held-out" in s.what]
    assert held_out and held_out[0].requests == spec.sizes["t4"].eval_prompts * spec.sizes["t4"].eval_n
    assert not any("held-out" in s.what for s in without.starts)


def test_the_live_chart_draws_the_step_0_evaluation_but_does_not_count_it_as_a_step():
    from cbkit.teach.live import LiveMetricsHook
    from cbkit.train.hooks import StepRecord

    hook = LiveMetricsHook("continuous")
    hook.on_step_end(StepRecord(0, {"eval/accuracy": 0.2}))
    hook.on_step_end(StepRecord(1, {"reward/mean": 0.5, "eval/accuracy": 0.4}))
    assert [r.step for r in hook.records] == [1]  # 04 compares runs over these: every one has reward/mean
    # A trace is named by its run (the legend); the quantity is in its hover text and its label.
    drawn = {t.hovertemplate.split(": %{")[0]: list(t.y) for t in hook.chart.figure().data}
    assert drawn["continuous: held-out accuracy"] == [0.2, 0.4]
