"""Figures as PNG images: the fallback wherever JavaScript does not run.

An executed notebook's plotly figures are ``text/html`` that draws with plotly.js (`cbkit.viz.live`). Where no
script runs (github.com's notebook viewer, a mail client, a PDF), that output is blank. A ``image/png`` next to
it in the same output bundle is what such a viewer shows instead, while every browser-based reader (nbconvert,
nbviewer, JupyterLab, the book) still prefers the interactive HTML, because every renderer ranks ``text/html``
above ``image/png``.

The images come from kaleido (plotly's exporter), which drives a headless Chromium: the one installed on the
machine (``/usr/bin/chromium`` here, found on PATH or through ``$BROWSER_PATH``), never a downloaded one. Two
of kaleido's defaults would reach for the network and are turned off: MathJax (from a CDN; cbkit's figures
have no LaTeX) and plotly.js, which comes from the installed ``plotly`` package. All the figures of a notebook
are drawn by one browser, started once, because starting Chromium costs more than drawing a figure.

This module is the one home for figure -> PNG; the book (``make book``) and anything else that needs a
static image call it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PNG", "PLOTLY_JSON", "add_png_fallbacks", "figure_pngs"]

PLOTLY_JSON = "application/vnd.plotly.v1+json"
PNG = "image/png"
DEFAULT_WIDTH = 1000  # pixels; a figure's own layout.height is kept, its width is left to the page in HTML
DEFAULT_HEIGHT = 500


def _browser_path() -> str:
    found = os.environ.get("BROWSER_PATH") or next(
        (p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)
    if not found:
        raise RuntimeError("drawing a figure as PNG needs Chromium (kaleido drives it): install it "
                           "(apt-get install -y chromium) or set BROWSER_PATH to a Chrome or Chromium binary.")
    return found


def figure_pngs(figures: Sequence[Any], *, width: int = DEFAULT_WIDTH, scale: float = 1.0,
                timeout_s: float = 120) -> list[bytes]:
    """Each figure (a ``go.Figure`` or its dict) as PNG bytes, drawn offline by one headless Chromium.

    A figure keeps its own ``layout.height`` (else ``DEFAULT_HEIGHT``); ``width`` is the image's width in
    pixels, since an HTML figure's width follows its page and an image needs one."""
    if not figures:
        return []
    os.environ.setdefault("BROWSER_PATH", _browser_path())
    import kaleido

    def opts(fig: Any) -> dict[str, Any]:
        layout = (fig.to_dict() if hasattr(fig, "to_dict") else fig).get("layout", {})
        return {"format": "png", "width": int(layout.get("width") or width),
                "height": int(layout.get("height") or DEFAULT_HEIGHT), "scale": scale}

    async def draw() -> list[bytes]:
        async with kaleido.Kaleido(n=1, timeout=timeout_s, mathjax=False) as k:
            return [await k.calc_fig(fig, opts=opts(fig)) for fig in figures]

    return asyncio.run(draw())


def add_png_fallbacks(path: str | os.PathLike, *, width: int = DEFAULT_WIDTH) -> int:
    """Add an ``image/png`` of every plotly figure output to an executed notebook, in place; returns how many
    figures it drew. Outputs that already carry a PNG are left as they are, so running it twice is harmless."""
    import nbformat

    path = Path(path)
    book = nbformat.read(path, as_version=4)
    outputs = [out for cell in book.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
               if out.get("output_type") in ("display_data", "execute_result")
               and PLOTLY_JSON in out.get("data", {}) and PNG not in out["data"]]
    pngs = figure_pngs([_as_dict(out["data"][PLOTLY_JSON]) for out in outputs], width=width)
    for out, png in zip(outputs, pngs, strict=True):
        out["data"][PNG] = base64.b64encode(png).decode("ascii")
    if outputs:
        nbformat.write(book, path)
    return len(outputs)


def _as_dict(fig: Mapping[str, Any]) -> dict[str, Any]:
    return {"data": list(fig.get("data", [])), "layout": dict(fig.get("layout", {}))}
