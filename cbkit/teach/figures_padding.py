"""What a static batch wastes, drawn: notebook 01's row-by-position map of a `generate()` rollout's padding, and
notebook 03's CB speed next to the padding share of each workload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cbkit.viz.palette import PALETTE, TEMPLATE

_CELL_KINDS = ("left padding", "prompt", "completion", "after EOS (wasted)")


_CELL_COLORS = ("#d9d9d9", PALETTE[0], PALETTE[2], PALETTE[3])  # grey: nothing there


def padding_figure(rollout: Any) -> go.Figure:
    """For a ``generate`` rollout: every row x position of the static batch, coloured as left padding,
    prompt, completion, or the slots a finished row still occupies until the longest row ends. The title
    gives the share of computed token slots that were padding (same definition as ``kv_accounting``)."""
    if rollout.backend != "generate":
        raise ValueError(
            f"padding_figure draws the static batch of a 'generate' rollout; got a {rollout.backend!r} rollout "
            "(the CB engine packs sequences without padding)."
        )
    cfg = rollout.engine_config
    comps = rollout.completions
    width = cfg.get("padded_prompt_len") or max(len(c.prompt_ids) for c in comps)
    steps = cfg.get("steps") or max(len(c.completion_ids) for c in comps)
    z = []
    for c in comps:
        pad, prompt, done = width - len(c.prompt_ids), len(c.prompt_ids), len(c.completion_ids)
        z.append([0] * pad + [1] * prompt + [2] * done + [3] * (steps - done))
    slots = len(comps) * (width + steps)
    useful = sum(len(c.prompt_ids) + len(c.completion_ids) for c in comps)
    share = 1 - useful / slots
    scale = []
    for i, color in enumerate(_CELL_COLORS):
        scale += [[i / 4, color], [(i + 1) / 4, color]]
    fig = go.Figure(go.Heatmap(
        z=z, zmin=-0.5, zmax=3.5, colorscale=scale, xgap=0, ygap=1 if len(comps) <= 64 else 0,
        colorbar={"tickvals": [0, 1, 2, 3], "ticktext": list(_CELL_KINDS), "title": {"text": "slot"}},
        hovertemplate="row %{y}, position %{x}<extra></extra>",
    ))
    n = rollout.num_generations
    if len(comps) // n <= 32:
        for g in range(1, len(comps) // n):
            fig.add_hline(y=g * n - 0.5, line={"color": "black", "width": 1})
    fig.add_vline(x=width - 0.5, line={"color": "black", "width": 1, "dash": "dot"},
                  annotation_text="generation starts", annotation_position="top")
    fig.update_yaxes(title_text=f"row ({rollout.num_prompts} prompts x N={n})", autorange="reversed")
    fig.update_xaxes(title_text="position in the padded batch (tokens)")
    fig.update_layout(
        title=f"Static batch: {len(comps)} rows x {width + steps} positions, {share:.0%} of all KV slots are padding (left or after EOS)",
        template=TEMPLATE, height=max(380, 160 + 12 * len(comps)), margin={"t": 90},
    )
    return fig


def workloads_figure(by_workload: Mapping[str, Sequence[Mapping[str, Any]]]) -> go.Figure:
    """Several workloads' sweeps in one figure (workload -> its points): CB's speed relative to generate() at
    each N (top, the parity band of `cbkit.measure.planner.versus_parity` shaded) next to the static batch's
    padding share at the same N (bottom), so the one thing that differs between the workloads, the length
    spread, sits under the speed it buys."""
    from cbkit.measure.planner import PARITY_MARGIN

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.6, 0.4])
    ns: set[int] = set()
    for i, (workload, points) in enumerate(by_workload.items()):
        color = PALETTE[(i + 2) % len(PALETTE)]
        cb = sorted((p for p in points if p.get("status", "ok") == "ok" and p["backend"] == "continuous"
                     and p.get("speed_vs_generate") is not None), key=lambda p: p["N"])
        gen = sorted((p for p in points if p.get("status", "ok") == "ok" and p["backend"] == "generate"
                      and p.get("decode_padding_share") is not None), key=lambda p: p["N"])
        ns |= {p["N"] for p in cb} | {p["N"] for p in gen}
        fig.add_trace(go.Scatter(x=[p["N"] for p in cb], y=[p["speed_vs_generate"] for p in cb], name=workload,
                                 mode="lines+markers", line={"color": color, "width": 2.5}, legendgroup=workload,
                                 hovertemplate=f"{workload}, N=%{{x}}: CB at %{{y:.2f}}x generate()<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Bar(x=[p["N"] for p in gen], y=[p["decode_padding_share"] for p in gen],
                             name=f"{workload}: padding share", marker={"color": color}, legendgroup=workload,
                             showlegend=False, offsetgroup=workload,
                             hovertemplate=f"{workload}, N=%{{x}}: %{{y:.0%}} of the static batch's decode slots "
                                           "are padding<extra></extra>"), row=2, col=1)
    if ns:
        lo, hi = min(ns), max(ns)
        fig.add_trace(go.Scatter(x=[lo, hi, hi, lo], y=[1 - PARITY_MARGIN] * 2 + [1 + PARITY_MARGIN] * 2,
                                 fill="toself", mode="none", fillcolor="rgba(0,0,0,0.08)",
                                 name=f"about equal (within {PARITY_MARGIN:.0%})", hoverinfo="skip"), row=1, col=1)
    fig.update_xaxes(type="log", tickvals=sorted(ns), title_text="N (completions per prompt)", row=2, col=1)
    fig.update_xaxes(type="log", tickvals=sorted(ns), row=1, col=1)
    fig.update_yaxes(title_text="CB speed / generate()", row=1, col=1)
    fig.update_yaxes(title_text="static batch padding", tickformat=".0%", rangemode="tozero", row=2, col=1)
    fig.update_layout(title="CB against generate() for each workload, and the padding each workload gives a "
                            "static batch", template=TEMPLATE, height=560, barmode="group",
                      legend={"orientation": "h", "y": -0.15, "x": 0})
    return fig
