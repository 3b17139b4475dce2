"""Where a notebook's figures are drawn, and how: plotly.js embedded once per notebook, figures as ``text/html``
that draws with that copy (what nbconvert, GitHub and nbviewer read; no CDN, no 4 MB library per figure), progress
bars that survive an executed notebook, and where the code runs. Colab is the exception: each output there is its own
iframe, so a figure brings its own plotly.js.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

import plotly.graph_objects as go
from plotly.io.base_renderers import MimetypeRenderer

__all__ = ["detect_mode", "embed_plotlyjs", "figure_html", "in_kernel", "text_progress_bars", "under_ci",
           "widget_available"]

_PLOTLYJS_IN_PAGE = False  # set by embed_plotlyjs: from then on a figure's HTML needs no copy of its own
RENDERER = "cbkit_notebook"


class EmbeddedHTMLRenderer(MimetypeRenderer):
    """plotly renderer for ``text/html`` that draws with the notebook's one copy of plotly.js (plotly's ``notebook``
    renderer adds a MathJax script from a CDN to every figure)."""

    def to_mimebundle(self, fig_dict: Any) -> dict[str, str]:
        return {"text/html": figure_html(fig_dict)}


def embed_plotlyjs() -> bool:
    """Put plotly.js into the notebook once (an output of the calling cell) and make every figure output carry
    plotly's JSON and ``text/html`` that uses it. Returns whether it did anything (not outside a kernel, on Colab,
    or twice)."""
    global _PLOTLYJS_IN_PAGE
    if _PLOTLYJS_IN_PAGE or not in_kernel() or "google.colab" in sys.modules:
        return False
    import plotly.io as pio
    from IPython.display import display_html
    from plotly.offline import get_plotlyjs

    display_html(f"<script type=\"text/javascript\">{get_plotlyjs()}</script>", raw=True)
    pio.renderers[RENDERER] = EmbeddedHTMLRenderer()
    pio.renderers.default = f"plotly_mimetype+{RENDERER}"
    _PLOTLYJS_IN_PAGE = True
    return True


def text_progress_bars() -> bool:
    """Under CI (nbmake), make ``tqdm.auto`` draw text bars that write their last frame once, instead of widgets a
    saved notebook keeps as "0%"; returns whether it did. Runs in ``setup()``, before anything imports tqdm.auto."""
    if not (under_ci() and in_kernel()):
        return False
    import tqdm.auto
    import tqdm.autonotebook

    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = _last_frame_bar()
    return True


def _last_frame_bar() -> type:
    """tqdm's text bar (with ``tqdm.auto``'s asyncio support) that writes one line, its last frame, when it closes."""
    import tqdm.asyncio

    class LastFrameBar(tqdm.asyncio.tqdm):
        delay: float  # tqdm's own attribute (its `delay=` argument), set by its __init__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("delay", math.inf)  # nothing is drawn while it runs
            super().__init__(*args, **kwargs)

        def close(self) -> None:
            if self.delay == math.inf:
                self.delay = 0  # close() draws the final frame once the delay has passed
            super().close()

    return LastFrameBar


def figure_html(fig: go.Figure | Mapping[str, Any]) -> str:
    """A figure as an HTML fragment: using the notebook's plotly.js when it is embedded, else loading its own from
    the CDN (Colab, where outputs do not share scripts)."""
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False if _PLOTLYJS_IN_PAGE else "cdn",
                       include_mathjax=False, default_width="100%", validate=False)


def detect_mode() -> Literal["widget", "html", "static"]:
    """Colab -> html; a Jupyter kernel with a working FigureWidget, not under CI -> widget; any other
    kernel -> html; no kernel (script, terminal, plain IPython) -> static."""
    if "google.colab" in sys.modules:
        return "html"
    if not in_kernel():
        return "static"
    if under_ci() or not widget_available():
        return "html"
    return "widget"


def in_kernel() -> bool:
    """True inside a Jupyter kernel (looks only at an IPython already imported)."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def under_ci() -> bool:
    """CI or a notebook test run, where nobody watches a widget and its state would not be saved."""
    if os.environ.get("CBKIT_PROFILE") == "ci" or os.environ.get("CI"):
        return True
    return "PYTEST_CURRENT_TEST" in os.environ


def widget_available() -> bool:
    """Whether plotly's FigureWidget can work: plotly >= 6 builds it on anywidget, older ones on ipywidgets."""
    import plotly

    major = int(plotly.__version__.split(".")[0])
    return importlib.util.find_spec("anywidget" if major >= 6 else "ipywidgets") is not None
