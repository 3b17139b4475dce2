"""Sphinx configuration of the workshop book (`make book`): the executed notebooks and the facilitator's guide
as one static site. `scripts/build_book.py` stages the sources next to this file and builds it offline; why
Sphinx + myst-nb is in `docs/design.md`."""

from docutils import nodes as _nodes

project = "cbkit workshop"
author = "cbkit"
extensions = ["myst_nb"]
# `$$ ... $$` and `$ ... $` (docs/objective.md) are maths, drawn by the offline renderer at the end of this file.
myst_enable_extensions = ["dollarmath"]
html_math_renderer = "mathml"
# The notebooks were executed by `make test-notebooks` (nbmake, CI sizes): render what they printed and drew.
nb_execution_mode = "off"
# text/html (interactive plotly) outranks the PNG scripts/build_book.py adds for viewers without JavaScript.
myst_heading_anchors = 3
# Furo ships its fonts and scripts in its wheel: nothing is fetched when the site is built or read.
html_theme = "furo"
html_title = "cbkit workshop: continuous batching for GRPO rollouts"
html_static_path: list[str] = []
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
# The guide links to files of the repository (code, Makefile) that are not pages of the book.
suppress_warnings = ["myst.xref_missing"]


# Maths without MathJax, which Sphinx loads from a CDN: latex2mathml turns the LaTeX into MathML at build time, and
# the browser draws MathML itself (Chromium 109+, Firefox, Safari). Without latex2mathml the LaTeX source is shown.
def _mathml(latex: str, display: str) -> str:
    import html

    try:
        from latex2mathml.converter import convert
    except ImportError:
        return f'<code class="math">{html.escape(latex)}</code>'
    return convert(latex, display=display)


def _visit_inline(self, node):
    self.body.append(_mathml(node.astext(), "inline"))
    raise _nodes.SkipNode


def _visit_block(self, node):
    self.body.append(f'<div class="math">{_mathml(node.astext(), "block")}</div>')
    raise _nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("mathml", (_visit_inline, None), (_visit_block, None))
