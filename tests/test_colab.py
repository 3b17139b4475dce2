"""Colab's restart check (cbkit.teach.colab) against real .dist-info folders on disk: it finds a package the install
replaced under a loaded module, and nothing else, so the rerun it asks for does not restart again."""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import pytest

from cbkit.teach import colab


def _dist(site, name: str, version: str, *, written: float) -> None:
    folder = site / f"{name}-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    os.utime(folder, (written, written))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_finds_exactly_the_package_installed_under_a_loaded_module(site):
    start = time.time() - 60  # the kernel started a minute ago
    _dist(site, "upgraded", "2.0", written=start + 30)  # the install cell replaced 1.0, which was loaded
    # certifi's case: the module spells its version differently from its distribution, installed long ago
    _dist(site, "misspelt", "2026.10.19.post1", written=start - 3600)
    _dist(site, "fresh", "3.0", written=start + 30)  # new, and imported only after the install
    loaded = {"upgraded": types.SimpleNamespace(__version__="1.0"),
              "misspelt": types.SimpleNamespace(__version__="2026.10.19"),
              "fresh": types.SimpleNamespace(__version__="3.0"),
              "upgraded.sub": types.SimpleNamespace(__version__="0"),  # submodules are not packages
              "noversion": types.SimpleNamespace()}
    assert colab.replaced_packages(loaded, since=start) == {"upgraded": ("1.0", "2.0")}
    # After the restart the kernel is younger than every install: the rerun finds nothing and runs on.
    assert colab.replaced_packages(loaded, since=start + 31) == {}


def test_nothing_installed_while_this_process_ran_means_nothing_replaced():
    # This process's own modules, whatever their __version__ says (certifi's disagrees with its distribution here).
    pytest.importorskip("requests")
    import transformers  # noqa: F401  (many packages with a __version__)

    assert colab.replaced_packages() == {}


def test_restart_names_what_was_replaced_and_kills_the_kernel(site, monkeypatch, capsys):
    start = time.time() - 60
    _dist(site, "upgraded", "2.0", written=start + 30)
    monkeypatch.setitem(sys.modules, "upgraded", types.SimpleNamespace(__version__="1.0"))
    monkeypatch.setattr("psutil.Process", lambda: types.SimpleNamespace(create_time=lambda: start))
    killed = []
    monkeypatch.setattr(colab.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    assert colab.restart_if_replaced() == {"upgraded": ("1.0", "2.0")} and killed == [(os.getpid(), 9)]
    out = capsys.readouterr().out
    assert "upgraded 1.0 -> 2.0" in out and "run this cell again" in out


# Colab's GPU runtime as published in googlecolab/backend-info's pip-freeze.gpu.txt (commit a724079, 2026-08-19,
# Python 3.13): the versions of the packages cbkit names that it preinstalls. TRL, gguf, reasoning-gym and
# math-verify are not there, so the install adds them.
COLAB = {"torch": "2.11.0+cu128", "transformers": "5.15.0", "datasets": "4.0.0", "plotly": "5.24.1",
         "ipywidgets": "7.7.1", "tqdm": "4.67.3", "psutil": "5.9.5", "safetensors": "0.8.0"}



# Colab packages cbkit's ranges replace on purpose, and why. torch is never among them (a CUDA build, GBs).
MUST_REPLACE = {"transformers": "5.24 is the oldest release cbkit's CB engine tests pass on (pyproject.toml)"}


def test_cbkit_accepts_every_version_colab_preinstalls_but_the_ones_it_needs_newer():
    """Else pip replaces Colab's own build (a CUDA torch above all) for nothing. What the install does replace, TRL's
    requirements and all: `python scripts/colab_dry_run.py`."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    ranges = {r.name.lower(): r.specifier for r in map(Requirement, pyproject["project"]["dependencies"])}
    assert COLAB.keys() <= ranges.keys()
    refused = {name: f"{version} not in {ranges[name]}" for name, version in COLAB.items()
               if not ranges[name].contains(version, prereleases=True)}
    assert refused.keys() <= MUST_REPLACE.keys(), refused
    assert "torch" not in MUST_REPLACE
