"""The static figures: the sweep's points, the engine timeline, a static batch's padding, logprobs and
importance ratios; and the one palette every cbkit chart draws with.

The figures read the sweep's points (one dict per backend x N, see ``cbkit.measure.sweep``) and the engine timeline
(``cbkit.telemetry``). A run that ran out of memory or failed is *annotated* at its N and never drawn as a
zero: a missing measurement is not a small one.

The live display (``LiveChart``, the loop's and the sweep's live helpers) lives in ``cbkit.viz.live``; its names
stay importable from here for code written before the split.
"""

from __future__ import annotations

import html
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cbkit.telemetry import fmt_bytes
from cbkit.viz.palette import PALETTE, TEMPLATE, backend_color

__all__ = [
    "block_ids_figure",
    "engine_step_figure",
    "memory_vs_n",
    "logprob_scatter",
    "padding_figure",
    "ratio_histogram",
    "ratio_summary",
    "step_split_figure",
    "sweep_report",
    "throughput_vs_n",
    "first_token_waits",
    "timeline_figure",
    "workloads_figure",
    "write_report",
]


# --- the sweep's figures ------------------------------------------------------------------------------------


def throughput_vs_n(points: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Completion tokens/s vs N, one line per backend, the speed ratio to generate() printed at each point.
    One trace per backend; OOM and failed points are gaps in the line and annotated at their N."""
    fig = go.Figure()
    for backend in _backends(points):
        pts = _by_backend(points, backend)
        ns = [p["N"] for p in pts]
        ys = [p["tokens_per_s"] if _ok(p) else None for p in pts]
        fig.add_trace(go.Scatter(
            x=ns, y=ys, name=backend, mode="lines+markers", line={"color": backend_color(backend), "width": 2.5},
            marker={"size": 9}, connectgaps=False,
            hovertemplate=f"{backend}<br>N=%{{x}}<br>%{{y:.1f}} tokens/s<extra></extra>",
        ))
    _n_axis(fig, points, "speed_vs_generate")
    _annotate_failures(fig, points)
    fig.update_yaxes(title_text="completion tokens / s", rangemode="tozero")
    fig.update_layout(title="Rollout throughput vs N (under each N: speed vs generate())", template=TEMPLATE,
                      height=460, legend={"orientation": "h", "y": -0.2, "x": 0},
                      margin={"t": 90})
    return fig


def memory_vs_n(points: Sequence[Mapping[str, Any]], *, log_y: bool = False,
                marks: Mapping[str, int | None] | None = None) -> go.Figure:
    """Peak memory vs N per backend: measured (solid), analytic KV (dashed), planner prediction (open
    diamonds, when the points carry one). The memory ratio to generate() is printed under each N.

    ``log_y`` for ranges that span orders of magnitude (a planner run to N=512); ``marks`` (label -> N) draws a
    labelled vertical line at each N that is not None, e.g. where the planner puts the crossover."""
    unit, scale = _unit(max((v for p in points for v in (p.get("peak_mem_bytes"), p.get("kv_bytes"),
                                                            p.get("planned_peak_bytes")) if v), default=0))
    fig = go.Figure()
    for backend in _backends(points):
        pts = _by_backend(points, backend)
        ns = [p["N"] for p in pts]
        color = backend_color(backend)
        measured = [_scaled(p.get("peak_mem_bytes"), scale) if _ok(p) else None for p in pts]
        if any(v is not None for v in measured):
            fig.add_trace(go.Scatter(
                x=ns, y=measured, name=f"{backend}: measured peak", mode="lines+markers",
                line={"color": color, "width": 2.5}, marker={"size": 9}, legendgroup=backend, connectgaps=False,
                hovertemplate=f"{backend} measured<br>N=%{{x}}<br>%{{y:.1f}} {unit}<extra></extra>",
            ))
        # Analytic KV is what the configuration needs, so it is drawn for OOM points too.
        kv = [_scaled(p.get("kv_bytes"), scale) for p in pts]
        if any(v is not None for v in kv):
            fig.add_trace(go.Scatter(
                x=ns, y=kv, name=f"{backend}: KV (analytic)", mode="lines", legendgroup=backend,
                line={"color": color, "dash": "dash", "width": 1.5},
                hovertemplate=f"{backend} analytic KV<br>N=%{{x}}<br>%{{y:.1f}} {unit}<extra></extra>",
            ))
        planned = [_scaled(p.get("planned_peak_bytes"), scale) for p in pts]
        if any(v is not None for v in planned):
            fig.add_trace(go.Scatter(
                x=ns, y=planned, name=f"{backend}: planner", mode="markers", legendgroup=backend,
                marker={"color": color, "symbol": "diamond-open", "size": 12, "line": {"width": 2}},
                hovertemplate=f"{backend} planner<br>N=%{{x}}<br>%{{y:.1f}} {unit}<extra></extra>",
            ))
    kinds = sorted({p["peak_mem_kind"] for p in points if p.get("peak_mem_kind")})
    measured_as = " / ".join(_kind(k) for k in kinds) or "not measured"
    _n_axis(fig, points, "mem_vs_generate")
    _annotate_failures(fig, points)
    fig.update_yaxes(title_text=f"peak memory above weights ({unit})", rangemode="tozero")
    if log_y:
        fig.update_yaxes(type="log", rangemode="normal", title_text=f"peak memory above weights ({unit}, log scale)")
    for i, (label, n) in enumerate((marks or {}).items()):
        if n is not None:
            fig.add_vline(x=n, line={"color": "#333", "width": 1.5, "dash": "dot"})  # shapes: data units, log axis too
            fig.add_annotation(x=math.log10(n), y=1.0, yref="paper", yanchor="bottom", yshift=4 + 18 * i,
                               text=label, showarrow=False, font={"size": 12}, bgcolor="rgba(255,255,255,0.9)")
    fig.update_layout(title=f"Rollout memory vs N (measured as {measured_as}; under each N: memory vs generate())",
                      template=TEMPLATE,
                      height=500, legend={"orientation": "h", "y": -0.2, "x": 0}, margin={"t": 90})
    return fig


STEP_PHASES = (("rollout_s", "rollout"), ("old_logprob_s", "old-logprob forward"), ("update_s", "update"),
               ("other_s", "other"))


def step_split_figure(points: Sequence[Mapping[str, Any]]) -> go.Figure:
    """A full GRPO step per backend and N (`cbkit sweep --full-step`) as one stacked bar of its phases (rollout,
    old-logprob forward, update, other), with the step's speed-up over generate() beside the Amdahl ceiling its
    rollout's speed-up predicts. An async CB bar's rollout is what its trainer still waited for, with the overlap
    bought written beside it. Failed points are a labelled empty bar, never a zero-length one."""
    pts = sorted((p for p in points if p.get("step_s") is not None or not _ok(p)),
                 key=lambda p: (p["N"], p["backend"] != "generate", p["backend"]))
    labels = [f"N={p['N']} {p['backend']}" for p in pts]
    fig = go.Figure()
    for i, (key, name) in enumerate(STEP_PHASES):
        xs = [p.get(key) if _ok(p) else None for p in pts]
        shares = [p.get(key.replace("_s", "_roof_share")) if _ok(p) else None for p in pts]
        text = [f"{x:.1f} s" + (f" ({r:.0%} of roof)" if r is not None else "") if x is not None else ""
                for x, r in zip(xs, shares, strict=True)]
        fig.add_trace(go.Bar(y=labels, x=xs, name=name, orientation="h", marker={"color": PALETTE[i]},
                             text=text, textposition="inside", insidetextanchor="middle", textangle=0,
                             hovertemplate=f"{name}<br>%{{y}}<br>%{{x:.2f}} s<extra></extra>"))
    for label, p in zip(labels, pts, strict=True):
        if not _ok(p):
            note = str(p.get("status", "error")).upper()
        elif p["backend"] == "generate" or p.get("step_speedup") is None:
            note = f"step {p['step_s']:.3g} s, rollout {p.get('rollout_share') or 0:.0%} of it"
        else:
            ceiling = p.get("amdahl_ceiling")
            note = f"step {p['step_speedup']:.2f}x" + (f" vs Amdahl ceiling {ceiling:.2f}x" if ceiling else "")
            if p.get("overlap_s") is not None:  # async CB: its rollout bar is the wait; what the overlap hid
                note += f"<br>overlap bought {p['overlap_s']:.1f} s of CB's rollout"
        fig.add_annotation(y=label, x=1.0, xref="paper", xanchor="left", text=note, showarrow=False,
                           font={"size": 12, "color": "#b00" if not _ok(p) else "#222"})
    fig.update_layout(template=TEMPLATE, barmode="stack", title="One GRPO step, split by phase",
                      xaxis_title="seconds", height=max(300, 60 * len(pts) + 140),
                      legend={"orientation": "h", "y": -0.15, "x": 0, "traceorder": "normal"},
                      uniformtext={"minsize": 10, "mode": "hide"}, margin={"r": 260, "t": 60})
    fig.update_yaxes(autorange="reversed")
    return fig


def sweep_report(points: Sequence[Mapping[str, Any]], title: str = "cbkit N-sweep",
                 meta: Mapping[str, Any] | None = None) -> str:
    """One self-contained HTML page: the run's settings, both charts (plotly's JS inline, so it opens
    offline), every point as a table, and the ratios to generate() at each N."""
    charts = [
        throughput_vs_n(points).to_html(full_html=False, include_plotlyjs=True),
        memory_vs_n(points).to_html(full_html=False, include_plotlyjs=False),
    ]
    if any(p.get("step_s") is not None for p in points):  # a full-step sweep: where the step's time went
        charts.append(step_split_figure(points).to_html(full_html=False, include_plotlyjs=False))
    charts_html = "\n".join(charts)
    esc = html.escape
    meta_rows = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>" for k, v in (meta or {}).items())
    cols = [("backend", "backend", str), ("N", "N", str), ("status", "status", str),
            ("tokens_per_s", "tokens/s", lambda v: f"{v:.1f}"), ("rollout_s", "rollout s", lambda v: f"{v:.2f}"),
            ("peak_mem_bytes", "peak memory", fmt_bytes), ("peak_mem_kind", "measured as", _kind),
            ("kv_bytes", "KV (analytic)", fmt_bytes), ("planned_peak_bytes", "planner", fmt_bytes),
            ("kv_padding_share", "KV slots padding", lambda v: f"{v:.0%}"),
            ("speed_vs_generate", "speed vs generate", _ratio), ("mem_vs_generate", "memory vs generate", _ratio)]
    head = "".join(f"<th>{esc(label)}</th>" for _, label, _ in cols)
    body = "".join(
        "<tr class='{}'>{}</tr>".format(
            "" if _ok(p) else "failed",
            "".join(f"<td>{esc(fmt(p[k])) if p.get(k) is not None else '&ndash;'}</td>" for k, _, fmt in cols),
        )
        for p in sorted(points, key=lambda p: (p["N"], p["backend"] != "generate", p["backend"]))
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; white-space: nowrap; }}
th {{ background: #f3f3f3; }} tr.failed td {{ color: #b00; }}
</style></head><body>
<h1>{esc(title)}</h1>
<p>Ratios compare each backend with <code>generate()</code> at the same N, measured side by side in one
process (medians of repeats). Absolute times mean something only on a GPU; on a CPU, memory is RSS and
indicative. Points that ran out of memory or failed are marked at their N, never drawn as zero.</p>
<table>{meta_rows}</table>
{charts_html}
<h2>Points</h2>
<table><tr>{head}</tr>{body}</table>
{_ratio_table(points)}
</body></html>
"""


def write_report(points: Sequence[Mapping[str, Any]], path: str | os.PathLike,
                 meta: Mapping[str, Any] | None = None, title: str = "cbkit N-sweep") -> Path:
    """Write ``sweep_report`` to ``path`` and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sweep_report(points, title, meta), encoding="utf-8")
    return path


def _ratio_table(points: Sequence[Mapping[str, Any]]) -> str:
    others = [b for b in _backends(points) if b != "generate"]
    ns = sorted({p["N"] for p in points})
    if not others:
        return ""
    by = {(p["backend"], p["N"]): p for p in points}
    rows = []
    for n in ns:
        cells = [f"<td>{n}</td>"]
        for b in others:
            p = by.get((b, n))
            gen = by.get(("generate", n))
            if p is None:
                cells += ["<td>&ndash;</td>", "<td>&ndash;</td>"]
            elif not _ok(p) or (gen is not None and not _ok(gen)):
                failed = ", ".join(f"{q['backend']} {q['status'].upper()}" for q in (gen, p) if q and not _ok(q))
                cells += [f"<td colspan='2'>{html.escape(failed)}</td>"]
            else:
                cells += [f"<td>{_ratio(p.get('speed_vs_generate'))}</td>",
                          f"<td>{_ratio(p.get('mem_vs_generate'))}</td>"]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    head = "".join(f"<th>{html.escape(b)} speed</th><th>{html.escape(b)} memory</th>" for b in others)
    return f"<h2>Ratios to generate()</h2><table><tr><th>N</th>{head}</tr>{''.join(rows)}</table>"


# --- the engine timeline ------------------------------------------------------------------------------------


def timeline_figure(timeline: Mapping[str, Any], occupancy: Mapping[str, Any] | None = None,
                    *, token_ticks: bool | None = None) -> go.Figure:
    """Recycling made visible. Top: one bar per request from its start to its end, coloured by group, with a
    tick per generated token. Below it, sharing the time axis: sequences running, then KV blocks in use
    against the pool size.

    ``occupancy`` defaults to ``cbkit.telemetry.occupancy(timeline)``. Token ticks are drawn when there are
    at most 20k tokens unless ``token_ticks`` says otherwise.
    """
    if occupancy is None:
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
    fig.add_trace(go.Scatter(x=t, y=list(occupancy["running"]), name="sequences running", mode="lines",
                             line={"shape": "hv", "color": PALETTE[0], "width": 2}), row=2, col=1)
    fig.add_trace(go.Scatter(x=t, y=list(occupancy["blocks_in_use"]), name="KV blocks in use", mode="lines",
                             fill="tozeroy", line={"shape": "hv", "color": PALETTE[3], "width": 2}), row=3, col=1)
    pool = occupancy.get("pool_blocks") or 0
    if pool and t:
        fig.add_trace(go.Scatter(x=[min(t), max(t)], y=[pool, pool], name=f"pool: {pool} blocks", mode="lines",
                                 line={"color": "black", "dash": "dash", "width": 1.5}), row=3, col=1)
    fig.update_yaxes(title_text="request", autorange="reversed", row=1, col=1)
    fig.update_yaxes(title_text="running", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="KV blocks", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title_text="seconds since the rollout started", row=3, col=1)
    fig.update_layout(
        title=f"CB engine timeline: {len(requests)} requests, page size {timeline['page_size']} tokens",
        template=TEMPLATE, barmode="overlay", bargap=0.15, height=max(640, 380 + 8 * len(requests)),
        legend={"orientation": "h", "yanchor": "top", "y": -0.12, "x": 0}, margin={"b": 120},
    )
    return fig


def first_token_waits(timeline: Mapping[str, Any]) -> dict[int, float]:
    """Seconds from each request's admission to its first generated token (prefill plus any wait for a slot),
    by request id: what the timeline hatches. Requests that generated nothing are left out."""
    return {r["id"]: r["token_times"][0] - r["start"] for r in timeline["requests"] if r["token_times"]}


# --- the static batch's padding -----------------------------------------------------------------------------

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
        title=f"Static batch: {len(comps)} rows x {width + steps} positions, {share:.0%} of token slots are padding",
        template=TEMPLATE, height=max(380, 160 + 12 * len(comps)), margin={"t": 90},
    )
    return fig


# --- logprobs and importance ratios -------------------------------------------------------------------------


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


# --- helpers ------------------------------------------------------------------------------------------------


def _ok(p: Mapping[str, Any]) -> bool:
    return p.get("status", "ok") == "ok"


def _backends(points: Sequence[Mapping[str, Any]]) -> list[str]:
    seen = list(dict.fromkeys(p["backend"] for p in points))
    return sorted(seen, key=lambda b: (b != "generate", b))  # generate first: the reference


def _by_backend(points: Sequence[Mapping[str, Any]], backend: str) -> list[Mapping[str, Any]]:
    return sorted((p for p in points if p["backend"] == backend), key=lambda p: p["N"])


def _n_axis(fig: go.Figure, points: Sequence[Mapping[str, Any]], ratio_key: str | None = None) -> None:
    ns = sorted({p["N"] for p in points})
    # N grows geometrically in a sweep (8, 16, 32, 64): a log axis spaces the points evenly. Ratios to generate()
    # go under each N's tick, in the backend's colour: a label beside a marker ends up on another marker.
    by = {(p["backend"], p["N"]): p for p in points}
    others = [b for b in _backends(points) if b != "generate"]

    def tick(n: int) -> str:
        if ratio_key is None:
            return str(n)
        labels = [f"<span style='color:{backend_color(b)}'>{_ratio(by[(b, n)].get(ratio_key))}</span>"
                  for b in others if (b, n) in by and _ok(by[(b, n)]) and by[(b, n)].get(ratio_key) is not None]
        return "<br>".join([str(n), *labels])

    fig.update_xaxes(title_text="N (completions per prompt)", type="log", tickvals=ns, ticktext=[tick(n) for n in ns],
                     range=[math.log10(min(ns)) - 0.12, math.log10(max(ns)) + 0.12] if ns else None)


def _annotate_failures(fig: go.Figure, points: Sequence[Mapping[str, Any]]) -> None:
    failed: dict[int, list[str]] = {}
    for p in points:
        if not _ok(p):
            failed.setdefault(p["N"], []).append(f"{p['backend']}: {str(p.get('status', 'error')).upper()}")
    for n, labels in failed.items():
        # Above the plot area, so it never hides a line; annotations on a log axis take log10(x).
        fig.add_annotation(x=math.log10(n), y=1.0, yref="paper", yanchor="bottom", yshift=4,
                           text="<br>".join(labels), showarrow=False, font={"color": "#b00", "size": 13},
                           bgcolor="rgba(255,255,255,0.9)", bordercolor="#b00", borderwidth=1)
        fig.add_vline(x=n, line={"color": "#b00", "width": 1, "dash": "dot"})  # shapes: data units, log axis too


def _unit(max_bytes: float) -> tuple[str, float]:
    return ("GiB", 1024**3) if max_bytes >= 2 * 1024**3 else ("MiB", 1024**2)


def _scaled(v: float | None, scale: float) -> float | None:
    return None if v is None else v / scale


def _kind(kind: str) -> str:
    return {"cuda_allocated": "CUDA allocated", "cpu_rss": "CPU RSS"}.get(kind, kind)


def _ratio(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def crossover_vs_pool_figure(rows: Sequence[Mapping[str, Any]], *, swept: Sequence[int] = (),
                             chosen_bytes: int | None = None, max_n: int | None = None) -> go.Figure:
    """Where the memory inversion starts as the pool grows (`cbkit.measure.planner.crossover_vs_pool`): the
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
# --- the engine's mechanism, observed (cbkit.rollout.engine_trace) ---------------------------------------------


def engine_step_figure(step: Any, page_size: int | None = None) -> go.Figure:
    """One step of transformers' CB engine as its scheduler built it (an ``EngineStep`` from
    ``cbkit.rollout.engine_trace``): on top, the step's query tokens packed back to back, a bar per request,
    prefill chunks next to single decode tokens, no padding anywhere; below, the block table each request reads
    in that step, the engine's own block ids, a block that several requests read at once (a shared prompt page)
    marked as shared."""
    requests = list(step.requests)
    if not requests:
        raise ValueError("engine_step_figure: the step scheduled no request.")
    labels = [f"{r.request_id} ({r.phase})" for r in requests]
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
    per (request, block) for as long as the request's block table held it, coloured by request. A cross marks
    recycling as the engine did it: a block taken by a request after another had released it."""
    held = trace.holdings()
    order = list(dict.fromkeys(r.request_id for s in trace.steps for r in s.requests))
    fig = go.Figure()
    for i, rid in enumerate(order):
        xs: list[Any] = []
        ys: list[Any] = []
        for b, (first, last, _) in sorted(held.get(rid, {}).items()):
            xs += [first - 0.4, last + 0.4, None]
            ys += [b, b, None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=rid, showlegend=False,
                                 line={"color": PALETTE[i % len(PALETTE)], "width": 5},
                                 hovertemplate=f"{rid}: block %{{y}}, step %{{x:.0f}}<extra></extra>"))
    reuses = trace.reuses()
    if reuses:
        fig.add_trace(go.Scatter(
            x=[r.first_step for r in reuses], y=[r.block for r in reuses], mode="markers",
            name="recycled: taken after another request released it",
            marker={"symbol": "x", "size": 9, "color": "black"},
            text=[f"block {r.block}: {r.released_by} held it to step {r.last_step}, {r.taken_by} from step "
                  f"{r.first_step}" for r in reuses], hovertemplate="%{text}<extra></extra>"))
    pool = f" of a {trace.pool_blocks}-block pool" if trace.pool_blocks else ""
    fig.update_layout(
        title=f"The engine's own block ids per request over {len(trace.steps)} steps: {len(reuses)} hand-overs"
              f" of {len({r.block for r in reuses})} distinct blocks{pool}",
        template=TEMPLATE, height=520, legend={"orientation": "h", "y": -0.15, "x": 0})
    fig.update_xaxes(title_text="engine step (one forward pass)")
    fig.update_yaxes(title_text="KV block id")
    return fig


def workloads_figure(by_workload: Mapping[str, Sequence[Mapping[str, Any]]]) -> go.Figure:
    """Several workloads' sweeps in one figure (workload -> its points): CB's speed relative to generate() at
    each N (top, the parity band of `cbkit.measure.advise.versus_parity` shaded) next to the static batch's
    padding share at the same N (bottom), so the one thing that differs between the workloads, the length
    spread, sits under the speed it buys."""
    from cbkit.measure.advise import PARITY_MARGIN

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, row_heights=[0.6, 0.4])
    ns: set[int] = set()
    for i, (workload, points) in enumerate(by_workload.items()):
        color = PALETTE[(i + 2) % len(PALETTE)]
        cb = sorted((p for p in points if _ok(p) and p["backend"] == "continuous"
                     and p.get("speed_vs_generate") is not None), key=lambda p: p["N"])
        gen = sorted((p for p in points if _ok(p) and p["backend"] == "generate"
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
