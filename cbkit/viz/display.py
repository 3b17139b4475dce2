"""Where a notebook's figures draw: plotly.js embedded once, figures as ``text/html`` that draws with that copy
(what nbconvert, GitHub and nbviewer read; no CDN), and progress bars that survive an executed notebook. On
Colab each output is its own iframe, so there a figure brings its own plotly.js.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.io.base_renderers import MimetypeRenderer

__all__ = ["embed_plotlyjs", "figure_html", "in_kernel", "text_progress_bars"]

_PLOTLYJS_IN_PAGE = False  # set by embed_plotlyjs: from then on a figure's HTML needs no copy of its own


class EmbeddedHTMLRenderer(MimetypeRenderer):
    """``text/html`` drawn with the page's plotly.js (plotly's ``notebook`` renderer adds a CDN script)."""

    def to_mimebundle(self, fig_dict: Any) -> dict[str, str]:
        return {"text/html": figure_html(fig_dict)}


def embed_plotlyjs() -> bool:
    """Put plotly.js into the notebook once and make every figure output plotly's JSON and ``text/html`` that
    uses it; False where it did nothing (no kernel, Colab, done already)."""
    global _PLOTLYJS_IN_PAGE
    if _PLOTLYJS_IN_PAGE or not in_kernel() or "google.colab" in sys.modules:
        return False
    import plotly.io as pio
    from IPython.display import display_html
    from plotly.offline import get_plotlyjs

    display_html(f"<script type=\"text/javascript\">{get_plotlyjs()}</script>", raw=True)
    pio.renderers["cbkit_notebook"] = EmbeddedHTMLRenderer()
    pio.renderers.default = "plotly_mimetype+cbkit_notebook"
    _PLOTLYJS_IN_PAGE = True
    return True


def figure_html(fig: go.Figure | Mapping[str, Any]) -> str:
    """A figure as an HTML fragment, drawn with the page's plotly.js when embedded, else the CDN's (Colab)."""
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False if _PLOTLYJS_IN_PAGE else "cdn",
                       include_mathjax=False, default_width="100%", validate=False)


def text_progress_bars() -> bool:
    """Under CI or nbmake, make ``tqdm.auto`` text bars that write only their last frame, not widgets a saved
    notebook keeps as "0%"; returns whether it did. Runs in ``setup()``, before anything imports tqdm.auto."""
    ci = os.environ.get("CBKIT_PROFILE") == "ci" or os.environ.get("CI") or "PYTEST_CURRENT_TEST" in os.environ
    if not (ci and in_kernel()):
        return False
    import tqdm.asyncio
    import tqdm.auto
    import tqdm.autonotebook

    class LastFrameBar(tqdm.asyncio.tqdm):
        delay: float  # tqdm's own attribute (its `delay=` argument)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{"delay": math.inf, **kwargs})  # nothing is drawn while it runs

        def close(self) -> None:
            if self.delay == math.inf:
                self.delay = 0  # close() draws the final frame once the delay has passed
            super().close()

    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = LastFrameBar
    return True


def in_kernel() -> bool:
    """True inside a Jupyter kernel (looks only at an IPython already imported)."""
    get = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return getattr(get() if get is not None else None, "kernel", None) is not None
