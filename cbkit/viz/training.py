"""A training run's figure from its `metrics.jsonl`: the reward and held-out accuracy per step (`cbkit plot`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from cbkit.jsonl import read_jsonl
from cbkit.viz.palette import PALETTE, TEMPLATE

REWARD_KEYS = ("reward/mean", "reward/format", "reward/correctness")
# Held-out metrics (`cbkit.train.evaluate`): drawn on the steps that evaluated, as measured (no trailing mean: each
# point already averages eval_num_problems x eval_num_generations completions).
EVAL_KEYS = ("eval/accuracy",)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` (`cbkit.jsonl.read_jsonl`: a torn last line dropped); an empty file is refused."""
    rows = read_jsonl(path, what="step")
    if not rows:
        raise ValueError(f"{path} holds no metrics rows; is it a cbkit metrics.jsonl (cbkit train --output-dir)?")
    return rows


def reward_curve(rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = REWARD_KEYS + EVAL_KEYS, *,
                 window: int = 3, title: str = "Reward per step") -> go.Figure:
    """Each reward metric per step (dots) and its trailing mean over `window` steps (line): a step's reward is the
    mean of one rollout's completions, so the dots are noisy and the line shows the trend. Held-out metrics
    (`eval/*`) are drawn where they were measured, step 0 included: train reward can rise by gaming the reward,
    held-out accuracy only by solving problems the run never saw."""
    fig = go.Figure()
    for i, key in enumerate(k for k in keys if any(k in r for r in rows)):
        color = PALETTE[i % len(PALETTE)]
        if key.startswith("eval/"):
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            fig.add_scatter(x=[s for s, _ in points], y=[v for _, v in points], mode="lines+markers",
                            name=f"{key} (held-out)", line=dict(color=color, width=3), marker=dict(size=9))
            continue
        trained = [r for r in rows if r["step"] > 0]  # step 0 holds the evaluation before training alone
        steps, values = [r["step"] for r in trained], [r.get(key) for r in trained]
        fig.add_scatter(x=steps, y=values, mode="markers", name=key, marker=dict(color=color, size=7),
                        legendgroup=key)
        smooth = [step_mean(values[max(0, j - window + 1): j + 1]) for j in range(len(values))]
        fig.add_scatter(x=steps, y=smooth, mode="lines", name=f"{key} ({window}-step mean)",
                        line=dict(color=color, width=2), legendgroup=key)
    fig.update_layout(template=TEMPLATE, title=title, xaxis_title="step", yaxis_title="reward", height=420,
                      legend=dict(orientation="h", y=-0.2))
    return fig


def step_mean(values: Sequence[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, int | float)]
    return sum(xs) / len(xs) if xs else None
