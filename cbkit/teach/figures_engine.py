"""Notebook 01's figures of the CB engine at work: the timeline of a rollout (requests, tokens, blocks in use
against the pool) and, from `cbkit.rollout.engine_trace`, one engine step's packed batch and block tables and every
block id the engine handed over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cbkit.rollout.engine import is_helper
from cbkit.viz.palette import PALETTE, TEMPLATE

# 24 distinct colours (plotly's Dark24; `qualitative` is a lazily loaded attribute mypy cannot see)
REQUEST_COLORS: tuple[str, ...] = tuple(plotly.colors.qualitative.Dark24)  # type: ignore[attr-defined]
HELPER_COLOR = "#9e9e9e"  # cbkit's own helper requests: grey, apart from every completion's colour


def timeline_figure(timeline: Mapping[str, Any], occupancy: Mapping[str, Any] | None = None,
                    *, trace: Any = None, token_ticks: bool | None = None) -> go.Figure:
    """Recycling made visible. Top: one bar per request from its start to its end, coloured by group, with a
    tick per generated token. Below it, sharing the time axis: sequences running, then KV blocks in use
    against the pool size.

    With ``trace`` (the ``EngineTrace`` of the same call) a bar starts at the step the scheduler first gave the
    request tokens, and the two lower rows are the engine's record: completions in each step, blocks in the block
    tables. Without it, a bar starts at the engine's ``lifespan[0]`` (stamped when a request leaves PENDING, which a
    prefix-cache match does even when scheduling then fails) and the rows are ``occupancy``, by default
    ``cbkit.telemetry.occupancy(timeline)``, a model from those clocks. Token ticks are drawn when there are at most
    20k tokens unless ``token_ticks`` says otherwise.
    """
    if trace is not None and trace.steps:
        timeline = scheduled_timeline(timeline, trace)
        steps = trace.steps
        held = trace.blocks_in_use()
        occupancy = {"t": [s.t - timeline["t0"] for s in steps],
                     "running": [sum(not r.helper for r in s.requests) for s in steps],
                     "blocks_in_use": held, "pool_blocks": trace.pool_blocks}
    elif occupancy is None:
        from cbkit.telemetry import occupancy as compute_occupancy

        occupancy = compute_occupancy(timeline)
    t0 = timeline["t0"]
    requests = sorted(timeline["requests"], key=lambda r: r["id"])
    # Three rows rather than one with two y axes: two step lines on twin axes cross and align by accident.
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.56, 0.2, 0.24])
    groups = sorted({r["group"] for r in requests})
    for g in groups:
        rs = [r for r in requests if r["group"] == g]
        fig.add_trace(go.Bar(
            orientation="h", y=[r["id"] for r in rs], base=[r["start"] - t0 for r in rs],
            x=[r["end"] - r["start"] for r in rs], name=f"group {g}", showlegend=len(groups) <= 12,
            marker={"color": PALETTE[g % len(PALETTE)], "line": {"width": 0}},
            customdata=[[r["prompt_len"], len(r["token_times"])] for r in rs],
            hovertemplate=("request %{y} (group " + str(g) + ")<br>from %{base:.3f} s for %{x:.3f} s"
                           "<br>prompt %{customdata[0]} tokens, generated %{customdata[1]}<extra></extra>"),
        ), row=1, col=1)
    # Admitted but not yet generating: the engine holds the request's blocks while it waits for a batch slot
    # (and for its prefill). Hatched, so a starved request reads apart from one that is decoding.
    waiting = [r for r in requests if r["token_times"]]
    fig.add_trace(go.Bar(
        orientation="h", y=[r["id"] for r in waiting], base=[r["start"] - t0 for r in waiting],
        x=[r["token_times"][0] - r["start"] for r in waiting], name="admitted, waiting for its first token",
        marker={"color": "rgba(255,255,255,0.75)", "pattern": {"shape": "/", "fgcolor": "#555", "size": 6},
                "line": {"width": 0}},
        hovertemplate="request %{y}: admitted at %{base:.3f} s, first token %{x:.3f} s later<extra></extra>",
    ), row=1, col=1)
    total_tokens = sum(len(r["token_times"]) for r in requests)
    if token_ticks if token_ticks is not None else total_tokens <= 20_000:
        fig.add_trace(go.Scatter(
            x=[t - t0 for r in requests for t in r["token_times"]],
            y=[r["id"] for r in requests for _ in r["token_times"]],
            mode="markers", name="a generated token",
            marker={"symbol": "line-ns-open", "size": 6, "line": {"width": 1, "color": "rgba(255,255,255,0.55)"}},
            hovertemplate="request %{y}: token at %{x:.3f} s<extra></extra>",
        ), row=1, col=1)
    t = list(occupancy["t"])
    fig.add_trace(go.Scatter(x=t, y=list(occupancy["running"]), name="completions in the step" if trace is not None else "sequences running", mode="lines",
                             line={"shape": "hv", "color": PALETTE[0], "width": 2}), row=2, col=1)
    fig.add_trace(go.Scatter(x=t, y=list(occupancy["blocks_in_use"]), name="KV blocks in block tables" if trace is not None else "KV blocks in use", mode="lines",
                             fill="tozeroy", line={"shape": "hv", "color": PALETTE[3], "width": 2}), row=3, col=1)
    pool = occupancy.get("pool_blocks") or 0
    if pool and t:
        fig.add_trace(go.Scatter(x=[min(t), max(t)], y=[pool, pool], name=f"pool: {pool} blocks", mode="lines",
                                 line={"color": "black", "dash": "dash", "width": 1.5}), row=3, col=1)
    fig.update_yaxes(title_text="request", autorange="reversed", row=1, col=1)
    fig.update_yaxes(title_text="in the step" if trace is not None else "running", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="KV blocks", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title_text="seconds since the rollout started", row=3, col=1)
    fig.update_layout(
        title=f"CB engine timeline: {len(requests)} requests, page size {timeline['page_size']} tokens",
        template=TEMPLATE, barmode="overlay", bargap=0.15, height=max(640, 380 + 8 * len(requests)),
        legend={"orientation": "h", "yanchor": "top", "y": -0.12, "x": 0}, margin={"b": 120},
    )
    return fig


def scheduled_timeline(timeline: Mapping[str, Any], trace: Any) -> dict[str, Any]:
    """The timeline with each request's ``start`` moved to when the scheduler first gave it tokens (its step's
    ``t`` in the ``EngineTrace`` of the same call, matched by ``engine_id``; the same perf_counter clock)."""
    first: dict[str, float] = {}
    for step in trace.steps:
        for r in step.requests:
            first.setdefault(r.request_id, step.t)
    missing = [r["id"] for r in timeline["requests"] if r.get("engine_id") not in first]
    if missing:
        raise ValueError(f"requests {missing[:5]} of the timeline are not in the trace: pass the trace recorded around "
                         "the same call (`with record_engine_steps() as trace:`), with a timeline that has engine_id.")
    return {**timeline, "requests": [dict(r, start=first[r["engine_id"]]) for r in timeline["requests"]]}


def first_token_waits(timeline: Mapping[str, Any]) -> dict[int, float]:
    """Seconds from each request's admission to its first generated token (prefill plus any wait for a slot),
    by request id: what the timeline hatches. Requests that generated nothing are left out."""
    return {r["id"]: r["token_times"][0] - r["start"] for r in timeline["requests"] if r["token_times"]}


def engine_step_figure(step: Any, page_size: int | None = None) -> go.Figure:
    """One step of transformers' CB engine as its scheduler built it (an ``EngineStep`` from
    ``cbkit.rollout.engine_trace``): on top, the step's query tokens packed back to back, a bar per request,
    prefill chunks next to single decode tokens, no padding anywhere; below, the block table each request reads
    in that step, the engine's own block ids, a block that several requests read at once (a shared prompt page)
    marked as shared."""
    requests = list(step.requests)
    if not requests:
        raise ValueError("engine_step_figure: the step scheduled no request.")
    labels = [f"{r.request_id} ({'cbkit helper, ' if r.helper else ''}{r.phase})" for r in requests]
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.3, row_heights=[0.3, 0.7],
                        subplot_titles=("the packed batch: each request's query tokens, back to back",
                                        "the block table each request reads (engine block ids)"))
    colors = {"prefill": PALETTE[1], "decode": PALETTE[0]}
    offset = 0
    for r, label in zip(requests, labels, strict=True):
        what = (f"prompt tokens {r.past_len}..{r.past_len + r.query_len - 1}" if r.phase == "prefill"
                else f"1 token at position {r.past_len}")
        fig.add_trace(go.Bar(x=[r.query_len], y=["batch"], base=[offset], orientation="h", name=r.phase,
                             marker={"color": colors[r.phase], "line": {"color": "white", "width": 1}},
                             legendgroup=r.phase, showlegend=False, text=[r.request_id], textposition="inside",
                             insidetextanchor="middle",
                             hovertemplate=f"{label}: {what}<br>batch positions {offset}..{offset + r.query_len - 1}"
                                           "<extra></extra>"), row=1, col=1)
        offset += r.query_len
    for phase, color in colors.items():  # one legend entry per phase
        fig.add_trace(go.Bar(x=[None], y=["batch"], name=f"{phase} tokens", marker={"color": color},
                             orientation="h"), row=1, col=1)
    readers: dict[int, int] = {}
    for r in requests:
        for b in r.blocks:
            readers[b] = readers.get(b, 0) + 1
    width = max(len(r.blocks) for r in requests)
    z = [[(1 if readers[b] > 1 else 0) for b in r.blocks] + [None] * (width - len(r.blocks)) for r in requests]
    text = [[str(b) for b in r.blocks] + [""] * (width - len(r.blocks)) for r in requests]
    fig.add_trace(go.Heatmap(z=z, text=text, texttemplate="%{text}", zmin=0, zmax=1, showscale=False,
                             colorscale=[[0, "#d9e3f0"], [0.5, "#d9e3f0"], [0.5, "#f3d9c4"], [1, "#f3d9c4"]],
                             x=[f"page {i}" for i in range(width)], y=labels, xgap=2, ygap=2,
                             hovertemplate="%{y}, %{x}: block %{text}<extra></extra>"), row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_xaxes(title_text="position in the packed batch (tokens)", row=1, col=1)
    pages = f" of {page_size} tokens" if page_size else ""
    fig.update_xaxes(title_text=f"the request's KV pages{pages}, in order (shaded orange: read by several "
                                "requests of this step, a shared prompt page)", row=2, col=1)
    phases = {p: sum(r.phase == p for r in requests) for p in ("prefill", "decode")}
    fig.update_layout(barmode="overlay", template=TEMPLATE, height=260 + 28 * len(requests),
                      title=f"Engine step {step.index}: {step.tokens} tokens from {len(requests)} requests "
                            f"({phases['prefill']} prefilling, {phases['decode']} decoding), no padding",
                      legend={"orientation": "h", "y": 1.12, "x": 0}, margin={"t": 110})
    return fig


def block_ids_figure(trace: Any) -> go.Figure:
    """Every KV block id the engine gave each request, over the engine's steps (an ``EngineTrace``): one line
    per (request, block) for as long as the request's block table held it, a colour and a legend entry per
    request, cbkit's helper requests (the prefill of each shared prompt) in grey and named so. A cross marks
    recycling as the engine did it: a block taken by a request after another had released it."""
    held = trace.holdings()
    order = list(dict.fromkeys(r.request_id for s in trace.steps for r in s.requests))
    completions = [rid for rid in order if not is_helper(rid)]
    # One colour per completion: 24 distinct ones (plotly's Dark24) before any repeats; the legend names each.
    colors = {rid: REQUEST_COLORS[i % len(REQUEST_COLORS)] for i, rid in enumerate(completions)}
    fig = go.Figure()
    for rid in order:
        helper = is_helper(rid)
        xs: list[Any] = []
        ys: list[Any] = []
        for b, (first, last, _) in sorted(held.get(rid, {}).items()):
            xs += [first - 0.4, last + 0.4, None]
            ys += [b, b, None]
        name = f"{rid} (cbkit helper: a shared prompt's prefill)" if helper else rid
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=name, legendgroup="helpers" if helper else rid,
                                 line={"color": HELPER_COLOR if helper else colors[rid], "width": 3 if helper else 5},
                                 hovertemplate=f"{name}: block %{{y}}, step %{{x:.0f}}<extra></extra>"))
    reuses = trace.reuses()
    if reuses:
        fig.add_trace(go.Scatter(
            x=[r.first_step for r in reuses], y=[r.block for r in reuses], mode="markers",
            name="recycled: taken after another request released it",
            marker={"symbol": "x", "size": 9, "color": "black"},
            text=[f"block {r.block}: {r.released_by} held it to step {r.last_step}, {r.taken_by} from step "
                  f"{r.first_step}" for r in reuses], hovertemplate="%{text}<extra></extra>"))
    pool = f" of a {trace.pool_blocks}-block pool" if trace.pool_blocks else ""
    helpers = sum(is_helper(r.released_by) for r in reuses)
    fig.update_layout(
        title=f"The engine's own block ids per request over {len(trace.steps)} steps: {len(reuses)} hand-overs"
              f" of {len({r.block for r in reuses})} distinct blocks{pool}"
              + (f" ({helpers} from cbkit's helper prefills)" if helpers else ""),
        template=TEMPLATE, height=560, legend={"title": {"text": "request"}, "font": {"size": 10}})
    fig.update_xaxes(title_text="engine step (one forward pass)")
    fig.update_yaxes(title_text="KV block id")
    return fig
