"""Where a notebook's figures draw: plotly.js embedded once and figures as ``text/html`` that use it (what
nbconvert, GitHub and nbviewer read; no CDN). A live chart is one display handle whose HTML is replaced at
most once per ``min_interval_s``, then by the final figure an executed notebook keeps: no widget."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.io.base_renderers import MimetypeRenderer
from plotly.subplots import make_subplots

from cbkit.viz.figures import PALETTE, TEMPLATE

_PLOTLYJS_IN_PAGE = False  # set by embed_plotlyjs: from then on a figure's HTML needs no copy of its own


class EmbeddedHTMLRenderer(MimetypeRenderer):
    """``text/html`` drawn with the page's plotly.js (plotly's ``notebook`` renderer adds a CDN script)."""

    def to_mimebundle(self, fig_dict: Any) -> dict[str, str]:
        return {"text/html": figure_html(fig_dict)}


def embed_plotlyjs() -> bool:
    """Put plotly.js into the notebook once, figures output as plotly's JSON and HTML that uses it; False
    where it did nothing (no kernel, Colab, done already)."""
    global _PLOTLYJS_IN_PAGE
    if _PLOTLYJS_IN_PAGE or not in_kernel() or "google.colab" in sys.modules:
        return False
    from IPython.display import display_html
    from plotly.offline import get_plotlyjs

    display_html(f"<script type=\"text/javascript\">{get_plotlyjs()}</script>", raw=True)
    pio.renderers["cbkit_notebook"] = EmbeddedHTMLRenderer()
    pio.renderers.default = "plotly_mimetype+cbkit_notebook"
    _PLOTLYJS_IN_PAGE = True
    return True


def figure_html(fig: go.Figure | Mapping[str, Any]) -> str:
    """A figure as an HTML fragment, drawn with the page's plotly.js when embedded, else the CDN's (Colab)."""
    return pio.to_html(fig, full_html=False, include_plotlyjs=False if _PLOTLYJS_IN_PAGE else "cdn",
                       include_mathjax=False, default_width="100%", validate=False)


def text_progress_bars() -> bool:
    """Under CI or nbmake in a kernel, ``tqdm.auto`` bars become text that writes only its last frame (a saved
    widget reads "0%"); returns whether it did. ``setup()`` runs it before anything imports tqdm.auto."""
    ci = os.environ.get("CBKIT_PROFILE") == "ci" or any(map(os.environ.get, ("CI", "PYTEST_CURRENT_TEST")))
    if not (ci and in_kernel()):
        return False
    import tqdm.asyncio
    import tqdm.auto
    import tqdm.autonotebook

    class LastFrameBar(tqdm.asyncio.tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{"delay": math.inf, **kwargs})  # nothing is drawn while it runs

        def close(self) -> None:
            self.delay = 0  # tqdm's own attribute: close() draws the final frame once the delay has passed
            super().close()

    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = LastFrameBar
    return True


def in_kernel() -> bool:
    """True inside a Jupyter kernel (looks only at an IPython already imported)."""
    get = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return getattr(get() if get is not None else None, "kernel", None) is not None


def _ipython_display(bundle: dict[str, Any]) -> Any:
    from IPython.display import display

    return display(bundle, raw=True, display_id=True)


@dataclass(eq=False)
class LiveChart:
    """``panels`` sharing the x axis in a grid of ``columns``, redrawn in a kernel as points arrive (elsewhere
    ``close()`` returns the figure). ``style(series)``: its line, marker ``symbol``, legend ``group`` (one
    entry a group), a ``label`` beside its last point. A panel in ``y_min_span`` spans at least that much."""

    title: str
    panels: Sequence[str] = ("",)
    _: KW_ONLY
    x_title: str = "step"
    min_interval_s: float = 1.0
    x_log: bool = False
    style: Callable[[str], Mapping[str, Any]] | None = None
    y_min_span: Mapping[str, float] = field(default_factory=dict)
    columns: int = 1
    panel_height: int = 260
    clock: Callable[[], float] = time.monotonic
    display: Callable[[dict[str, Any]], Any] = _ipython_display

    def __post_init__(self) -> None:
        if not self.panels:
            raise ValueError("panels must name at least one panel.")
        if self.columns < 1:
            raise ValueError(f"columns must be >= 1, got {self.columns}.")
        self.panels = tuple(self.panels)
        self.columns = min(self.columns, len(self.panels))
        self.live = in_kernel()
        self._series: dict[tuple[str, str], tuple[list[Any], list[Any]]] = {}  # (panel, series) -> (xs, ys)
        self._dirty = False
        self._last = -math.inf
        self._handle: Any = None
        self._final: go.Figure | None = None

    def add(self, series: str, x: Any, y: Any, panel: str | None = None) -> None:
        """Store a point of ``series`` in ``panel`` (default: the first); redraw if the interval passed."""
        if self._final is not None:
            raise RuntimeError(f"LiveChart {self.title!r} is closed; create a new one to plot more.")
        panel = self.panels[0] if panel is None else panel
        if panel not in self.panels:
            raise ValueError(f"Unknown panel {panel!r}; this chart has {list(self.panels)}.")
        xs, ys = self._series.setdefault((panel, series), ([], []))
        xs.append(x)
        ys.append(y)
        self._dirty = True
        if self.clock() - self._last >= self.min_interval_s:
            self.flush()

    def flush(self) -> None:
        """Redraw now if anything arrived since the last redraw."""
        if self._dirty and self._final is None:
            self._last = self.clock()
            self._dirty = False
            if self.live:
                self._show({"text/html": figure_html(self.figure())})

    def close(self) -> go.Figure:
        """Return the final figure; in a kernel it replaces the live chart's last snapshot."""
        if self._final is None:
            self._final = fig = self.figure()
            if self.live:  # as plotly's JSON and HTML: an executed notebook keeps the figure
                self._show({"application/vnd.plotly.v1+json": {**json.loads(fig.to_json()), "config": {}},
                            "text/html": figure_html(fig), "text/plain": f"<plotly figure: {self.title}>"})
        return self._final

    def figure(self) -> go.Figure:
        """The chart as a plain figure, with every point added so far."""
        rows = math.ceil(len(self.panels) / self.columns)
        fig = make_subplots(rows=rows, cols=self.columns, shared_xaxes=True, horizontal_spacing=0.12,
                            vertical_spacing=(0.08 if self.columns == 1 else 0.12) if rows > 1 else 0.0)
        shown: set[str] = set()
        for (panel, series), (xs, ys) in self._series.items():
            fig.add_trace(self._trace(series, xs, ys, shown), *self._cell(panel))
        for i, panel in enumerate(self.panels):
            row, col = self._cell(panel)
            fig.update_yaxes(title_text=panel, range=self._y_range(panel), row=row, col=col)
            if i >= len(self.panels) - self.columns:  # the bottom panel of each column
                fig.update_xaxes(title_text=self.x_title, row=row, col=col)
        # Plain numbers: plotly's default SI prefixes write a drift of 2e-6 nats as "2µ".
        fig.update_yaxes(exponentformat="none", separatethousands=True)
        xs = sorted({x for pts, _ in self._series.values() for x in pts if isinstance(x, int | float)})
        if self.x_log and xs and xs[0] > 0:
            fig.update_xaxes(type="log", tickvals=xs, ticktext=[f"{x:g}" for x in xs])
        elif xs and all(float(x).is_integer() for x in xs):
            fig.update_xaxes(dtick=max(1, math.ceil((xs[-1] - xs[0]) / 10)))  # steps are whole numbers
        fig.update_layout(title=self.title, template=TEMPLATE, height=160 + self.panel_height * rows,
                          legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left"},
                          margin={"t": 100, "r": 60})
        return fig

    def _cell(self, panel: str) -> tuple[int, int]:
        """(row, col) of a panel in the grid, 1-based, filled row by row."""
        i = self.panels.index(panel)
        return i // self.columns + 1, i % self.columns + 1

    def _y_range(self, panel: str) -> list[float] | None:
        """A panel's y range if its values span less than its minimum span, else None (autorange)."""
        span = self.y_min_span.get(panel)
        ys = [y for (p, _), (_, pts) in self._series.items() if p == panel for y in pts
              if isinstance(y, int | float) and math.isfinite(y)]
        if not span or not ys or max(ys) - min(ys) >= span:
            return None
        mid = (max(ys) + min(ys)) / 2
        return [mid - span / 2, mid + span / 2]

    def _trace(self, series: str, xs: Sequence[Any], ys: Sequence[Any], shown: set[str]) -> go.Scatter:
        """One series' trace, in the legend only the first time its group is drawn."""
        if self.style is not None:
            line = dict(self.style(series))
        else:  # a series keeps one colour in every panel, by the order the series first appeared
            order = list(dict.fromkeys(s for _, s in self._series))
            line = {"color": PALETTE[order.index(series) % len(PALETTE)]}
        group, label, symbol = line.pop("group", series), line.pop("label", None), line.pop("symbol", None)
        color = line.get("color")
        text = [""] * (len(xs) - 1) + [label] if label else None
        mode = "lines+markers+text" if text else "lines+markers"
        trace = go.Scatter(x=list(xs), y=list(ys), name=group, mode=mode, line=line,
                           marker={"color": color, "symbol": symbol}, legendgroup=group,
                           showlegend=group not in shown, text=text, textposition="middle right",
                           cliponaxis=False, textfont={"color": color, "size": 11},
                           hovertemplate=f"{series}: %{{y:.4~g}}<extra></extra>")
        shown.add(group)
        return trace

    def _show(self, bundle: dict[str, Any]) -> None:
        """Show a mime bundle in place of the last one (a plotly figure would ignore the display id)."""
        if self._handle is None:
            self._handle = self.display(bundle)
        else:
            self._handle.update(bundle, raw=True)
