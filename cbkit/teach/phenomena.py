"""What the notebooks' text relies on, recorded for the guards.

A notebook's text says "the static batch pads", "blocks are recycled", "CB is ahead at the largest N". Those are
measured at CI size every time CI runs the notebooks, and tests/test_notebooks.py (the phenomenon guards) reads
them back from the executed notebook: when a change of sizes, engine or model makes one disappear, the guard
fails and names it, instead of the text quietly describing something the run no longer shows.
"""

from __future__ import annotations

import torch

PHENOMENA_MIME = "application/vnd.cbkit.phenomena+json"


def record_phenomena(**values: float | int | bool | str) -> None:
    """Display the measured numbers a notebook's text relies on as one output: JSON the guards read
    (``PHENOMENA_MIME``) and a line a reader sees. Numbers only as measured, never thresholds: those are the
    guards'."""
    import json
    import math

    from IPython.display import display

    clean = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"record_phenomena: {key} is {value}; a phenomenon needs a measured number.")
        clean[key] = value
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in clean.items())
    display({PHENOMENA_MIME: json.loads(json.dumps(clean)), "text/plain": f"recorded for the checks: {text}"},
            raw=True)
