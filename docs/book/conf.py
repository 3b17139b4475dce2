"""Sphinx configuration of the workshop book (`make book`): the executed notebooks and the facilitator's guide
as one static site. `scripts/build_book.py` stages the sources next to this file and builds it offline; why
Sphinx + myst-nb is in `docs/design.md`."""

project = "cbkit workshop"
author = "cbkit"
extensions = ["myst_nb"]
# The notebooks were executed by `make test-notebooks` (nbmake, CI sizes): render what they printed and drew.
nb_execution_mode = "off"
# text/html (interactive plotly) outranks the image/png that cbkit.viz.static adds for viewers without JavaScript.
myst_heading_anchors = 3
# Furo ships its fonts and scripts in its wheel: nothing is fetched when the site is built or read.
html_theme = "furo"
html_title = "cbkit workshop: continuous batching for GRPO rollouts"
html_static_path: list[str] = []
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
# The guide links to files of the repository (code, Makefile) that are not pages of the book.
suppress_warnings = ["myst.xref_missing"]
