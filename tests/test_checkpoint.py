"""cbkit.train.checkpoint on its own: a checkpoint reads back exactly, is written atomically, and a resume with a config
that computes something else is refused with the fields that differ."""

from __future__ import annotations

import random

import pytest
import torch

from cbkit.train import checkpoint
from cbkit.train.config import CBGRPOConfig


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # AdamW now has moments and a step count worth saving
    return model, opt


def _save(root, step, model, opt, **kw):
    return checkpoint.save_checkpoint(root, step, model=model, optimizer=opt, config=CBGRPOConfig(model="tiny"),
                                      trainer_state={"data_position": 3 * step}, rng=checkpoint.capture_rng(), **kw)


def test_a_checkpoint_reads_back_exactly(tmp_path):
    model, opt = _model_and_optimizer(0)
    torch.manual_seed(123)
    random.seed(7)
    path = _save(tmp_path, 4, model, opt)
    expected_torch, expected_python = torch.rand(3), random.random()  # what the next draws are after the save

    other, other_opt = _model_and_optimizer(1)  # different weights and moments, overwritten by the load
    state, rng = checkpoint.load_checkpoint(path, model=other, optimizer=other_opt)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved_moments = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], saved_moments)
    assert state["step"] == 4 and state["data_position"] == 12 and "cbkit_version" in state
    checkpoint.restore_rng(rng)
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_python
    assert checkpoint.read_config(path) == CBGRPOConfig(model="tiny")


def test_only_the_newest_are_kept_and_order_is_numeric(tmp_path):
    model, opt = _model_and_optimizer(0)
    for step in (9, 10):
        _save(tmp_path, step, model, opt, keep=2)
    # "checkpoint-10" sorts before "checkpoint-9" as text; the newest must be 10.
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    _save(tmp_path, 11, model, opt, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-11"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "checkpoint-11"
    assert checkpoint.latest_checkpoint(tmp_path / "nothing-here") is None


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    _save(tmp_path, 1, model, opt)
    before = sorted(p.name for p in (tmp_path / "checkpoint-1").iterdir())

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 1, model, opt)  # the same step again: must not delete the old one first
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 2, model, opt)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]  # no half-written directory left over
    assert sorted(p.name for p in (tmp_path / "checkpoint-1").iterdir()) == before


def test_an_incomplete_checkpoint_names_what_is_missing(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = _save(tmp_path, 1, model, opt)
    (path / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"not a complete cbkit checkpoint: missing \['optimizer.pt'\]"):
        checkpoint.load_checkpoint(path, model=model, optimizer=opt)


def test_resuming_with_another_config_lists_every_differing_field():
    saved = CBGRPOConfig(model="tiny", learning_rate=1e-5, beta=0.0, max_steps=5)
    checkpoint.check_same_config(saved, CBGRPOConfig(model="tiny", max_steps=50), "ckpt")  # a longer run is fine
    with pytest.raises(ValueError, match="differs in 2 field") as err:
        checkpoint.check_same_config(saved, CBGRPOConfig(model="tiny", learning_rate=3e-5, beta=0.1), "ckpt")
    assert "beta: checkpoint has 0.0, this run has 0.1" in str(err.value)
    assert "learning_rate: checkpoint has 1e-05, this run has 3e-05" in str(err.value)


def test_resume_path_refuses_false_and_finds_the_newest(tmp_path):
    # False used to reach Path(False), a TypeError that named no option; True finds the newest checkpoint.
    with pytest.raises(ValueError, match="resume_from=False names no checkpoint"):
        checkpoint.resume_path(tmp_path, False)
    assert checkpoint.resume_path(tmp_path, tmp_path / "checkpoint-3") == tmp_path / "checkpoint-3"
    with pytest.raises(FileNotFoundError, match="No checkpoint-<step> directory"):
        checkpoint.resume_path(tmp_path, True)
