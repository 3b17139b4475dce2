"""The live display: charts that update while work runs, wherever a notebook is opened.

JupyterLab / VS Code update a ``go.FigureWidget`` in place (plotly 6 needs ``anywidget``); Colab (ipywidgets 7)
and CI get an IPython display handle whose HTML is replaced, and keep the final figure as a static output;
scripts get the figure from ``close()``. ``LiveChart(mode="auto")`` picks one (`display.detect_mode`) and redraws at
most once per ``min_interval_s``: sending a figure is expensive, adding a point is not.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cbkit.viz import display
from cbkit.viz.palette import PALETTE, TEMPLATE

__all__ = ["FinalFigure", "LiveChart"]

Mode = Literal["auto", "widget", "html", "static"]


class LiveChart:
    """A chart that updates while work runs, throttled; ``close()`` returns the final figure.

    ``panels`` are subplots sharing the x axis, in one column or a grid of ``columns``. A series keeps its colour in
    every panel, or takes the line style ``style(series)`` returns, which may also name its legend ``group`` (one
    entry per group), its marker ``symbol`` and a ``label`` written beside its last point. ``add`` stores a point and
    redraws once ``min_interval_s`` has passed; ``flush`` redraws now. ``clock``, ``display`` and ``figure_widget``
    are injectable for tests.
    """

    def __init__(
        self,
        title: str,
        panels: Sequence[str] = ("",),
        *,
        x_title: str = "step",
        mode: Mode = "auto",
        min_interval_s: float = 1.0,
        x_log: bool = False,
        style: Callable[[str], Mapping[str, Any]] | None = None,
        y_min_span: Mapping[str, float] | None = None,
        columns: int = 1,
        panel_height: int = 260,
        save_html: str | os.PathLike | None = None,
        clock: Callable[[], float] = time.monotonic,
        display: Callable[[Any], Any] | None = None,
        figure_widget: Callable[[go.Figure], Any] | None = None,
    ) -> None:
        if mode not in ("auto", "widget", "html", "static"):
            raise ValueError(f"mode must be auto, widget, html or static; got {mode!r}.")
        if not panels:
            raise ValueError("panels must name at least one panel.")
        if columns < 1:
            raise ValueError(f"columns must be >= 1, got {columns}.")
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}.")
        self.title = title
        self.panels = tuple(panels)
        self.x_title = x_title
        self.x_log = x_log
        self._style = style
        self.y_min_span = dict(y_min_span or {})
        self.columns = min(columns, len(self.panels))
        self.panel_height = panel_height
        self.min_interval_s = min_interval_s
        self.save_html = Path(save_html) if save_html is not None else None
        self._clock = clock
        self._display = display or _ipython_display
        self._widget_cls = figure_widget
        self.mode = self._resolve(mode)
        self.updates = 0  # redraws sent to the display: what the throttle limits
        self._series: dict[tuple[str, str], tuple[list[Any], list[Any]]] = {}
        self._names: list[str] = []  # series names in order of appearance, for stable colours
        self._dirty = False
        self._last = -math.inf
        self._handle: Any = None
        self._widget: Any = None
        self._trace_index: dict[tuple[str, str], int] = {}
        self._final: go.Figure | None = None

    def _resolve(self, mode: Mode) -> Literal["widget", "html", "static"]:
        resolved = display.detect_mode() if mode == "auto" else mode
        if resolved == "widget" and self._widget_cls is None:
            if display.widget_available():
                self._widget_cls = go.FigureWidget
            else:
                resolved = "html" if display.in_kernel() else "static"
                if mode == "widget":
                    warnings.warn("plotly's FigureWidget needs the 'anywidget' package (pip install anywidget); "
                                  f"showing the chart in {resolved} mode instead.", stacklevel=3)
        return resolved

    def add(self, series: str, x: Any, y: Any, panel: str | None = None) -> None:
        """Store one point of ``series`` in ``panel`` (default: the first); redraw if the interval has passed."""
        if self._final is not None:
            raise RuntimeError(f"LiveChart {self.title!r} is closed; create a new one to plot more.")
        panel = self.panels[0] if panel is None else panel
        if panel not in self.panels:
            raise ValueError(f"Unknown panel {panel!r}; this chart has {list(self.panels)}.")
        key = (panel, series)
        if key not in self._series:
            self._series[key] = ([], [])
            if series not in self._names:
                self._names.append(series)
        xs, ys = self._series[key]
        xs.append(x)
        ys.append(y)
        self._dirty = True
        now = self._clock()
        if now - self._last >= self.min_interval_s:
            self._redraw(now)

    def flush(self) -> None:
        """Redraw now if anything arrived since the last redraw."""
        if self._dirty and self._final is None:
            self._redraw(self._clock())

    def _cell(self, panel: str) -> tuple[int, int]:
        """(row, col) of a panel in the grid, 1-based, filled row by row."""
        i = self.panels.index(panel)
        return i // self.columns + 1, i % self.columns + 1

    @property
    def _grouped(self) -> bool:
        """Whether the style names legend groups: then one legend for the chart, one entry a group."""
        return self._style is not None and any("group" in self._style(s) for s in self._names)

    def figure(self) -> go.Figure:
        """The chart as a plain figure, with every point added so far."""
        rows = math.ceil(len(self.panels) / self.columns)
        fig = make_subplots(rows=rows, cols=self.columns, shared_xaxes=True,
                            vertical_spacing=(0.08 if self.columns == 1 else 0.12) if rows > 1 else 0.0,
                            horizontal_spacing=0.12)
        shown: set[str] = set()
        for (panel, series), (xs, ys) in self._series.items():
            trace = self._trace(panel, series, xs, ys, first=series not in shown, shown=shown)
            fig.add_trace(trace, row=self._cell(panel)[0], col=self._cell(panel)[1])
            shown.update({series, trace.legendgroup or series})
        for panel in self.panels:
            row, col = self._cell(panel)
            fig.update_yaxes(title_text=panel, row=row, col=col)
        self._apply_min_spans(fig)
        for panel in self.panels[-self.columns:]:  # the bottom panel of each column
            row, col = self._cell(panel)
            fig.update_xaxes(title_text=self.x_title, row=row, col=col)
        xs = sorted({x for pts, _ in self._series.values() for x in pts if isinstance(x, int | float)})
        if self.x_log and xs and xs[0] > 0:
            fig.update_xaxes(type="log", tickvals=xs, ticktext=[f"{x:g}" for x in xs])
        elif xs and all(float(x).is_integer() for x in xs):
            fig.update_xaxes(dtick=max(1, math.ceil((xs[-1] - xs[0]) / 10)))  # steps are whole numbers
        if self._grouped:  # one legend, one entry a group, above the panels
            fig.update_layout(legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
                              margin={"t": 100, "r": 60})
        elif rows > 1 and self.columns == 1:  # one legend per panel, at the top right of its panel
            for i in range(1, rows + 1):
                top = fig.layout["yaxis" if i == 1 else f"yaxis{i}"].domain[1]
                fig.update_layout({_legend(i): {"x": 1.02, "xanchor": "left", "y": top, "yanchor": "top",
                                                     "font": {"size": 11}}})
            fig.update_layout(margin={"r": 250})
        else:
            fig.update_layout(legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1})
        fig.update_layout(title=self.title, template=TEMPLATE, height=160 + self.panel_height * rows)
        return fig

    def _apply_min_spans(self, fig: Any) -> None:
        for panel in self.panels:
            span = self.y_min_span.get(panel)
            values = [y for (p, _), (_, ys) in self._series.items() if p == panel for y in ys
                      if isinstance(y, int | float) and math.isfinite(y)]
            if span and values:
                lo, hi = min(values), max(values)
                mid = (lo + hi) / 2
                row, col = self._cell(panel)
                fig.update_yaxes(range=[mid - span / 2, mid + span / 2] if hi - lo < span else None, row=row, col=col)

    def _trace(self, panel: str, series: str, xs: Sequence[Any], ys: Sequence[Any], *, first: bool,
               shown: set[str] | None = None) -> go.Scatter:
        line = self._line(series)
        group, label, symbol = line.pop("group", None), line.pop("label", None), line.pop("symbol", None)
        marker = {"color": line.get("color"), **({"symbol": symbol} if symbol else {})}
        if group is not None:  # one legend entry a group; the quantity is written beside the last point
            text = [""] * (len(xs) - 1) + [label] if label and xs else None
            return go.Scatter(x=list(xs), y=list(ys), name=group, mode="lines+markers" + ("+text" if text else ""),
                              line=line, marker=marker, text=text, textposition="middle right", cliponaxis=False,
                              textfont={"color": line.get("color"), "size": 11}, legendgroup=group,
                              showlegend=group not in (shown or set()),
                              hovertemplate=f"{series}: %{{y:.4g}}<extra></extra>")
        row = self.panels.index(panel) + 1
        per_panel = len(self.panels) > 1 and self.columns == 1
        return go.Scatter(x=list(xs), y=list(ys), name=series, mode="lines+markers", line=line, marker=marker,
                          legend=_legend(row) if per_panel else None,
                          legendgroup=None if per_panel else series, showlegend=per_panel or first)

    def _line(self, series: str) -> dict[str, Any]:
        if self._style is not None:
            return dict(self._style(series))
        return {"color": PALETTE[self._names.index(series) % len(PALETTE)]}

    def close(self) -> go.Figure:
        """Final redraw; return the figure. In html and static mode show it as an ordinary figure output, so
        an executed notebook keeps it; save it as HTML if ``save_html`` was given."""
        if self._final is not None:
            return self._final
        fig = self.figure()
        if self.mode == "widget":
            self.flush()
        elif self.mode == "html":
            self._show_final(fig)
        elif display.in_kernel():
            self._display(fig)
        if self.save_html is not None:
            self.save_html.parent.mkdir(parents=True, exist_ok=True)
            fig.write_html(self.save_html, include_plotlyjs=True)
        self._dirty = False
        self._final = fig
        return fig

    def _redraw(self, now: float) -> None:
        self._last = now
        self._dirty = False
        if self.mode == "static":
            return  # nothing live: the points wait for close()
        self.updates += 1
        if self.mode == "widget":
            self._update_widget()
        else:
            self._update_html(self.figure())

    def _update_widget(self) -> None:
        if self._widget is None:
            assert self._widget_cls is not None, "widget mode is resolved only with a FigureWidget class"
            self._widget = self._widget_cls(self.figure())
            self._trace_index = {key: i for i, key in enumerate(self._series)}
            self._display(self._widget)
            return
        with self._widget.batch_update():
            for key, (xs, ys) in self._series.items():
                if key not in self._trace_index:
                    panel, series = key
                    first = not any(s == series for _, s in self._trace_index)
                    shown = {self._widget.data[i].legendgroup or s for (_, s), i in self._trace_index.items()}
                    row, col = self._cell(panel)
                    self._widget.add_trace(self._trace(panel, series, xs, ys, first=first, shown=shown),
                                           row=row, col=col)
                    self._trace_index[key] = len(self._widget.data) - 1
                else:
                    trace = self._widget.data[self._trace_index[key]]
                    trace.x, trace.y = list(xs), list(ys)
                    if trace.text is not None:  # the label stays beside the last point
                        trace.text = [""] * (len(xs) - 1) + [next(t for t in trace.text if t)]
            self._apply_min_spans(self._widget)

    def _update_html(self, fig: go.Figure) -> None:
        from IPython.display import HTML

        self._show(HTML(display.figure_html(fig)))

    def _show_final(self, fig: go.Figure) -> None:
        self.updates += 1
        self._show(FinalFigure(fig))

    def _show(self, content: Any) -> None:
        if self._handle is None:
            self._handle = self._display(content)
        else:
            self._handle.update(content)


class FinalFigure:
    """A figure as a display bundle (plotly's JSON and HTML), so a display handle can replace the live chart's last
    HTML snapshot with it: a plotly figure ignores the display id and the stale snapshot would stay above it."""

    def __init__(self, figure: go.Figure) -> None:
        self.figure = figure

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        import json

        return {"application/vnd.plotly.v1+json": {**json.loads(self.figure.to_json()), "config": {}},
                "text/html": display.figure_html(self.figure),
                "text/plain": f"<plotly figure: {self.figure.layout.title.text}>"}


def _legend(row: int) -> str:
    return "legend" if row == 1 else f"legend{row}"


def _ipython_display(obj: Any) -> Any:
    from IPython.display import display

    return display(obj, display_id=True)
