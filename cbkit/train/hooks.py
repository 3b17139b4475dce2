"""Step hooks: every stage of a step observable without the loop knowing who watches (`StepHooks` lists them).
The NaN guard runs before the JSONL writer and the checkpoints, so a diverged step is neither logged nor saved."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from cbkit.jsonl import append_jsonl, read_jsonl
from cbkit.train.order import capture_rng

if TYPE_CHECKING:
    from cbkit.rollout import Rollout
    from cbkit.train.config import CBGRPOConfig

METRICS_FILE = "metrics.jsonl"  # in output_dir


@dataclass
class StepRecord:
    """One finished step: its number and its namespaced metrics (JSON-safe scalars)."""

    step: int
    metrics: dict[str, float | int | str] = field(default_factory=dict)


@dataclass
class TrainState:
    """Where the run is: shared with hooks, and what a checkpoint records besides the weights."""

    step: int  # last finished step (0 before the first)
    config: CBGRPOConfig
    output_dir: Path | None = None
    resumed_from: Path | None = None
    status: Literal["running", "finished", "interrupted", "failed"] = "running"
    resumable: bool = True  # the weights are exactly `step`'s end (False mid-update): only then may it be saved
    data_position: int = 0  # prompts taken so far (`cbkit.train.order.PromptOrder`)
    rng: dict[str, Any] | None = None  # the RNG states at the end of `step`: what a checkpoint of it restores

    def finish_step(self, step: int, prompts: int) -> None:
        self.step, self.data_position, self.rng = step, self.data_position + prompts, capture_rng()
        self.resumable = True


def emit(hooks: list[StepHooks], state: TrainState, record: StepRecord) -> StepRecord:
    """`on_step_end` of every hook; a hook that raises (the NaN guard) leaves the step's weights off disk."""
    try:
        for h in hooks:
            h.on_step_end(record)
    except Exception:
        state.resumable = False
        raise
    return record


class StepHooks:
    """Override what you need. `on_train_begin` runs after a resume is applied; `on_step_end` also gets a step-0
    record of `eval/*` alone when evaluation is on; `on_train_end` runs after an error too (`state.status`)."""

    def on_train_begin(self, state: TrainState) -> None: ...
    def on_step_begin(self, step: int) -> None: ...
    def on_rollout_end(self, rollout: Rollout) -> None: ...
    def on_step_end(self, record: StepRecord) -> None: ...
    def on_train_end(self, state: TrainState) -> None: ...


class ProgressBarHook(StepHooks):
    def __init__(self, **tqdm_kwargs: Any) -> None:
        self.tqdm_kwargs, self.bar = tqdm_kwargs, None

    def on_train_begin(self, state: TrainState) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.config.max_steps, initial=state.step, desc="GRPO", unit="step", **self.tqdm_kwargs)

    def on_step_end(self, record: StepRecord) -> None:
        if self.bar is None or record.step == 0:  # step 0: the evaluation before training, not a step
            return
        m = record.metrics
        shown = {"reward": "reward/mean", "tok/s": "rollout/tokens_per_s", "loss": "train/loss"}
        self.bar.set_postfix(
            {name: f"{m[k]:.3g}" for name, k in shown.items() if isinstance(m.get(k), int | float)}, refresh=False)
        self.bar.update(1)

    def on_train_end(self, state: TrainState) -> None:
        if self.bar is not None:
            self.bar.close()


class JSONLHook(StepHooks):
    """One JSON line per finished step, on disk before the next starts; a resume drops the lines after its start."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def on_train_begin(self, state: TrainState) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():  # a torn last line (a crash mid-write) is dropped by read_jsonl
            kept = [r for r in read_jsonl(self.path, what="step") if r.get("step", state.step + 1) <= state.step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def on_step_end(self, record: StepRecord) -> None:
        # NaN (logprob/* of a backend without logprobs) as JSON null, not invalid JSON.
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.metrics.items()}
        append_jsonl(self.path, {"step": record.step, **clean})


class CheckpointHook(StepHooks):
    """Saves every `save_steps` steps and when training ends, then only if `state.resumable`."""

    def __init__(self, save: Callable[[int], Path], save_steps: int) -> None:
        self.save, self.save_steps = save, save_steps
        self.last_saved: int | None = None

    def on_train_begin(self, state: TrainState) -> None:
        self.last_saved = state.step if state.resumed_from is not None else None

    def on_step_end(self, record: StepRecord) -> None:
        if self.save_steps and record.step and record.step % self.save_steps == 0:
            self.save(record.step)
            self.last_saved = record.step

    def on_train_end(self, state: TrainState) -> None:
        if self.save_steps and state.resumable and state.step > 0 and self.last_saved != state.step:
            self.save(state.step)
            self.last_saved = state.step


class NaNGuardHook(StepHooks):
    """Stops training when the loss or the gradient norm is NaN or infinite, saying where and what to try."""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = learning_rate

    def on_step_end(self, record: StepRecord) -> None:
        for key in ("train/loss", "train/grad_norm"):
            value = record.metrics.get(key)
            if isinstance(value, int | float) and not math.isfinite(value):
                raise FloatingPointError(
                    f"{key} is {value} at step {record.step}: training diverged. This step is not logged or saved; "
                    f"resume from the last checkpoint with a lower learning_rate (now {self.learning_rate}) or a "
                    "max_grad_norm > 0.")


def default_hooks(config: Any, output_dir: Path | None, save_checkpoint: Callable[[int], Any]) -> list[StepHooks]:
    hooks: list[StepHooks] = [NaNGuardHook(config.learning_rate)]
    if output_dir is not None:
        hooks.append(JSONLHook(output_dir / METRICS_FILE))
        if config.save_steps:
            hooks.append(CheckpointHook(save_checkpoint, config.save_steps))
    if not config.disable_tqdm:
        hooks.append(ProgressBarHook())
    return hooks
