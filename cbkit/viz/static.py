"""Figures as PNG images, for wherever JavaScript does not run (github.com's notebook viewer, a README, a slide):
kaleido draws them offline with the installed Chromium (on PATH or ``$BROWSER_PATH``), all in one browser.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Sequence
from typing import Any

__all__ = ["figure_pngs"]

DEFAULT_WIDTH = 1000  # pixels
DEFAULT_HEIGHT = 500


def figure_pngs(figures: Sequence[Any], *, width: int = DEFAULT_WIDTH) -> list[bytes]:
    """Each figure (a ``go.Figure`` or its dict) as PNG bytes at its own ``layout.height`` and ``width`` pixels wide
    (an HTML figure's width follows its page; an image needs one)."""
    if not figures:
        return []
    if not os.environ.get("BROWSER_PATH"):
        found = next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)
        if not found:
            raise RuntimeError("drawing a figure as PNG needs Chromium (kaleido drives it): install it "
                               "(apt-get install -y chromium) or set BROWSER_PATH to a Chrome or Chromium binary.")
        os.environ["BROWSER_PATH"] = found
    import kaleido

    def opts(fig: Any) -> dict[str, Any]:
        layout = (fig.to_dict() if hasattr(fig, "to_dict") else fig).get("layout", {})
        return {"format": "png", "width": int(layout.get("width") or width),
                "height": int(layout.get("height") or DEFAULT_HEIGHT)}

    async def draw() -> list[bytes]:
        async with kaleido.Kaleido(n=1, timeout=120, mathjax=False) as k:
            return [await k.calc_fig(fig, opts=opts(fig)) for fig in figures]

    return asyncio.run(draw())

