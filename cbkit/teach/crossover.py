"""Notebook 01's memory inversion: the planner's peaks over a range of N, and where CB's fixed pool drops below
generate()'s growing cache as the pool grows (`cbkit.measure.planner`'s `plan` and `crossover_n`, asked many times).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from cbkit.measure.planner import crossover_n, plan, pool_blocks
from cbkit.telemetry import kv_bytes_per_token
from cbkit.viz.palette import PALETTE, TEMPLATE


def crossover_vs_pool_figure(rows: Sequence[Mapping[str, Any]], *, swept: Sequence[int] = (),
                             chosen_bytes: int | None = None, max_n: int | None = None) -> go.Figure:
    """Where the memory inversion starts as the pool grows (`crossover_vs_pool` below): the
    planner's crossover N per pool size, the swept N shaded, the notebook's own pool marked. A pool with no
    crossover up to ``max_n`` is drawn at the top, marked as beyond it."""
    top = max_n or max((r["crossover_n"] or 0 for r in rows), default=1)
    xs = [r["pool_bytes"] / 2**30 for r in rows]
    ys = [r["crossover_n"] if r["crossover_n"] is not None else top for r in rows]
    text = ["" if r["crossover_n"] is not None else f"beyond N={top}" for r in rows]
    fig = go.Figure(go.Scatter(
        x=xs, y=ys, mode="lines+markers+text", text=text, textposition="top center", name="planner crossover",
        line={"color": PALETTE[0], "width": 2.5}, marker={"size": 9},
        hovertemplate="pool %{x:.1f} GiB<br>CB lighter from N=%{y}<extra></extra>"))
    if swept:
        fig.add_hrect(y0=min(swept), y1=max(swept), fillcolor=PALETTE[1], opacity=0.12, line_width=0,
                      annotation_text=f"swept N {min(swept)}-{max(swept)}", annotation_position="top left")
    if chosen_bytes:
        fig.add_vline(x=chosen_bytes / 2**30, line_dash="dot", annotation_text="this notebook's pool")
    fig.update_layout(template=TEMPLATE, title="The pool is a fixed price: where CB's peak drops below generate()'s",
                      xaxis_title="CB pool (GiB of KV, fixed up front)", yaxis_title="crossover N (planner)",
                      showlegend=False)
    return fig


def planned_points(config: Any, ns: Sequence[int], **plan_kwargs: Any) -> list[dict[str, Any]]:
    """The planner over a range of N, as sweep-shaped points (backend, N, planned_peak_bytes, kv_bytes) that
    `cbkit.viz.figures.memory_vs_n` draws next to, or instead of, measured ones. ``plan_kwargs`` go to `plan`
    (everything but ``num_generations``)."""
    points = []
    for n in ns:
        p = plan(config, num_generations=n, **plan_kwargs)
        points.append({"backend": "generate", "N": n, "status": "ok", "planned_peak_bytes": p.generate.peak_bytes,
                       "kv_bytes": p.generate.kv_bytes})
        points.append({"backend": "continuous", "N": n, "status": "ok",
                       "planned_peak_bytes": p.continuous.peak_bytes, "kv_bytes": p.continuous.pool_bytes})
    return points


def crossover_vs_pool(config: Any, pools_bytes: Sequence[int], *, page_size: int, max_n: int = 1024,
                      **plan_kwargs: Any) -> list[dict[str, Any]]:
    """The pool as a fixed price: for each pool size (bytes of KV, fixed as ``num_blocks``), the crossover N
    (`crossover_n`). A bigger pool costs more at every N, so generate() outgrows it later. ``plan_kwargs`` go to
    `plan` (``dtype_bytes`` among them); their ``cb_config`` may set other engine keys."""
    base = dict(plan_kwargs.pop("cb_config", None) or {})
    out = []
    for pool in pools_bytes:
        blocks = pool_blocks(config, int(pool), page_size=page_size, dtype_bytes=plan_kwargs["dtype_bytes"])
        cfg = {**base, "page_size": page_size, "num_blocks": blocks}
        out.append({"pool_bytes": blocks * page_size * kv_bytes_per_token(config, plan_kwargs["dtype_bytes"]),
                    "num_blocks": blocks,
                    "crossover_n": crossover_n(config, max_n=max_n, cb_config=cfg, **plan_kwargs)})
    return out
