"""Notebook 02's figures: sampling against policy logprobs, token by token, and the importance ratios between
them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from cbkit.viz.palette import PALETTE, TEMPLATE


def logprob_scatter(sampling: Sequence[float], policy: Sequence[float], *, title: str | None = None,
                    max_points: int = 20_000) -> go.Figure:
    """One dot per completion token: the sampler's logprob (x) against the policy's teacher-forced one (y).
    On the diagonal they agree; the title gives the largest disagreement. Beyond ``max_points`` tokens an
    evenly spaced subset is drawn (the title's maximum is over all of them)."""
    xs, ys = [float(v) for v in sampling], [float(v) for v in policy]
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"need one policy logprob per sampling logprob, got {len(xs)} and {len(ys)}.")
    finite = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(x) and math.isfinite(y)]
    worst = max((abs(x - y) for x, y in finite), default=float("nan"))
    stride = max(1, len(xs) // max_points)
    low = min(min(x for x, _ in finite), min(y for _, y in finite)) if finite else -1.0
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[low, 0], y=[low, 0], mode="lines", name="agreement (y = x)",
                             line={"color": "black", "dash": "dash", "width": 1}))
    fig.add_trace(go.Scattergl(x=xs[::stride], y=ys[::stride], mode="markers", name="a completion token",
                               marker={"size": 5, "color": PALETTE[1], "opacity": 0.6},
                               hovertemplate="sampling %{x:.4f}<br>policy %{y:.4f}<extra></extra>"))
    fig.update_xaxes(title_text="sampling logprob (from the rollout)")
    fig.update_yaxes(title_text="policy logprob (teacher-forced)")
    fig.update_layout(title=title or f"Sampling vs policy logprobs: {len(xs)} tokens, max |difference| {worst:.2e}",
                      template=TEMPLATE, height=480, legend={"orientation": "h", "y": -0.2, "x": 0})
    return fig


def logprob_differences(sampling: Sequence[float], policy: Sequence[float], *, title: str | None = None,
                        max_points: int = 20_000) -> go.Figure:
    """Where agreement is the point, the differences themselves: sampling minus teacher-forced logprob of each
    completion token, against its index in the rollout (left), and their histogram (right, on the same y axis). A
    y = x scatter of the logprobs cannot show differences of 1e-5 beside logprobs of -10; here 0 is the middle of
    the axis and the axis is as wide as the largest difference. Beyond ``max_points`` tokens an evenly spaced subset
    is drawn on the left (the histogram and the title count all of them)."""
    from plotly.subplots import make_subplots

    pairs = [(float(x), float(y)) for x, y in zip(sampling, policy, strict=False)]
    if len(sampling) != len(policy) or not pairs:
        raise ValueError(f"need one policy logprob per sampling logprob, got {len(sampling)} and {len(policy)}.")
    diffs = [x - y for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
    if not diffs:
        raise ValueError("no finite pair of logprobs to compare.")
    worst = max(abs(d) for d in diffs)
    mean = sum(abs(d) for d in diffs) / len(diffs)
    stride = max(1, len(diffs) // max_points)
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.75, 0.25], horizontal_spacing=0.03)
    fig.add_trace(go.Scattergl(x=list(range(0, len(diffs), stride)), y=diffs[::stride], mode="markers",
                               name="a completion token", marker={"size": 5, "color": PALETTE[1], "opacity": 0.6},
                               hovertemplate="token %{x}<br>difference %{y:.2e} nats<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Histogram(y=diffs, nbinsy=40, marker={"color": PALETTE[1]}, name="tokens", showlegend=False,
                               hovertemplate="%{y:.2e} nats: %{x} tokens<extra></extra>"), row=1, col=2)
    for col in (1, 2):
        fig.add_hline(y=0, line={"color": "black", "dash": "dash", "width": 1}, row=1, col=col)
    span = 1.1 * worst if worst > 0 else 1e-7  # exact agreement: a thin axis around 0, not plotly's default
    fig.update_yaxes(range=[-span, span], exponentformat="e", title_text="sampling - teacher-forced logprob (nats)",
                     row=1, col=1)
    fig.update_xaxes(title_text="completion token (rollout order)", row=1, col=1)
    fig.update_xaxes(title_text="tokens", row=1, col=2)
    fig.update_layout(title=title or f"{len(diffs)} tokens: max |difference| {worst:.1e}, mean {mean:.1e} nats",
                      template=TEMPLATE, height=420, showlegend=False)
    return fig


def ratio_summary(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the positive, finite ratios: what a histogram's legend and a notebook's printed
    line both quote, so the two cannot disagree. The median is the middle value (the mean of the two middle
    ones for an even count), as ``statistics.median``; ``torch.median`` would take the lower one."""
    vals = sorted(float(v) for v in values if float(v) > 0 and math.isfinite(float(v)))
    if not vals:
        raise ValueError("no positive, finite ratio to summarise.")
    return statistics.median(vals), vals[0], vals[-1]


def ratio_histogram(ratios: Mapping[str, Sequence[float]], *, title: str = "Importance ratios",
                    x_title: str = "ratio policy / sampler (log scale)", bins: int = 60,
                    band: tuple[float | None, float | None] | None = None) -> go.Figure:
    """Overlaid histograms of importance ratios, one per label, on a log10 axis so 0.5 and 2 sit equally far
    from 1. Every label uses the same bins, and heights are the percent of that label's items, so a label with
    all its mass at 1 shows as one tall bar rather than vanishing. A dashed line marks 1 (no correction); each
    legend entry gives the label's ``ratio_summary``. ``band=(clip_min, clip_max)`` shades the IS band: what
    falls outside it is truncated or masked (None: no bound on that side)."""
    logs: dict[str, list[float]] = {}
    for label, values in ratios.items():
        vals = [math.log10(float(v)) for v in values if float(v) > 0 and math.isfinite(float(v))]
        if vals:
            logs[label] = vals
    if not logs:
        raise ValueError("no positive, finite ratio to draw.")
    lo = min(min(v) for v in logs.values())
    hi = max(max(v) for v in logs.values())
    lo, hi = min(lo, -0.01), max(hi, 0.01)  # keep 1 (log 0) inside the axis
    if band is not None:  # keep the band's edges on the axis too
        lo = min(lo, math.log10(band[0]) - 0.05) if band[0] else lo
        hi = max(hi, math.log10(band[1]) + 0.05) if band[1] else hi
    size = (hi - lo) / bins
    fig = go.Figure()
    for i, (label, vals) in enumerate(logs.items()):
        median, low, high = ratio_summary([10**v for v in vals])
        fig.add_trace(go.Histogram(
            x=vals, name=f"{label}: median {median:.3g}, range {low:.3g} to {high:.3g}",
            opacity=0.6, marker={"color": PALETTE[i % len(PALETTE)]}, histnorm="percent",
            xbins={"start": lo, "end": hi + size, "size": size},
            hovertemplate="log10 ratio %{x}<br>%{y:.1f}% of items<extra></extra>",
        ))
    if band is not None:
        left = math.log10(band[0]) if band[0] else lo
        right = math.log10(band[1]) if band[1] else hi
        edges = f"[{band[0] if band[0] else 0:g}, {band[1] if band[1] else math.inf:g}]"
        fig.add_vrect(x0=left, x1=right, fillcolor="rgba(85,168,104,0.12)", line_width=0, layer="below",
                      annotation_text=f"IS band {edges}: kept", annotation_position="top left")
    fig.add_vline(x=0, line={"color": "black", "dash": "dash", "width": 1})
    # Ticks at round ratios, the roundest first, never closer than a ninth of the axis; 1 always.
    by_roundness = (1, 0.1, 10, 0.01, 100, 1e-3, 1e-4, 1e-5, 1e-6, 0.5, 2, 0.2, 5, 0.8, 1.25, 0.9, 1.1, 0.95, 1.05,
                    0.7, 1.5, 0.98, 1.02)
    ticks: list[float] = []
    for t in by_roundness:
        x = math.log10(t)
        if lo <= x <= hi and all(abs(x - math.log10(k)) >= (hi - lo) / 9 for k in ticks):
            ticks.append(t)
    ticks.sort()
    fig.update_xaxes(title_text=x_title, tickvals=[math.log10(t) for t in ticks], ticktext=[f"{t:g}" for t in ticks])
    fig.update_yaxes(title_text="% of items")
    fig.update_layout(title=title, barmode="overlay", template=TEMPLATE, height=440,
                      legend={"orientation": "h", "y": -0.25, "x": 0})
    return fig
