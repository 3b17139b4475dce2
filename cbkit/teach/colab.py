"""Colab's one surprise: a package it had already imported, replaced on disk by the install cell.

Colab's kernel imports some packages before the first cell runs. When ``pip install cbkit`` upgrades one of them
(a newer pyarrow, say, which TRL asks for), the running kernel keeps the old module objects while their files are
new: imports mix versions and fail far from the cause. Such a package is one whose module in memory carries another
``__version__`` than its installed distribution, *and* whose distribution was written after this process started.
The kernel must then restart once, and the rerun's install is a no-op.

The second condition is what lets the rerun pass. A module's ``__version__`` need not spell its distribution's
version (certifi's module says 2026.10.19 where the installed distribution is 2026.10.19.post1), so the first alone
would find such a package on every run and restart the runtime forever.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from importlib import metadata

__all__ = ["process_start", "replaced_packages", "restart_if_replaced"]

# Import names whose distribution is named differently.
_DISTRIBUTIONS = {"sklearn": "scikit-learn", "PIL": "pillow", "yaml": "pyyaml"}


def process_start() -> float:
    """When this process (the kernel) started, in seconds since the epoch, as file times are."""
    import psutil

    return psutil.Process().create_time()


def _written_at(dist: metadata.Distribution) -> float:
    # The .dist-info folder is created by the install (pip or uv alike; uv links files from its cache, so their own
    # times can be older). An installer that keeps no folder we can see counts as new: the version test decides.
    path = getattr(dist, "_path", None)
    try:
        return os.stat(path).st_mtime if path is not None else math.inf
    except OSError:
        return math.inf


def replaced_packages(modules: dict | None = None, *, since: float | None = None) -> dict[str, tuple[str, str]]:
    """Loaded top-level packages whose distribution was installed after ``since`` (default: when this process
    started) in another version than the one in memory: name -> (loaded, installed)."""
    modules = sys.modules if modules is None else modules
    since = process_start() if since is None else since
    out = {}
    for name, module in list(modules.items()):
        with warnings.catch_warnings():  # some packages deprecate their __version__ (MarkupSafe 3.0)
            warnings.simplefilter("ignore", DeprecationWarning)
            loaded = getattr(module, "__version__", None)
        if "." in name or not isinstance(loaded, str):
            continue
        try:
            dist = metadata.distribution(_DISTRIBUTIONS.get(name, name))
        except metadata.PackageNotFoundError:
            continue
        if dist.version != loaded and _written_at(dist) > since:
            out[name] = (loaded, dist.version)
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
