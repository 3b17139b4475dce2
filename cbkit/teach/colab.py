"""Colab's one surprise: a package it had already imported, replaced on disk by the install cell.

Colab's kernel imports some packages before the first cell runs. When ``pip install cbkit`` upgrades one of them
(a newer transformers, say), the running kernel keeps the old module objects while their files are new: imports
mix versions and fail far from the cause. Comparing each loaded package's ``__version__`` with the version now
installed finds exactly those; the kernel must then restart once, and the rerun's install is a no-op.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

__all__ = ["replaced_packages", "restart_if_replaced"]

# Import names whose distribution is named differently.
_DISTRIBUTIONS = {"sklearn": "scikit-learn", "PIL": "pillow", "yaml": "pyyaml"}


def replaced_packages(modules: dict | None = None) -> dict[str, tuple[str, str]]:
    """Loaded top-level packages whose installed version now differs from the one in memory: name -> (loaded,
    installed)."""
    modules = sys.modules if modules is None else modules
    out = {}
    for name, module in list(modules.items()):
        loaded = getattr(module, "__version__", None)
        if "." in name or not isinstance(loaded, str):
            continue
        try:
            installed = metadata.version(_DISTRIBUTIONS.get(name, name))
        except metadata.PackageNotFoundError:
            continue
        if installed != loaded:
            out[name] = (loaded, installed)
    return out


def restart_if_replaced(*, kill: bool = True) -> dict[str, tuple[str, str]]:
    """After the install: if a package the kernel had imported was replaced, say so and restart the kernel (Colab
    brings it back at once; run the cell again, the install is then a no-op). Returns what was replaced."""
    replaced = replaced_packages()
    if replaced:
        names = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in sorted(replaced.items()))
        print(f"The install replaced packages this runtime had already imported ({names}). Restarting the "
              "runtime now: when it is back, run this cell again (the install is then a no-op).", flush=True)
        if kill:
            os.kill(os.getpid(), 9)
    return replaced
