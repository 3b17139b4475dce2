"""Figures as PNG images: the fallback wherever JavaScript does not run (github.com's notebook viewer, a PDF). An
``image/png`` beside a figure's ``text/html`` is what such a viewer shows; every browser-based reader still prefers
the HTML. kaleido draws them with the installed Chromium (on PATH or ``$BROWSER_PATH``), offline (no MathJax), all
of a notebook's figures in one browser.
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
