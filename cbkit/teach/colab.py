"""Colab's one surprise: the install cell upgrades a package the kernel had already imported (pyarrow, for TRL),
and imports then mix versions. Such a module's ``__version__`` differs from its distribution's, *and* that was
written after the kernel started (a misspelt version alone, certifi's, would restart the kernel forever)."""

from __future__ import annotations

import math
import os
import sys
import warnings
from importlib import metadata

_DISTRIBUTIONS = {"sklearn": "scikit-learn", "PIL": "pillow", "yaml": "pyyaml"}  # import name -> distribution


def replaced_packages(modules: dict | None = None, *, since: float | None = None) -> dict[str, tuple[str, str]]:
    """Loaded packages installed after ``since`` (default: process start) in another version: name -> (old, new)."""
    import psutil

    since = psutil.Process().create_time() if since is None else since
    out = {}
    for name, module in list((sys.modules if modules is None else modules).items()):
        with warnings.catch_warnings():  # some packages deprecate their __version__ (MarkupSafe 3.0)
            warnings.simplefilter("ignore", DeprecationWarning)
            loaded = getattr(module, "__version__", None)
        if "." in name or not isinstance(loaded, str):
            continue
        try:
            dist = metadata.distribution(_DISTRIBUTIONS.get(name, name))
        except metadata.PackageNotFoundError:
            continue
        # The .dist-info folder is the install's (uv links older files into it); none visible counts as new.
        try:
            written = os.stat(dist._path).st_mtime  # type: ignore[attr-defined]
        except (AttributeError, OSError):
            written = math.inf
        if dist.version != loaded and written > since:
            out[name] = (loaded, dist.version)
    return out


def restart_if_replaced() -> dict[str, tuple[str, str]]:
    """After the install: if a package the kernel had imported was replaced, say so and restart the kernel."""
    replaced = replaced_packages()
    if replaced:
        names = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in sorted(replaced.items()))
        print(f"The install replaced packages this runtime had already imported ({names}). Restarting the "
              "runtime now: when it is back, run this cell again (the install is then a no-op).", flush=True)
        os.kill(os.getpid(), 9)
    return replaced
