"""One palette for every figure and live chart, so a backend keeps its colour in every chart of a notebook."""

from __future__ import annotations

import zlib

PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
           "#CCB974", "#64B5CD")
BACKEND_COLORS = {"generate": PALETTE[0], "continuous": PALETTE[1], "vllm": PALETTE[2]}
TEMPLATE = "plotly_white"


def backend_color(backend: str) -> str:
    """A backend's colour: fixed for the three cbkit knows, else a stable pick (crc32: str hashes vary by process)."""
    return BACKEND_COLORS.get(backend, PALETTE[zlib.crc32(backend.encode()) % len(PALETTE)])
