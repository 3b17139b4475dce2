"""A training run's figure from its `metrics.jsonl` (`cbkit plot`): the reward and held-out accuracy per step."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from cbkit.jsonl import read_jsonl
from cbkit.viz.palette import PALETTE, TEMPLATE


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl`, a torn last line dropped; an empty file is refused."""
    rows = read_jsonl(path, what="step")
    if not rows:
        raise ValueError(f"{path} holds no metrics rows; is it a cbkit metrics.jsonl (cbkit train --output-dir)?")
    return rows


def reward_curve(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], *, window: int = 3,
                 title: str = "Reward per step") -> go.Figure:
    """Each metric per step (dots: one rollout's mean, noisy) and its trailing mean over ``window`` steps (line).
    Held-out metrics (``eval/*``) are drawn as measured, step 0 included: no trailing mean, each point already
    averages many completions the run never trained on."""
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
    """The mean of the numbers among ``values`` (None where there are none)."""
    xs = [float(v) for v in values if isinstance(v, int | float)]
    return sum(xs) / len(xs) if xs else None
