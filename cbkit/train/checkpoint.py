"""Checkpoints a killed run continues from exactly, and the run's start or resume. `checkpoint-<step>/` is written
into a temporary sibling and renamed, so a crash leaves the old checkpoint or the new one."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from cbkit import __version__
from cbkit.train.config import CBGRPOConfig
from cbkit.train.hooks import METRICS_FILE
from cbkit.train.order import capture_rng, restore_rng, seed_everything

_NAME = re.compile(r"^checkpoint-(\d+)$")
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "config.json")


def checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Finished checkpoints in `output_dir`, oldest first."""
    root = Path(output_dir)
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
             if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    return next(reversed(checkpoints(output_dir)), None)


def read_config(path: str | os.PathLike[str]) -> CBGRPOConfig:
    return CBGRPOConfig.from_dict(json.loads((Path(path) / "config.json").read_text()))


def start(trainer: Any, resume_from: str | os.PathLike[str] | bool | None) -> None:
    """Start `trainer`'s run fresh (never over a folder holding a run), or exactly where `resume_from` (a checkpoint,
    or True: the newest in output_dir) left it."""
    state, out = trainer.state, trainer.state.output_dir
    if not resume_from:
        if out is not None and (checkpoints(out) or (out / METRICS_FILE).is_file()
                                and (out / METRICS_FILE).stat().st_size):
            raise FileExistsError(f"{out} already holds a run (checkpoints or {METRICS_FILE}). Resume it with "
                                  "resume_from=True (cbkit train --resume), or choose an empty output_dir.")
        seed_everything(trainer.config.seed)
        state.rng = capture_rng()
        return
    if resume_from is not True:
        path = Path(resume_from)
    elif out is None:
        raise ValueError("resume_from=True looks in config.output_dir, which is not set.")
    elif (newest := latest_checkpoint(out)) is None:
        raise FileNotFoundError(f"No checkpoint-<step> directory in {out} to resume from.")
    else:
        path = newest
    missing = [n for n in FILES if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a complete cbkit checkpoint: missing {missing}.")
    differ = read_config(path).diff(trainer.config)
    if differ:  # a config that computes something else: refused, every differing field listed
        lines = "\n".join(f"  {k}: checkpoint has {a!r}, this run has {b!r}" for k, (a, b) in sorted(differ.items()))
        raise ValueError(f"Cannot resume from {path}: the config differs in {len(differ)} field(s):\n{lines}\n"
                         "Resume with the checkpoint's values, or start a new run in another output_dir.")
    load_model(trainer.model, str(path / "model.safetensors"), device=str(next(trainer.model.parameters()).device))
    trainer.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    saved = json.loads((path / "trainer_state.json").read_text())
    state.step, state.data_position, state.resumed_from = saved["step"], saved["data_position"], path
    state.rng = torch.load(path / "rng.pt", weights_only=False)  # python tuples and numpy arrays; the file is our own
    trainer.policy_version = state.step * trainer.config.num_iterations
    trainer.rollouts.load(path, trainer.policy_version)
    restore_rng(state.rng)


def save(trainer: Any, step: int) -> Path:
    """Write `checkpoint-<step>` of `trainer`'s run, with what its rollout source needs (e.g. the older weights), then
    delete all but the `save_total_limit` newest. Returns its path."""
    state, root = trainer.state, trainer.state.output_dir
    assert root is not None  # CheckpointHook runs only with an output_dir
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        save_model(trainer.model, str(tmp / "model.safetensors"))
        torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(state.rng or capture_rng(), tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"step": step, "cbkit_version": __version__, "data_position": state.data_position}, indent=2))
        (tmp / "config.json").write_text(json.dumps(trainer.config.to_dict(), indent=2, sort_keys=True))
        trainer.rollouts.save(tmp)
        old = root / f".{target.name}.old"  # the same step saved again (a resumed run): swap, never delete first
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in checkpoints(root)[: -trainer.config.save_total_limit]:
        shutil.rmtree(stale, ignore_errors=True)
    return target
