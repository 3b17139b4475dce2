"""Checkpoints a killed run continues from exactly, and the run's start or resume. `checkpoint-<step>/` is written
into a temporary sibling and renamed, so a crash leaves the old checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from cbkit.train.config import CBGRPOConfig
from cbkit.train.hooks import METRICS_FILE
from cbkit.train.order import capture_rng, restore_rng, seed_everything

_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Finished checkpoints in `output_dir`, oldest first."""
    root = Path(output_dir)
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
             if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    return next(reversed(checkpoints(output_dir)), None)


def save_checkpoint(output_dir: str | os.PathLike[str], step: int, *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, config: CBGRPOConfig, trainer_state: dict[str, Any],
                    rng: dict[str, Any], keep: int = 1) -> Path:
    """Write `checkpoint-<step>` atomically, then delete all but the `keep` newest. Returns its path."""
    from safetensors.torch import save_model

    from cbkit import __version__

    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(rng, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(
            json.dumps({"step": step, "cbkit_version": __version__, **trainer_state}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        old = root / f".{target.name}.old"  # the same step saved again (a resumed run): swap, never delete first
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return target


def read_config(path: str | os.PathLike[str]) -> CBGRPOConfig:
    return CBGRPOConfig.from_dict(json.loads((Path(path) / "config.json").read_text()))


def check_same_config(saved: CBGRPOConfig, now: CBGRPOConfig, path: str | os.PathLike[str]) -> None:
    """Refuse to resume with a config that computes something else, listing every differing field."""
    differ = saved.diff(now)
    if differ:
        lines = "\n".join(f"  {k}: checkpoint has {a!r}, this run has {b!r}" for k, (a, b) in sorted(differ.items()))
        raise ValueError(f"Cannot resume from {path}: the config differs in {len(differ)} field(s):\n{lines}\n"
                         "Resume with the checkpoint's values, or start a new run in another output_dir.")


def load_checkpoint(path: str | os.PathLike[str], *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights and optimizer state in place; return (trainer_state, rng) for the loop to apply."""
    from safetensors.torch import load_model

    path = Path(path)
    missing = [n for n in ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "config.json")
               if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a complete cbkit checkpoint: missing {missing}.")
    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=False)  # python tuples and numpy arrays; the file is our own
    return json.loads((path / "trainer_state.json").read_text()), rng


def resume_path(output_dir: Path | None, resume_from: str | os.PathLike[str] | bool) -> Path:
    """The checkpoint to resume from: `resume_from` itself, or (True) the newest in `output_dir`."""
    if resume_from is False:
        raise ValueError("resume_from=False names no checkpoint: pass a checkpoint directory, or True for the newest "
                         "in output_dir (leave it None not to resume).")
    if resume_from is not True:
        return Path(resume_from)
    if output_dir is None:
        raise ValueError("resume_from=True looks in config.output_dir, which is not set.")
    path = latest_checkpoint(output_dir)
    if path is None:
        raise FileNotFoundError(f"No checkpoint-<step> directory in {output_dir} to resume from.")
    return path


def start(trainer: Any, resume_from: str | os.PathLike[str] | bool | None) -> None:
    """Start `trainer`'s run fresh (never over a folder holding a run), or exactly where `resume_from` left it."""
    state, out = trainer.state, trainer.state.output_dir
    if not resume_from:
        if out is not None and (checkpoints(out) or (out / METRICS_FILE).is_file()
                                and (out / METRICS_FILE).stat().st_size):
            raise FileExistsError(f"{out} already holds a run (checkpoints or {METRICS_FILE}). Resume it with "
                                  "resume_from=True (cbkit train --resume), or choose an empty output_dir.")
        seed_everything(trainer.config.seed)
        state.rng = capture_rng()
        return
    path = resume_path(out, resume_from)
    check_same_config(read_config(path), trainer.config, path)
    saved, rng = load_checkpoint(path, model=trainer.model, optimizer=trainer.optimizer)
    state.step, state.data_position, state.resumed_from, state.rng = saved["step"], saved["data_position"], path, rng
    trainer.policy_version = state.step * trainer.config.num_iterations
    trainer.rollouts.load(path, trainer.policy_version)
    restore_rng(rng)


def save(trainer: Any, step: int) -> Path:
    """`checkpoint-<step>` of `trainer`'s run, and what its rollout source needs (e.g. the older weights)."""
    state = trainer.state
    assert state.output_dir is not None  # CheckpointHook runs only with an output_dir
    path = save_checkpoint(state.output_dir, step, model=trainer.model, optimizer=trainer.optimizer,
                           config=trainer.config, trainer_state={"data_position": state.data_position},
                           rng=state.rng or capture_rng(), keep=trainer.config.save_total_limit)
    trainer.rollouts.save(path)
    return path
