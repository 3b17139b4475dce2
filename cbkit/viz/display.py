"""Where a notebook's figures are drawn, and how: plotly.js embedded once per notebook, figures as ``text/html``
that draws with that copy, progress bars that survive an executed notebook, and where the code runs (a kernel,
Colab, CI, a terminal). `cbkit.viz.live` builds its live charts on it.

**Figures that survive the notebook.** An executed notebook is read in nbconvert's HTML, on GitHub, in
nbviewer, offline. None of them draws plotly's JSON mimetype; they draw ``text/html``. ``embed_plotlyjs``
(called by ``cbkit.teach.notebook.setup``) puts plotly.js into the notebook once, as an output of the setup cell,
and makes every later figure carry ``text/html`` that draws with that copy: no CDN, and a 4 MB library is not
repeated per figure. Colab is the exception: each output there is its own iframe, so a figure must bring its
own plotly.js (plotly's ``colab`` renderer does, and we leave it alone).
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

# Set by embed_plotlyjs once plotly.js is in the page: from then on a figure's HTML needs no copy of its own.
_PLOTLYJS_IN_PAGE = False


# --- plotly.js, once per notebook -----------------------------------------------------------------------------


RENDERER = "cbkit_notebook"


class EmbeddedHTMLRenderer(MimetypeRenderer):
    """plotly renderer for ``text/html`` that draws with the notebook's one copy of plotly.js.

    plotly's own ``notebook`` renderer does the same but adds a MathJax ``<script>`` from a CDN to every
    figure; cbkit's figures have no LaTeX, so this one adds nothing that needs the network."""

    def to_mimebundle(self, fig_dict: Any) -> dict[str, str]:
        return {"text/html": figure_html(fig_dict)}


def embed_plotlyjs() -> bool:
    """Put plotly.js into the notebook once and make every figure output carry HTML that uses it.

    Displays the library now, as an output of the calling cell, and sets plotly's default renderer to
    ``plotly_mimetype+cbkit_notebook``: the JSON mimetype for JupyterLab / VS Code, and ``text/html`` for
    everything that reads the saved file. Returns whether it did anything: not outside a kernel, not on Colab
    (see the module docstring), and not a second time in the same kernel.
    """
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
    """Under CI (nbmake), make ``tqdm.auto`` draw text bars instead of notebook widgets; returns whether it did.

    A saved notebook keeps a tqdm widget only as the text of its first frame ("0%"), because the widget's
    later state lives in the front end nobody runs in CI. These bars write one line when they close, their
    last frame: what every reader (nbconvert, GitHub, JupyterLab) then shows is where the run finished. In front of a person
    (JupyterLab, Colab) the widget stays. ``tqdm.auto`` is looked up when a bar is made (transformers) or when
    a module is imported (``cbkit.measure.sweep``), so this runs in ``setup()``, before the notebook imports them.
    """
    if not (under_ci() and in_kernel()):
        return False
    import tqdm.auto
    import tqdm.autonotebook

    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = _last_frame_bar()
    return True


def _last_frame_bar() -> type:
    """tqdm's text bar (with ``tqdm.auto``'s asyncio support) that writes one line, its last frame, when it
    closes: a saved notebook keeps every frame of a text bar as its own line, so only the last is written."""
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
    """A figure as an HTML fragment: using the notebook's plotly.js when it is embedded, else loading its own
    from the CDN (Colab, where outputs do not share scripts, and where plotly's own renderer does the same)."""
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False if _PLOTLYJS_IN_PAGE else "cdn",
                       include_mathjax=False, default_width="100%", validate=False)


# --- where are we running? ---------------------------------------------------------------------------------


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
    """True inside a Jupyter kernel. Only looks at an IPython that is already imported: a script that never
    imported it cannot be running in a kernel."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def under_ci() -> bool:
    """CI or a notebook test run, where nobody watches a widget and its state would not be saved."""
    if os.environ.get("CBKIT_PROFILE") == "ci" or os.environ.get("CI"):
        return True
    # nbmake runs the kernel as a child of pytest, which inherits the variable pytest sets during a test.
    return "PYTEST_CURRENT_TEST" in os.environ


def widget_available() -> bool:
    """Whether plotly's FigureWidget can work: plotly >= 6 builds it on anywidget, older ones on ipywidgets."""
    import plotly

    major = int(plotly.__version__.split(".")[0])
    return importlib.util.find_spec("anywidget" if major >= 6 else "ipywidgets") is not None
