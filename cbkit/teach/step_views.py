"""What the notebooks show of a step and a run: a step's metrics as a table, the completions the loop trained on
with their rewards, several runs' means side by side, and how far an update moved the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cbkit.train.hooks import StepHooks, StepRecord


def metrics_table(metrics: Mapping[str, Any]):
    """A step's namespaced metrics as a table (pandas DataFrame): namespace, metric, value; bytes as MiB."""
    import pandas as pd

    rows = []
    for key in sorted(metrics, key=lambda k: (k.split("/")[0], k)):
        namespace, _, name = key.partition("/")
        value = metrics[key]
        if key.endswith("_bytes") and isinstance(value, int | float):
            name, value = name.removesuffix("_bytes") + " (MiB)", value / 2**20
        rows.append({"namespace": namespace, "metric": name or namespace,
                     "value": round(value, 6) if isinstance(value, float) else value})
    return pd.DataFrame(rows).set_index(["namespace", "metric"])


class RolloutRecorder(StepHooks):
    """Keeps each step's rollout (``rollouts[-1]`` is the latest), to look at what the loop trained on."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self.rollouts: list[Any] = []

    def on_rollout_end(self, rollout: Any) -> None:
        self.rollouts = (self.rollouts + [rollout])[-self.keep:]


def completions_table(rollout: Any, tokenizer: Any, answers: Sequence[str], *, max_chars: int = 160):
    """One row per completion: its group, how it ended, its length, the answer it gave, the gold answer and
    each default reward; the text is cut to ``max_chars``. ``answers`` holds one gold answer per group."""
    import pandas as pd

    from cbkit.tasks.rewards import DEFAULT_REWARDS, extract_answer

    if len(answers) != rollout.num_prompts:
        raise ValueError(f"need one gold answer per prompt: {rollout.num_prompts} prompts, {len(answers)} answers.")
    texts = [tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in rollout.completions]
    golds = [answers[c.group] for c in rollout.completions]
    rows = {
        "group": [c.group for c in rollout.completions],
        "finish": [c.finish_reason for c in rollout.completions],
        "tokens": [len(c.completion_ids) for c in rollout.completions],
        "answer given": [extract_answer(t) for t in texts],
        "gold": golds,
    }
    for name, fn in DEFAULT_REWARDS.items():
        rows[name] = fn(texts, golds)
    rows["completion"] = [t if len(t) <= max_chars else t[: max_chars - 1] + "…" for t in texts]
    return pd.DataFrame(rows)


def compare_runs(records: Mapping[str, Sequence[StepRecord]], keys: Sequence[str] = (
        "rollout/tokens_per_s", "rollout/seconds", "rollout/peak_mem_bytes", "train/seconds", "reward/mean",
        "completion/mean_length", "logprob/max_abs_diff", "is/ratio_mean")):
    """Per run (label -> its step records), the mean of each metric over its steps: one row per metric."""
    import pandas as pd

    table = {}
    for label, recs in records.items():
        col = {}
        for key in keys:
            vals = [v for r in recs if isinstance(v := r.metrics.get(key), int | float) and v == v]
            mean = sum(vals) / len(vals) if vals else float("nan")
            col[key.replace("_bytes", " (MiB)") if key.endswith("_bytes") else key] = (
                mean / 2**20 if key.endswith("_bytes") else mean)
        table[label] = col
    return pd.DataFrame(table)


def weight_change(before: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, float]:
    """How far an update moved the weights: the share of weight elements that changed at all, and the
    relative norm of the change. ``before`` is a ``state_dict`` copy taken before the update."""
    changed = total = 0
    diff_sq = base_sq = 0.0
    for name, after in model.state_dict().items():
        if name not in before or not after.is_floating_point():
            continue
        old = before[name].to(after.device)
        changed += int((after != old).sum())
        total += after.numel()
        diff_sq += float((after.double() - old.double()).pow(2).sum())
        base_sq += float(old.double().pow(2).sum())
    if not total:
        raise ValueError("no floating-point weight in common between `before` and the model.")
    return {"changed_share": changed / total, "relative_change": (diff_sq / base_sq) ** 0.5 if base_sq else 0.0}


def rounded(values: Mapping[str, Any], digits: int = 4) -> dict[str, Any]:
    """A metrics dict for printing: floats to ``digits`` significant digits, everything else as it is."""
    return {k: float(f"{v:.{digits}g}") if isinstance(v, float) else v for k, v in values.items()}
