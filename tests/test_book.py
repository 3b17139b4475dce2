"""The workshop book (`make book`), opened as a learner opens it: offline, in headless Chromium.

`make book` builds the site from the executed notebooks and then runs this file with CBKIT_BOOK=runs/book.
Every notebook page must draw every figure its notebook has (plotly, from the one copy of plotly.js in the
page, no CDN), the front page must link the guide and every notebook, no page may load a script or a
style sheet from the network, and every figure must carry a PNG fallback (scripts/build_book.py) for viewers that
run no JavaScript. Without the variable (plain `pytest`) there is no book to look at and the tests skip."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path

import nbformat
import pytest

from tests.helpers import NOTEBOOK_STEMS as EXPECTED
from tests.helpers import PLOTLY_JSON, browser, drawn_figures

BOOK_ENV = "CBKIT_BOOK"
BOOK = Path(os.environ[BOOK_ENV]) if os.environ.get(BOOK_ENV) else None
needs_book = pytest.mark.skipif(BOOK is None, reason=f"{BOOK_ENV} not set: run `make book`")


def _staged(stem: str) -> Path:
    assert BOOK is not None
    return BOOK.with_name(BOOK.name + "-src") / "notebooks" / f"{stem}.ipynb"


def _figure_count(book) -> int:
    return sum("Plotly.newPlot" in str(out.get("data", {}).get("text/html", ""))
               for cell in book.cells if cell.cell_type == "code" for out in cell.get("outputs", []))


@needs_book
def test_front_page_links_the_guide_and_every_notebook():
    index = BOOK / "index.html"
    assert index.is_file(), f"{index} missing: run `make book`"
    html = index.read_text(encoding="utf-8")
    for page in ["docs/workshop.html", "docs/objective.html", "docs/learning.html"] + [f"notebooks/{stem}.html" for stem in EXPECTED]:
        assert f'href="{page}' in html, f"index.html does not link {page}"
        assert (BOOK / page).is_file(), f"{page} was not built"


@needs_book
def test_the_learning_results_show_their_figures():
    """docs/learning.md in the book: every figure it shows was copied beside it (a missing PNG is a broken image)."""
    html = (BOOK / "docs" / "learning.html").read_text(encoding="utf-8")
    images = re.findall(r'<img[^>]*src="([^"]+\.png)"', html)
    assert any("heldout-cb-vs-generate" in i for i in images), images
    for src in images:
        assert (BOOK / "docs" / src).is_file(), f"docs/learning.html shows {src}, which the book does not hold"


@needs_book
def test_the_solutions_book_is_built_beside_with_every_exercise_answered():
    solutions = BOOK.with_name(BOOK.name + "-solutions")
    html = (solutions / "index.html").read_text(encoding="utf-8")
    assert "solutions edition" in html
    for stem in EXPECTED:
        assert f'href="notebooks/{stem}.html' in html and (solutions / "notebooks" / f"{stem}.html").is_file()
        staged = nbformat.read(solutions.with_name(solutions.name + "-src") / "notebooks" / f"{stem}.ipynb", 4)
        assert "raise NotImplementedError" not in "\n".join(c.source for c in staged.cells), stem
        learners = nbformat.read(_staged(stem), as_version=4)
        assert "raise NotImplementedError" in "\n".join(c.source for c in learners.cells), stem


@needs_book
@pytest.mark.parametrize("page", ["index.html", "docs/workshop.html", "docs/objective.html", "docs/learning.html"]
                         + [f"notebooks/{s}.html" for s in EXPECTED])
def test_no_page_loads_anything_from_the_network(page):
    html = (BOOK / page).read_text(encoding="utf-8")
    remote = re.findall(r"<(?:script|link|img)[^>]*\s(?:src|href)=[\"'](https?://[^\"']+)", html)
    assert not remote, f"{page} loads from the network (blank or unstyled offline): {sorted(set(remote))}"


@needs_book
@pytest.mark.parametrize("stem", EXPECTED)
def test_every_figure_draws_in_the_book_and_has_a_png(stem):
    book = nbformat.read(_staged(stem), as_version=4)
    expected = _figure_count(book)
    pngs = [out["data"]["image/png"] for cell in book.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "Plotly.newPlot" in str(out.get("data", {}).get("text/html", ""))
            and "image/png" in out.get("data", {})]
    assert len(pngs) == expected, f"{stem}: {expected} figures, {len(pngs)} with a PNG fallback"
    for png in pngs:
        raw = base64.b64decode(png)
        assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 10_000, f"{stem}: a PNG fallback is not a drawn image"
    total, drawn = drawn_figures(browser((BOOK / "notebooks" / f"{stem}.html").resolve().as_uri(), "--dump-dom"))
    assert (total, drawn) == (expected, expected), (
        f"{stem}: {expected} figures in the notebook, {total} plotly figures on its page, {drawn} drew")


@needs_book
def test_the_executed_notebooks_keep_their_png_fallbacks():
    """`make book` adds the PNGs to the executed notebooks themselves (CBKIT_EXECUTED_NOTEBOOKS, runs/notebooks):
    the CI artefact, opened on github.com where no script runs, shows images."""
    if not os.environ.get("CBKIT_EXECUTED_NOTEBOOKS"):
        pytest.skip("CBKIT_EXECUTED_NOTEBOOKS not set")
    folder = Path(os.environ["CBKIT_EXECUTED_NOTEBOOKS"])
    for stem in EXPECTED:
        book = nbformat.read(folder / f"{stem}.ipynb", as_version=4)
        figures = [out for c in book.cells if c.cell_type == "code" for out in c.outputs
                   if PLOTLY_JSON in out.get("data", {})]
        assert all("image/png" in out["data"] for out in figures), stem


def test_figure_pngs_draws_offline_at_the_figure_size(tmp_path):
    """kaleido on the installed Chromium, no network: the PNG header's size is the one asked for (width given,
    height from the figure's layout), and add_png_fallbacks puts one PNG in each figure output, once."""
    import shutil
    import struct

    import plotly.graph_objects as go

    from cbkit.viz.figures import figure_pngs
    from scripts.build_book import add_png_fallbacks

    if not any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no Chromium installed")
    fig = go.Figure(go.Bar(x=["a", "b"], y=[3, 5])).update_layout(height=321)
    (png,) = figure_pngs([fig], width=654)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (654, 321)
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("fig")])
    book.cells[0].outputs = [nbformat.v4.new_output("display_data", data={
        PLOTLY_JSON: fig.to_plotly_json(), "text/html": "<div></div>"})]
    path = tmp_path / "x.ipynb"
    nbformat.write(book, path)
    assert add_png_fallbacks(path) == 1 and add_png_fallbacks(path) == 0
    assert "image/png" in nbformat.read(path, as_version=4).cells[0].outputs[0].data


@needs_book
def test_the_objective_page_draws_its_formulas_as_mathml():
    """docs/objective.md's `$$` formulas become MathML at build time (docs/book/conf.py): the browser draws them with
    no script, where MathJax would come from a CDN and leave raw LaTeX offline."""
    html = (BOOK / "docs" / "objective.html").read_text(encoding="utf-8")
    # myst marks sections `mathjax_ignore`; what must be absent is a MathJax script (a CDN, blank offline).
    scripts = re.findall(r"<script[^>]*>", html, flags=re.I)
    assert html.count("<math") >= 10, "objective.html: formulas not drawn as MathML"
    assert not [t for t in scripts if "mathjax" in t.lower()], f"objective.html loads MathJax: {scripts}"
