"""Colab's restart check (cbkit.teach.colab) against real .dist-info folders on disk: it finds a package the install
replaced under a loaded module, and nothing else, so the rerun it asks for does not restart again."""

from __future__ import annotations

import os
import sys
import time
import types

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


def test_restart_names_what_was_replaced_and_kills_only_when_asked(site, monkeypatch, capsys):
    start = time.time() - 60
    _dist(site, "upgraded", "2.0", written=start + 30)
    monkeypatch.setitem(sys.modules, "upgraded", types.SimpleNamespace(__version__="1.0"))
    monkeypatch.setattr(colab, "process_start", lambda: start)
    killed = []
    monkeypatch.setattr(colab.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    assert colab.restart_if_replaced(kill=False) == {"upgraded": ("1.0", "2.0")} and killed == []
    assert colab.restart_if_replaced() == {"upgraded": ("1.0", "2.0")} and killed == [(os.getpid(), 9)]
    out = capsys.readouterr().out
    assert "upgraded 1.0 -> 2.0" in out and "run this cell again" in out
