"""What a static batch wastes, drawn: notebook 01's row-by-position map of a `generate()` rollout's padding."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from cbkit.viz.figures import PALETTE, TEMPLATE

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
