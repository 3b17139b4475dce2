"""The committed notebooks: stripped of outputs, kernelspec python3, shaped the way STYLE.md asks (title and
what/runtime/hardware, one setup cell, one parameters cell, markdown before every code cell, Summary and
Exercises, no long cells), and listed in the README with a working Colab badge. Running them is nbmake's job
(`make test` executes every notebook at CI sizes)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
EXPECTED = ["00_quickstart", "01_kv_slot_recycling", "02_logprob_correctness", "03_n_sweep", "04_grpo_live"]
MAX_CELL_LINES = 25


def repository_url() -> str:
    # pyproject's [project.urls] Repository (a regex: tomllib is 3.11+, cbkit supports 3.10)
    match = re.search(r'^Repository\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert match, "pyproject.toml: [project.urls] needs Repository = \"https://github.com/...\""
    return match.group(1).rstrip("/")


def test_every_notebook_is_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.stem)
def nb(request):
    return request.param, nbformat.read(request.param, as_version=4)


def test_committed_without_outputs_and_with_the_python3_kernel(nb):
    path, book = nb
    nbformat.validate(book)
    assert book.metadata["kernelspec"]["name"] == "python3", f"{path.name}: kernelspec must be python3"
    assert "widgets" not in book.metadata, f"{path.name}: widget state committed; run nbstripout"
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {i} carries outputs; run `nbstripout {path.relative_to(REPO)}` "
                "(make setup installs it as a git filter)")


def test_shape_title_setup_parameters_markdown_summary_exercises(nb):
    path, book = nb
    cells = book.cells
    title = cells[0].source
    assert cells[0].cell_type == "markdown" and title.startswith("# ")
    for part in ("What you will see", "Runtime", "Hardware"):
        assert part in title, f"{path.name}: the opening cell must say {part!r}"
    code = [c for c in cells if c.cell_type == "code"]
    setup = [c for c in code if "env = setup()" in c.source]
    assert len(setup) == 1 and setup[0] is code[0], f"{path.name}: one setup cell, first"
    assert "pip" in setup[0].source and "google.colab" in setup[0].source
    params = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("## Parameters")]
    assert len(params) == 1 and cells[params[0] + 1].cell_type == "code", f"{path.name}: one parameters cell"
    assert "env.pick(" in cells[params[0] + 1].source
    for i, cell in enumerate(cells):
        if cell.cell_type == "code":
            assert cells[i - 1].cell_type == "markdown", f"{path.name}: cell {i} has no markdown before it"
            lines = len(cell.source.splitlines())
            assert lines <= MAX_CELL_LINES, (
                f"{path.name} cell {i} has {lines} lines; logic that long belongs in cbkit/")
    headings = [c.source.splitlines()[0] for c in cells if c.cell_type == "markdown"]
    assert "## Summary" in "\n".join(c.source for c in cells[-2:])
    assert headings[-1].startswith("## Summary") or "## Exercises" in cells[-1].source
    assert "## Exercises" in cells[-1].source


def test_colab_install_points_at_the_repository(nb):
    path, book = nb
    assert f"git+{repository_url()}" in book.cells[2].source or any(
        f"git+{repository_url()}" in c.source for c in book.cells if c.cell_type == "code"), path.name


def test_readme_lists_every_notebook_with_a_colab_badge():
    readme = (REPO / "README.md").read_text()
    slug = repository_url().removeprefix("https://github.com/")
    for stem in EXPECTED:
        badge = f"https://colab.research.google.com/github/{slug}/blob/main/notebooks/{stem}.ipynb"
        assert badge in readme, f"README: no Colab badge for {stem}"
    row = re.compile(r"^\|.*\[`?(\d\d_[a-z_]+)`?\]", re.M)
    assert sorted(set(row.findall(readme))) == EXPECTED


def test_git_strips_notebook_outputs():
    attributes = (REPO / ".gitattributes").read_text()
    assert re.search(r"^\*\.ipynb\s+filter=nbstripout", attributes, re.M)
    assert "nbstripout --install" in (REPO / "Makefile").read_text()
