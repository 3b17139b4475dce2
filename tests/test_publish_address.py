"""The repository's address has one source, pyproject.toml's `[project.urls] Repository`: every copy of it (the
notebooks' Colab install and links, README's Colab badges) agrees with it, each link names a file that exists, and
scripts/publish_address.py rewrites the copies when it changes, touching nothing else."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import publish_address  # noqa: E402


def test_every_copy_of_the_address_is_pyprojects():
    stale = publish_address.stale(REPO)
    assert not stale, (
        f"{len(stale)} copies of the repository's address differ from pyproject.toml's "
        f"(https://github.com/{publish_address.repository(REPO)}), e.g. {stale[0].path.relative_to(REPO)}:"
        f"{stale[0].line} says {stale[0].slug}. Run `make publish-address` (scripts/publish_address.py).")


def test_the_copies_are_found_where_they_are():
    # Counted by hand in this checkout's text: one install per notebook, one badge per notebook in the README.
    found = publish_address.copies(REPO)
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb"))
    installs = [c for c in found if c.path in notebooks and "git+" in _line(c)]
    badges = [c for c in found if c.path.name == "README.md" and "colab.research.google.com/github/" in _line(c)]
    assert [c.path for c in installs] == notebooks
    assert len(badges) == len(notebooks)


def _line(copy: publish_address.Copy) -> str:
    return copy.path.read_text().splitlines()[copy.line - 1]


def test_links_into_the_repository_name_files_that_exist():
    slug = re.escape(publish_address.repository(REPO))
    link = re.compile(rf"github\.com/{slug}/blob/main/([^)\s\"'#]+)")
    paths = {m for c in publish_address.copies(REPO) for m in link.findall(_line(c))}
    assert paths, "no link into the repository found: has the link shape changed?"
    assert all((REPO / p).exists() for p in paths), sorted(p for p in paths if not (REPO / p).exists())


def _notebook(source: str, markdown: str) -> str:
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_markdown_cell(markdown, id="intro"), nbformat.v4.new_code_cell(source, id="setup")]
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nbformat.writes(book)


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.urls]\nRepository = "https://github.com/New-Owner/kit"\n')
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00.ipynb").write_text(_notebook(
        'pip("cbkit @ git+https://github.com/old/cbkit")',
        "Read [it](https://github.com/old/cbkit/blob/main/docs/a.md) or https://github.com/huggingface/trl."))
    (tmp_path / "README.md").write_text(
        "[![b](https://colab.research.google.com/assets/colab-badge.svg)]"
        "(https://colab.research.google.com/github/old/cbkit/blob/main/notebooks/00.ipynb)\r\n"
        "Clone https://github.com/Old/cbkit.git, or see https://github.com/old/cbkit.\r\n")
    return tmp_path


def test_publish_rewrites_every_copy_and_nothing_else(tree):
    before = {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    third = frozenset({"huggingface/trl"})
    changed = publish_address.publish(tree, third)
    assert sorted(p.name for p in changed) == ["00.ipynb", "README.md"]
    readme = (tree / "README.md").read_bytes()
    assert readme == (
        b"[![b](https://colab.research.google.com/assets/colab-badge.svg)]"
        b"(https://colab.research.google.com/github/New-Owner/kit/blob/main/notebooks/00.ipynb)\r\n"
        b"Clone https://github.com/New-Owner/kit.git, or see https://github.com/New-Owner/kit.\r\n")
    book = nbformat.read(tree / "notebooks" / "00.ipynb", as_version=4)
    nbformat.validate(book)
    assert [c.id for c in book.cells] == ["intro", "setup"] and book.metadata["kernelspec"]["name"] == "python3"
    assert book.cells[1].source == 'pip("cbkit @ git+https://github.com/New-Owner/kit")'
    assert book.cells[0].source == ("Read [it](https://github.com/New-Owner/kit/blob/main/docs/a.md) or "
                                    "https://github.com/huggingface/trl.")
    # Only the address moved: the notebook's JSON is the old one with the address replaced.
    old_json = before[tree / "notebooks" / "00.ipynb"].decode()
    assert (tree / "notebooks" / "00.ipynb").read_text() == old_json.replace("old/cbkit", "New-Owner/kit")
    assert (tree / "pyproject.toml").read_bytes() == before[tree / "pyproject.toml"]
    assert publish_address.stale(tree, third) == [] and publish_address.publish(tree, third) == []


def test_publish_refuses_two_old_addresses(tree):
    # huggingface/trl not declared third-party: the script cannot tell which one is the old address.
    before = {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match="(?s)huggingface/trl.*THIRD_PARTY"):
        publish_address.publish(tree, frozenset())
    assert {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()} == before


def test_check_names_the_command(tree, monkeypatch, capsys):
    monkeypatch.setattr(publish_address, "ROOT", tree)
    monkeypatch.setattr(publish_address, "THIRD_PARTY", frozenset({"huggingface/trl"}))
    assert publish_address.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "notebooks/00.ipynb" in out and "make publish-address" in out
    assert publish_address.main([]) == 0 and publish_address.main(["--check"]) == 0


def test_pyproject_without_a_github_address_is_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.urls]\nRepository = "https://gitlab.com/a/b"\n')
    with pytest.raises(SystemExit, match="github.com"):
        publish_address.repository(tmp_path)

