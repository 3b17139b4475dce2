"""Figures of training runs, drawn from what the loop logged: one metric of several runs side by side (the learning
report's), and an async rollout's requests with each token coloured by the policy version that sampled it (05).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from cbkit.viz.figures import PALETTE, TEMPLATE, step_mean


def runs_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], key: str, *, title: str | None = None,
                window: int = 1, dashes: Mapping[str, str] | None = None,
                colors: Mapping[str, str] | None = None) -> go.Figure:
    """One metric of several runs against step, one colour per run (trailing mean over `window` steps). Rows
    without the metric are left out, so a held-out metric (`eval/*`, on the evaluated steps only) draws as a line
    through its evaluations. `dashes` and `colors` give a run a line dash (e.g. "dot" for a second seed) and colour
(e.g. its backend's, `cbkit.viz.figures.backend_color`)."""
    fig = go.Figure()
    for i, (name, rows) in enumerate(runs.items()):
        have = [r for r in rows if isinstance(r.get(key), int | float)]
        values = [r[key] for r in have]
        smooth = [step_mean(values[max(0, j - window + 1): j + 1]) for j in range(len(values))]
        fig.add_scatter(x=[r["step"] for r in have], y=smooth, mode="lines+markers", name=name,
                        line=dict(color=(colors or {}).get(name, PALETTE[i % len(PALETTE)]),
                                  dash=(dashes or {}).get(name, "solid")))
    fig.update_layout(template=TEMPLATE, title=title or key, xaxis_title="step", yaxis_title=key, height=380)
    return fig


def async_timeline(timeline: Mapping[str, Any], train: Sequence[tuple[float, float, str]] = (), *,
                   title: str = "Async rollout: tokens coloured by the policy version that sampled them") -> go.Figure:
    """Requests as rows, one dot per token at the time the engine sampled it, coloured by its policy version;
    a vertical line where each update landed; shaded spans for training (`train`: (start, end, label) on the same
    perf_counter clock)."""
    t0 = timeline["t0"]
    fig = go.Figure()
    versions = sorted({v for r in timeline["requests"] for v in r["token_versions"]})
    for i, version in enumerate(versions):
        xs, ys = [], []
        for r in timeline["requests"]:
            for t, v in zip(r["token_times"], r["token_versions"], strict=False):
                if v == version:
                    xs.append(t - t0)
                    ys.append(r["id"])
        fig.add_scatter(x=xs, y=ys, mode="markers", name=f"policy version {version}",
                        marker=dict(color=PALETTE[i % len(PALETTE)], size=6, symbol="square"))
    for start, end, label in train:
        fig.add_vrect(x0=start - t0, x1=end - t0, fillcolor="#8C8C8C", opacity=0.15, line_width=0,
                      annotation_text=label, annotation_position="top left")
    for t, version in timeline.get("swaps", ()):
        fig.add_vline(x=t - t0, line=dict(color="#C44E52", dash="dash"),
                      annotation_text=f"update -> v{version}", annotation_position="bottom right")
    fig.update_layout(template=TEMPLATE, title=title, xaxis_title="seconds since the rollout was queued",
                      yaxis_title="request", height=max(300, 18 * len(timeline["requests"]) + 160))
    return fig
