"""Charts that update while work runs. In a Jupyter kernel (JupyterLab, VS Code, Colab, nbmake alike) a chart is
an IPython display handle whose HTML is replaced at most once per ``min_interval_s`` (sending a figure is
expensive, adding a point is not), at the end by the final figure, which an executed notebook keeps. Outside a
kernel the points wait for ``close()``, which returns the figure. One mechanism everywhere: no widget to install.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cbkit.viz import display as viz_display
from cbkit.viz.palette import PALETTE, TEMPLATE

__all__ = ["LiveChart"]


def _ipython_display(bundle: dict[str, Any]) -> Any:
    from IPython.display import display

    return display(bundle, raw=True, display_id=True)


@dataclass(eq=False)
class LiveChart:
    """A chart of ``panels`` sharing the x axis, in one column or a grid of ``columns``, redrawn as points arrive.

    A series keeps its colour in every panel, or takes ``style(series)``: its line, its marker ``symbol``, its
    legend ``group`` (one entry a group) and a ``label`` beside its last point. A panel in ``y_min_span`` spans at
    least that much, so noise around a flat value is not stretched over the panel.
    """

    title: str
    panels: Sequence[str] = ("",)
    _: KW_ONLY
    x_title: str = "step"
    mode: Literal["auto", "html", "static"] = "auto"
    min_interval_s: float = 1.0
    x_log: bool = False
    style: Callable[[str], Mapping[str, Any]] | None = None
    y_min_span: Mapping[str, float] = field(default_factory=dict)
    columns: int = 1
    panel_height: int = 260
    clock: Callable[[], float] = time.monotonic
    display: Callable[[dict[str, Any]], Any] = _ipython_display
    updates: int = field(default=0, init=False)  # redraws sent to the display: what the throttle limits

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "html", "static"):
            raise ValueError(f"mode must be auto, html or static; got {self.mode!r}.")
        if not self.panels:
            raise ValueError("panels must name at least one panel.")
        if self.columns < 1:
            raise ValueError(f"columns must be >= 1, got {self.columns}.")
        if self.min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {self.min_interval_s}.")
        self.panels = tuple(self.panels)
        self.columns = min(self.columns, len(self.panels))
        if self.mode == "auto":
            self.mode = "html" if viz_display.in_kernel() else "static"
        self._series: dict[tuple[str, str], tuple[list[Any], list[Any]]] = {}  # (panel, series) -> (xs, ys)
        self._names: list[str] = []  # series in order of appearance, for stable colours
        self._dirty = False
        self._last = -math.inf
        self._handle: Any = None
        self._final: go.Figure | None = None

    def add(self, series: str, x: Any, y: Any, panel: str | None = None) -> None:
        """Store one point of ``series`` in ``panel`` (default: the first); redraw if the interval has passed."""
        if self._final is not None:
            raise RuntimeError(f"LiveChart {self.title!r} is closed; create a new one to plot more.")
        panel = self.panels[0] if panel is None else panel
        if panel not in self.panels:
            raise ValueError(f"Unknown panel {panel!r}; this chart has {list(self.panels)}.")
        if series not in self._names:
            self._names.append(series)
        xs, ys = self._series.setdefault((panel, series), ([], []))
        xs.append(x)
        ys.append(y)
        self._dirty = True
        now = self.clock()
        if now - self._last >= self.min_interval_s:
            self._redraw(now)

    def flush(self) -> None:
        """Redraw now if anything arrived since the last redraw."""
        if self._dirty and self._final is None:
            self._redraw(self.clock())

    def close(self) -> go.Figure:
        """Return the final figure; in a kernel it replaces the live chart's last snapshot."""
        if self._final is None:
            self._final = self.figure()
            self._dirty = False
            if self.mode == "html":  # as plotly's JSON and HTML: an executed notebook keeps the figure
                self._show({"application/vnd.plotly.v1+json": {**json.loads(self._final.to_json()), "config": {}},
                            "text/html": viz_display.figure_html(self._final),
                            "text/plain": f"<plotly figure: {self.title}>"})
        return self._final

    def figure(self) -> go.Figure:
        """The chart as a plain figure, with every point added so far."""
        rows = math.ceil(len(self.panels) / self.columns)
        fig = make_subplots(rows=rows, cols=self.columns, shared_xaxes=True, horizontal_spacing=0.12,
                            vertical_spacing=(0.08 if self.columns == 1 else 0.12) if rows > 1 else 0.0)
        shown: set[str] = set()
        for (panel, series), (xs, ys) in self._series.items():
            row, col = self._cell(panel)
            fig.add_trace(self._trace(series, xs, ys, shown), row=row, col=col)
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
                          legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
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
        else:
            line = {"color": PALETTE[self._names.index(series) % len(PALETTE)]}
        group, label, symbol = line.pop("group", series), line.pop("label", None), line.pop("symbol", None)
        text = [""] * (len(xs) - 1) + [label] if label and xs else None
        trace = go.Scatter(x=list(xs), y=list(ys), name=group, mode="lines+markers" + ("+text" if text else ""),
                           line=line, marker={"color": line.get("color"), "symbol": symbol}, text=text,
                           textposition="middle right", cliponaxis=False,
                           textfont={"color": line.get("color"), "size": 11}, legendgroup=group,
                           showlegend=group not in shown, hovertemplate=f"{series}: %{{y:.4~g}}<extra></extra>")
        shown.add(group)
        return trace

    def _redraw(self, now: float) -> None:
        self._last = now
        self._dirty = False
        if self.mode == "html":  # static: nothing live, the points wait for close()
            self.updates += 1
            self._show({"text/html": viz_display.figure_html(self.figure())})

    def _show(self, bundle: dict[str, Any]) -> None:
        """Show a mime bundle in place of the last one (a plotly figure would ignore the display id)."""
        if self._handle is None:
            self._handle = self.display(bundle)
        else:
            self._handle.update(bundle, raw=True)

