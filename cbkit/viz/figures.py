"""cbkit's figures: one palette (a backend keeps its colour in every chart), the sweep's figures and HTML
report (`cbkit sweep`, `cbkit report`), a training run's reward curve (`cbkit plot`), figures as PNG images.
A failed run is annotated at its N, never drawn as a zero: a missing measurement is not a small one."""

from __future__ import annotations

import asyncio
import html
import math
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from cbkit.jsonl import read_jsonl

PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
           "#CCB974", "#64B5CD")
BACKEND_COLORS = {"generate": PALETTE[0], "continuous": PALETTE[1]}
TEMPLATE = "plotly_white"
Points = Sequence[Mapping[str, Any]]


def backend_color(backend: str) -> str:
    """A backend's colour: fixed for cbkit's two, else a stable pick (crc32, unlike hash())."""
    return BACKEND_COLORS.get(backend, PALETTE[zlib.crc32(backend.encode()) % len(PALETTE)])


def _solid(color: str) -> dict[str, Any]:
    return {"mode": "lines+markers", "marker": {"size": 9}, "line": {"color": color, "width": 2.5}}


def throughput_vs_n(points: Points) -> go.Figure:
    """Completion tokens/s vs N, one line per backend; under each N, the speed ratio to generate()."""
    return _vs_n(points, [("tokens_per_s", "", _solid)], 1, "tokens/s", "speed_vs_generate",
                 "completion tokens / s", "Rollout throughput vs N (under each N: speed vs generate())", 460)


def memory_vs_n(points: Points) -> go.Figure:
    """Peak memory vs N per backend: measured, analytic KV and the planner's; under each N, the ratio to generate()."""
    keys = ("peak_mem_bytes", "kv_bytes", "planned_peak_bytes")
    biggest = max((p.get(k) or 0 for p in points for k in keys), default=0)
    unit, scale = ("GiB", 1024**3) if biggest >= 2 * 1024**3 else ("MiB", 1024**2)
    traces = [(keys[0], ": measured peak", _solid),
              (keys[1], ": KV (analytic)", lambda c: {"mode": "lines", "line": {"color": c, "dash": "dash"}}),
              (keys[2], ": planner", lambda c: {"mode": "markers", "marker": {
                  "color": c, "symbol": "diamond-open", "size": 12, "line": {"width": 2}}})]
    names = {"cuda_allocated": "CUDA allocated", "cpu_rss": "CPU RSS"}
    kinds = sorted({p["peak_mem_kind"] for p in points if p.get("peak_mem_kind")})
    measured_as = " / ".join(names.get(k, k) for k in kinds) or "not measured"
    return _vs_n(points, traces, scale, unit, "mem_vs_generate", f"peak memory above weights ({unit})",
                 f"Rollout memory vs N (measured as {measured_as}; under each N: memory vs generate())", 500)


def _vs_n(points: Points, traces: Sequence[tuple[str, str, Callable[[str], dict]]], scale: float, unit: str,
          ratio_key: str, y_title: str, title: str, height: int) -> go.Figure:
    """Per backend a trace for each (key, name suffix, style) against N (log axis), each ratio to generate()
    under its N (beside a marker it lands on another), every failed point marked above the plot."""
    fig = go.Figure()
    for backend in _backends(points):
        pts = sorted((p for p in points if p["backend"] == backend), key=lambda p: p["N"])
        for i, (key, suffix, style) in enumerate(traces):
            # a failed point measured nothing (a gap); what its configuration needs (KV, planned) is drawn
            ys = [p[key] / scale if p.get(key) is not None and (i > 0 or _ok(p)) else None for p in pts]
            if any(v is not None for v in ys):
                hover = f"{backend}{suffix}<br>N=%{{x}}<br>%{{y:.1f}} {unit}<extra></extra>"
                fig.add_scatter(x=[p["N"] for p in pts], y=ys, name=backend + suffix, legendgroup=backend,
                                connectgaps=False, hovertemplate=hover, **style(backend_color(backend)))
    ns = sorted({p["N"] for p in points})
    by = {(p["backend"], p["N"]): p for p in points}
    ticks = []
    for n in ns:
        ratios = [f"<span style='color:{backend_color(b)}'>{by[b, n][ratio_key]:.2f}x</span>"
                  for b in _backends(points) if b != "generate" and (b, n) in by and _ok(by[b, n])
                  and by[b, n].get(ratio_key) is not None]
        ticks.append("<br>".join([str(n), *ratios]))
    fig.update_xaxes(title_text="N (completions per prompt)", type="log", tickvals=ns, ticktext=ticks,
                     range=[math.log10(min(ns)) - 0.12, math.log10(max(ns)) + 0.12] if ns else None)
    for n in sorted({p["N"] for p in points if not _ok(p)}):  # above the plot, never over a line
        labels = [f"{p['backend']}: {str(p.get('status', 'error')).upper()}" for p in points
                  if p["N"] == n and not _ok(p)]
        fig.add_annotation(x=math.log10(n), y=1.0, yref="paper", yanchor="bottom", yshift=4,
                           text="<br>".join(labels), showarrow=False, font={"color": "#b00", "size": 13},
                           bgcolor="rgba(255,255,255,0.9)", bordercolor="#b00", borderwidth=1)
        fig.add_vline(x=n, line={"color": "#b00", "width": 1, "dash": "dot"})  # shapes: data units
    fig.update_yaxes(rangemode="tozero", title_text=y_title)
    fig.update_layout(template=TEMPLATE, title=title, height=height, margin={"t": 90},
                      legend={"orientation": "h", "y": -0.2, "x": 0})
    return fig


def step_split_figure(points: Points) -> go.Figure:
    """Each `--full-step` point as a stacked bar of its phases, its step speed-up beside the Amdahl ceiling."""
    pts = [p for p in points if p.get("step_s") is not None or not _ok(p)]
    labels = [f"N={p['N']} {p['backend']}" for p in pts]
    fig = go.Figure()
    phases = (("rollout_s", "rollout"), ("old_logprob_s", "old-logprob forward"), ("update_s", "update"),
              ("other_s", "other"))
    for i, (key, name) in enumerate(phases):
        xs = [p.get(key) if _ok(p) else None for p in pts]
        roof = [p.get("roof_share") if key == "rollout_s" else None for p in pts]  # the rollout's share of its roof
        text = [f"{x:.1f} s" + (f" ({r:.0%} of roof)" if r is not None else "") if x is not None else ""
                for x, r in zip(xs, roof, strict=True)]
        fig.add_trace(go.Bar(y=labels, x=xs, name=name, orientation="h", marker={"color": PALETTE[i]},
                             text=text, textposition="inside", insidetextanchor="middle", textangle=0,
                             hovertemplate=f"{name}<br>%{{y}}<br>%{{x:.2f}} s<extra></extra>"))
    for label, p in zip(labels, pts, strict=True):
        if not _ok(p):
            note = str(p.get("status", "error")).upper()
        elif p["backend"] == "generate" or p.get("step_speedup") is None:
            note = f"step {p['step_s']:.3g} s, rollout {p.get('rollout_share') or 0:.0%} of it"
        else:
            ceiling = f" vs Amdahl ceiling {p['amdahl_ceiling']:.2f}x" if p.get("amdahl_ceiling") else ""
            note = f"step {p['step_speedup']:.2f}x{ceiling}"
        fig.add_annotation(y=label, x=1.0, xref="paper", xanchor="left", text=note, showarrow=False,
                           font={"size": 12, "color": "#b00" if not _ok(p) else "#222"})
    fig.update_layout(template=TEMPLATE, barmode="stack", title="One GRPO step, split by phase",
                      xaxis_title="seconds", height=max(300, 60 * len(pts) + 140),
                      legend={"orientation": "h", "y": -0.15, "x": 0, "traceorder": "normal"},
                      uniformtext={"minsize": 10, "mode": "hide"}, margin={"r": 260, "t": 60})
    fig.update_yaxes(autorange="reversed")
    return fig


def write_report(points: Points, path: str | os.PathLike, meta: Mapping[str, Any] | None = None) -> Path:
    """An HTML page that opens offline: the run's settings, the charts, the tables `cbkit report` prints."""
    from cbkit.measure.results import report_tables

    figures = [throughput_vs_n(points), memory_vs_n(points)]
    if any(p.get("step_s") is not None for p in points):  # a full-step sweep: where the step's time went
        figures.append(step_split_figure(points))
    esc = html.escape
    charts = "\n".join(f.to_html(full_html=False, include_plotlyjs=i == 0) for i, f in enumerate(figures))
    meta_rows = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>"
                        for k, v in (meta or {}).items())
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>cbkit N-sweep</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
th, td {{ text-align: left; padding: 0.2em 0.6em; }}</style></head><body>
<h1>cbkit N-sweep: each backend against <code>generate()</code> at the same N, in one process</h1>
<table>{meta_rows}</table>
{charts}
{"".join(f"<h2>{esc(title)}</h2><pre>{esc(table)}</pre>" for title, table in report_tables([dict(p) for p in points]))}
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def _ok(p: Mapping[str, Any]) -> bool:
    return p.get("status", "ok") == "ok"


def _backends(points: Points) -> list[str]:
    return sorted({p["backend"] for p in points}, key=lambda b: (b != "generate", b))  # generate() first


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl`, a torn last line dropped; an empty file is refused."""
    rows = read_jsonl(path, what="step")
    if not rows:
        raise ValueError(f"{path} holds no metrics rows: is it the metrics.jsonl `cbkit train` writes?")
    return rows


def reward_curve(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], *, window: int = 3,
                 title: str = "Reward per step") -> go.Figure:
    """Each metric per step and its trailing mean over ``window`` steps; held-out ``eval/*`` as measured, step 0
    included (each point already averages many unseen completions)."""
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


def figure_pngs(figures: Sequence[Any], *, width: int = 1000) -> list[bytes]:
    """Each figure (a ``go.Figure`` or its dict) as PNG bytes at its ``layout`` size, else ``width`` wide (a
    page sets an HTML figure's width), drawn offline by kaleido with the installed Chrome or Chromium."""
    if not figures:
        return []
    import kaleido

    layouts = [(f.to_dict() if hasattr(f, "to_dict") else f).get("layout", {}) for f in figures]

    async def draw() -> list[bytes]:
        async with kaleido.Kaleido(n=1, timeout=120, mathjax=False) as k:
            return [await k.calc_fig(fig, opts={"format": "png", "width": int(lay.get("width") or width),
                                                "height": int(lay.get("height") or 500)})
                    for fig, lay in zip(figures, layouts, strict=True)]

    return asyncio.run(draw())

