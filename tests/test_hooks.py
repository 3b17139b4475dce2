"""The step hooks on their own: JSONL appends per step, NaN guard message, checkpoint timing, headless bar."""

from __future__ import annotations

import io
import json
import math

import pytest

from cbkit.train.config import CBGRPOConfig
from cbkit.train.hooks import (
    CheckpointHook,
    JSONLHook,
    NaNGuardHook,
    ProgressBarHook,
    StepHooks,
    StepRecord,
    TrainState,
)


def _state(step=0, **kw):
    return TrainState(step=step, config=CBGRPOConfig(model="tiny", max_steps=4), **kw)


def test_a_hook_overrides_only_what_it_needs_and_sees_every_step():
    """The base class's methods are no-ops so that a hook can define one of them; the trainer then calls that
    one at every step, in order, with the step's record (here: a tiny two-step run)."""
    from cbkit.tasks.data import Problem
    from cbkit.train.grpo import GRPOTrainer

    class Rewards(StepHooks):
        def __init__(self) -> None:
            self.seen: list[tuple[int, float]] = []

        def on_step_end(self, record: StepRecord) -> None:
            self.seen.append((record.step, record.metrics["reward/mean"]))

    hook = Rewards()
    config = CBGRPOConfig(model="tiny", system_prompt=None, prompts_per_step=1, num_generations=2,
                          max_completion_length=4, max_steps=2, disable_tqdm=True, save_steps=0,
                          use_transformers_continuous_batching=False)
    trainer = GRPOTrainer(config, reward_funcs=[lambda completions, answers: [1.0] * len(completions)],
                          hooks=[hook], problems=[Problem("p0", "hi", "1")])
    trainer.train()
    assert hook.seen == [(1, 1.0), (2, 1.0)]


def test_jsonl_appends_and_flushes_each_step(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    hook = JSONLHook(path)
    hook.on_train_begin(_state())
    for step in (1, 2):
        hook.on_step_end(StepRecord(step, {"reward/mean": 0.5 * step, "rollout/backend": "generate",
                                           "logprob/max_abs_diff": math.nan}))
        # On disk as soon as the step ends: a crash during the next step loses nothing.
        lines = path.read_text().splitlines()
        assert len(lines) == step
    rows = [json.loads(line) for line in lines]
    assert rows[1] == {"step": 2, "reward/mean": 1.0, "rollout/backend": "generate", "logprob/max_abs_diff": None}


def test_jsonl_drops_steps_after_the_resume_point(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "rew')
    with pytest.warns(UserWarning, match="metrics.jsonl, line 4: dropped a torn last line"):
        JSONLHook(path).on_train_begin(_state(step=2))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    JSONLHook(path).on_train_begin(_state(step=0))  # a fresh run starts an empty log
    assert path.read_text() == ""


def test_jsonl_refuses_a_log_damaged_before_its_last_line(tmp_path):
    """Only the last line can be torn by a crash; a bad line before it is named, and the log is left as it was."""
    path = tmp_path / "metrics.jsonl"
    text = json.dumps({"step": 1}) + "\n" + "{not json\n" + json.dumps({"step": 2}) + "\n"
    path.write_text(text)
    with pytest.raises(ValueError, match="metrics.jsonl, line 2: not a JSON record"):
        JSONLHook(path).on_train_begin(_state(step=2))
    assert path.read_text() == text


@pytest.mark.parametrize("key", ["train/loss", "train/grad_norm"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_guard_names_metric_and_step(key, value):
    guard = NaNGuardHook(learning_rate=1e-5)
    guard.on_step_end(StepRecord(1, {"train/loss": 0.1, "train/grad_norm": 1.0}))
    with pytest.raises(FloatingPointError, match=rf"{key} is {value} at step 7: training diverged.*learning_rate"):
        guard.on_step_end(StepRecord(7, {"train/loss": 0.1, "train/grad_norm": 1.0, key: value}))


def test_checkpoint_hook_saves_every_n_and_at_the_end_only_when_resumable():
    saved = []
    hook = CheckpointHook(lambda step: saved.append(step), save_steps=2)
    hook.on_train_begin(_state())
    for step in (1, 2, 3):
        hook.on_step_end(StepRecord(step))
    assert saved == [2]
    hook.on_train_end(_state(step=3, status="interrupted", resumable=False))  # interrupted mid-update
    assert saved == [2]
    hook.on_train_end(_state(step=3, status="interrupted", resumable=True))  # interrupted mid-rollout
    assert saved == [2, 3]
    hook.on_train_end(_state(step=3, status="finished"))  # already saved
    assert saved == [2, 3]


def test_progress_bar_runs_headless():
    out = io.StringIO()
    bar = ProgressBarHook(file=out, mininterval=0)
    bar.on_train_begin(_state(step=1))
    bar.on_step_end(StepRecord(2, {"reward/mean": 0.25, "rollout/tokens_per_s": 100.0, "rollout/backend": "x"}))
    bar.on_train_end(_state(step=2))
    assert "2/4" in out.getvalue() and "reward=0.25" in out.getvalue()
