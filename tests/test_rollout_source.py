"""The way one step runs forward: set-up once, rollouts from one source behind one call, a rollout checked once.

Each test would fail on the shape the loop had before (a trainer that ran `set_up_run` again and reloaded the
problems; off-policy branches in the loop; a rollout validated by its backend and again by the trainer).
"""

from __future__ import annotations

import dataclasses

import pytest

import cbkit.tasks.data
import cbkit.train.setup
from cbkit.models.load import load_policy
from cbkit.rollout import Rollout
from cbkit.train.grpo import GRPOTrainer
from cbkit.train.rollouts import OnPolicyRollouts, RolloutRequest, SourcedRollout
from cbkit.train.setup import set_up_run
from tests.helpers import PROBLEMS, config, letters_reward, trainer


@pytest.fixture
def counted(monkeypatch):
    """Counts of `set_up_run` and `load_problems` calls, wherever they are called from."""
    calls = {"set_up_run": 0, "load_problems": 0}

    def counting(name, inner):
        def run(*args, **kwargs):
            calls[name] += 1
            return inner(*args, **kwargs)
        return run

    set_up = counting("set_up_run", cbkit.train.setup.set_up_run)
    monkeypatch.setattr(cbkit.train.setup, "set_up_run", set_up)
    monkeypatch.setattr(cbkit.tasks.data, "load_problems", counting("load_problems", cbkit.tasks.data.load_problems))
    return calls


def test_the_readme_way_sets_up_once_and_trains_on_that_run(counted):
    """`set_up_run`, then the trainer on what it returned: the problems are loaded once, and the step's prompts are
    the run's prompt ids (a second set-up from the config would load the config's data: 256 synthetic problems)."""
    run = cbkit.train.setup.set_up_run("tiny", "synthetic", 2, seed=3, policy=load_policy("tiny", seed=0),
                                       system_prompt=None)
    tr = GRPOTrainer(config(data="synthetic", num_problems=None), run, reward_funcs=[letters_reward])
    record = tr.step()
    assert counted == {"set_up_run": 1, "load_problems": 1}
    assert tr.problems == run.problems and tr.prompt_ids == run.prompts and tr.model is run.model
    assert len(tr.problems) == 2 and record.metrics["reward/mean"] >= 0


def test_a_trainer_from_a_config_sets_up_once(counted):
    GRPOTrainer(config(data="synthetic", num_problems=8), policy=load_policy("tiny", seed=0))
    assert counted == {"set_up_run": 1, "load_problems": 1}


def test_a_run_and_a_policy_together_are_refused():
    policy = load_policy("tiny", seed=0)
    run = set_up_run("tiny", "synthetic", 2, policy=policy, problems=PROBLEMS)
    with pytest.raises(ValueError, match="run= .* or policy=/problems=, not both"):
        GRPOTrainer(config(), run, policy=policy)


class Recording(OnPolicyRollouts):
    """An on-policy source that keeps what the loop told it: the requests, the updates, the step ends, the saves."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.requests: list[RolloutRequest] = []
        self.updates: list[int] = []
        self.steps: list[int] = []
        self.saved: list[str] = []

    def rollout(self, request: RolloutRequest) -> SourcedRollout:
        self.requests.append(request)
        got = super().rollout(request)
        return SourcedRollout(got.rollout, got.indices, {"custom/requests": float(len(self.requests))})

    def after_update(self, version: int) -> None:
        self.updates.append(version)

    def after_step(self, version: int) -> dict[str, float]:
        self.steps.append(version)
        return {"custom/version": float(version)}

    def save(self, directory) -> None:
        self.saved.append(directory.name.split(".")[1])  # `.checkpoint-<step>.<tmp>`: renamed with the checkpoint


def test_a_custom_rollout_source_plugs_in_through_the_one_call(tmp_path):
    """Three steps of 2 updates: the source is asked once per step for exactly that step's prompts (the order's
    positions 0-1, 2-3, 4-5 of a 4-problem epoch), with the next step's request until the last step; it hears
    every update and every step's end, and its metrics land in the step's record."""
    from cbkit.rollout import make_backend
    from cbkit.train.setup import pad_token_id

    policy = load_policy("tiny", seed=0)
    source = Recording(make_backend("generate", policy.model, pad_token_id=pad_token_id(policy.tokenizer)))
    tr = trainer(config(max_steps=3, num_iterations=2, output_dir=str(tmp_path), save_steps=1), policy=policy,
                 rollouts=source)
    tr.train()
    assert [r.step for r in source.requests] == [1, 2, 3]
    assert [r.indices for r in source.requests] == [tr.order.indices(p, 2) for p in (0, 2, 4)]
    assert [r.following.step if r.following else None for r in source.requests] == [2, 3, None]
    assert source.requests[0].following.indices == source.requests[1].indices
    assert [r.policy_version for r in source.requests] == [0, 2, 4]
    assert source.updates == [1, 2, 3, 4, 5, 6] and source.steps == [2, 4, 6]
    assert source.saved == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    import json

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["custom/requests"], r["custom/version"]) for r in rows] == [(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]


def test_a_source_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="rollouts must be a cbkit.train.rollouts.RolloutSource"):
        trainer(config(), rollouts=object())


@pytest.mark.parametrize("fields", [dict(use_transformers_continuous_batching=False),
                                    dict(use_transformers_continuous_batching=True),
                                    dict(use_transformers_continuous_batching=True, async_rollouts=True)],
                         ids=["generate", "continuous", "async"])
def test_a_rollout_is_validated_once_where_it_enters(monkeypatch, fields):
    calls = []
    validate = Rollout.validate

    def counting(self):
        calls.append(self.backend)
        return validate(self)

    monkeypatch.setattr(Rollout, "validate", counting)
    tr = trainer(config(max_steps=2, **fields))
    try:
        tr.step()
        assert len(calls) == 1
        tr.step()
        assert len(calls) == 2
    finally:
        tr.close()


def test_a_rollout_that_breaks_the_contract_is_refused_where_it_enters():
    class Broken(OnPolicyRollouts):
        def rollout(self, request):
            got = super().rollout(request)
            bad = [dataclasses.replace(c, finish_reason="stop") for c in got.rollout.completions]
            return SourcedRollout(dataclasses.replace(got.rollout, completions=bad), got.indices)

    tr = trainer(config())
    tr.rollouts = Broken(tr.backend)
    with pytest.raises(ValueError, match="finish_reason must be 'eos' or 'length', got 'stop'"):
        tr.step()
