"""cbkit.train.checkpoint on its own: a checkpoint reads back exactly, is written atomically, and a resume with a config
that computes something else is refused with the fields that differ."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cbkit.train import checkpoint
from cbkit.train.config import CBGRPOConfig
from cbkit.train.hooks import TrainState
from cbkit.train.order import capture_rng
from cbkit.train.rollouts import RolloutSource


def _trainer(root, seed: int, **config):
    """What `checkpoint.save` and `start` read of a GRPOTrainer, on a two-layer model whose AdamW has moments."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # AdamW now has moments and a step count worth saving
    cfg = CBGRPOConfig(model="tiny", output_dir=None if root is None else str(root), **config)
    state = TrainState(step=0, config=cfg, output_dir=None if root is None else Path(root))
    return SimpleNamespace(model=model, optimizer=opt, config=cfg, state=state, rollouts=RolloutSource(),
                           policy_version=0)


def _save(trainer, step):
    trainer.state.data_position, trainer.state.rng = 3 * step, capture_rng()
    return checkpoint.save(trainer, step)


def test_a_checkpoint_reads_back_exactly(tmp_path):
    trainer = _trainer(tmp_path, 0)
    torch.manual_seed(123)
    random.seed(7)
    path = _save(trainer, 4)
    expected_torch, expected_python = torch.rand(3), random.random()  # what the next draws are after the save

    other = _trainer(tmp_path, 1)  # different weights and moments, overwritten by the load
    checkpoint.start(other, path)
    for a, b in zip(trainer.model.state_dict().values(), other.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved_moments = trainer.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(other.optimizer.state_dict()["state"][0]["exp_avg"], saved_moments)
    assert other.state.step == 4 and other.state.data_position == 12 and other.state.resumed_from == path
    assert "cbkit_version" in json.loads((path / "trainer_state.json").read_text())
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_python  # the RNGs restored
    assert checkpoint.read_config(path) == trainer.config


def test_only_the_newest_are_kept_and_order_is_numeric(tmp_path):
    trainer = _trainer(tmp_path, 0, save_total_limit=2)
    for step in (9, 10):
        _save(trainer, step)
    # "checkpoint-10" sorts before "checkpoint-9" as text; the newest must be 10.
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    _save(trainer, 11)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-11"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "checkpoint-11"
    assert checkpoint.latest_checkpoint(tmp_path / "nothing-here") is None


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, 0)
    _save(trainer, 1)
    before = sorted(p.name for p in (tmp_path / "checkpoint-1").iterdir())

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        _save(trainer, 1)  # the same step again: must not delete the old one first
    with pytest.raises(OSError, match="No space left"):
        _save(trainer, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]  # no half-written directory left over
    assert sorted(p.name for p in (tmp_path / "checkpoint-1").iterdir()) == before


def test_an_incomplete_checkpoint_names_what_is_missing(tmp_path):
    trainer = _trainer(tmp_path, 0)
    path = _save(trainer, 1)
    (path / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"not a complete cbkit checkpoint: missing \['optimizer.pt'\]"):
        checkpoint.start(trainer, path)


def test_resuming_with_another_config_lists_every_differing_field(tmp_path):
    path = _save(_trainer(tmp_path, 0, learning_rate=1e-5, beta=0.0, max_steps=5), 1)
    checkpoint.start(_trainer(tmp_path, 0, max_steps=50), path)  # a longer run is fine
    with pytest.raises(ValueError, match="differs in 2 field") as err:
        checkpoint.start(_trainer(tmp_path, 0, learning_rate=3e-5, beta=0.1), path)
    assert "beta: checkpoint has 0.0, this run has 0.1" in str(err.value)
    assert "learning_rate: checkpoint has 1e-05, this run has 3e-05" in str(err.value)


def test_resuming_the_newest_needs_an_output_dir_that_holds_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint-<step> directory"):
        checkpoint.start(_trainer(tmp_path, 0), True)
    with pytest.raises(ValueError, match="resume_from=True looks in config.output_dir, which is not set"):
        checkpoint.start(_trainer(None, 0), True)
    path = _save(_trainer(tmp_path, 0), 3)
    resumed = _trainer(tmp_path, 1)
    checkpoint.start(resumed, True)
    assert resumed.state.resumed_from == path and resumed.state.step == 3
