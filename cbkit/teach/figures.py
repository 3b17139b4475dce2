"""The notebooks' own figures: 01's map of what a static batch pads, 05's async rollout timeline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from cbkit.viz.figures import PALETTE, TEMPLATE

_CELLS = (("left padding", "#d9d9d9"), ("prompt", PALETTE[0]), ("completion", PALETTE[2]),
          ("after EOS (wasted)", PALETTE[3]))


def padding_figure(rollout: Any) -> go.Figure:
    """Every row x position of a ``generate`` rollout's static batch, coloured by what the slot holds."""
    if rollout.backend != "generate":
        raise ValueError("padding_figure draws the static batch of a 'generate' rollout; got a "
                         f"{rollout.backend!r} rollout (the CB engine packs sequences without padding).")
    comps, config = rollout.completions, rollout.engine_config
    width, steps = config["padded_prompt_len"], config["steps"]
    z = [[0] * (width - len(c.prompt_ids)) + [1] * len(c.prompt_ids) + [2] * len(c.completion_ids)
         + [3] * (steps - len(c.completion_ids)) for c in comps]
    share = 1 - sum(len(c.prompt_ids) + len(c.completion_ids) for c in comps) / (len(comps) * (width + steps))
    scale = [[(i + edge) / 4, color] for i, (_, color) in enumerate(_CELLS) for edge in (0, 1)]
    fig = go.Figure(go.Heatmap(
        z=z, zmin=-0.5, zmax=3.5, colorscale=scale, xgap=0, ygap=1 if len(comps) <= 64 else 0,
        colorbar={"tickvals": [0, 1, 2, 3], "ticktext": [k for k, _ in _CELLS], "title": {"text": "slot"}},
        hovertemplate="row %{y}, position %{x}<extra></extra>"))
    n = rollout.num_generations
    if len(comps) // n <= 32:
        for g in range(1, len(comps) // n):
            fig.add_hline(y=g * n - 0.5, line={"color": "black", "width": 1})
    fig.add_vline(x=width - 0.5, line={"color": "black", "width": 1, "dash": "dot"},
                  annotation_text="generation starts", annotation_position="top")
    fig.update_yaxes(title_text=f"row ({rollout.num_prompts} prompts x N={n})", autorange="reversed")
    fig.update_xaxes(title_text="position in the padded batch (tokens)")
    fig.update_layout(title=f"Static batch: {len(comps)} rows x {width + steps} positions, {share:.0%} of "
                            "all KV slots are padding (left or after EOS)",
                      template=TEMPLATE, height=max(380, 160 + 12 * len(comps)), margin={"t": 90})
    return fig


def async_timeline(timeline: Mapping[str, Any], train: Sequence[tuple[float, float, str]] = ()) -> go.Figure:
    """Requests as rows, a dot per token when sampled, coloured by policy version; `train`: (start, end, label)."""
    t0, requests = timeline["t0"], timeline["requests"]
    fig = go.Figure()
    for i, version in enumerate(sorted({v for r in requests for v in r["token_versions"]})):
        dots = [(t - t0, r["id"]) for r in requests
                for t, v in zip(r["token_times"], r["token_versions"], strict=False) if v == version]
        fig.add_scatter(x=[x for x, _ in dots], y=[y for _, y in dots], mode="markers",
                        name=f"policy version {version}",
                        marker=dict(color=PALETTE[i % len(PALETTE)], size=6, symbol="square"))
    for start, end, label in train:
        fig.add_vrect(x0=start - t0, x1=end - t0, fillcolor="#8C8C8C", opacity=0.15, line_width=0,
                      annotation_text=label, annotation_position="top left")
    for t, version in timeline.get("swaps", ()):
        fig.add_vline(x=t - t0, line=dict(color="#C44E52", dash="dash"),
                      annotation_text=f"update -> v{version}", annotation_position="bottom right")
    fig.update_layout(template=TEMPLATE, xaxis_title="seconds since the rollout was queued",
                      title="Async rollout: tokens coloured by the policy version that sampled them",
                      yaxis_title="request", height=max(300, 18 * len(requests) + 160))
    return fig
