"""scripts/question_edits.py's copies keep what the edited cell and the cell the Question reads need, and nothing
else (`make test-questions` runs them; tests/test_notebooks.py checks that every edit applies and compiles)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from question_edits import Edit, apply, only_what_it_needs  # noqa: E402


def _book(*sources: str):
    book = nbformat.v4.new_notebook()
    for source in sources:
        book.cells += [nbformat.v4.new_markdown_cell("words"), nbformat.v4.new_code_cell(source)]
    return book


def test_a_copy_keeps_the_cells_its_edit_and_last_cell_need_and_drops_the_rest():
    book = _book(
        "env = setup()",                       # setup: always kept
        "N = 4\nSIZE = 2",                      # edited
        "model = load(env)",                    # bound here, read by the last cell
        "slow = sweep(model, N)",               # read by nothing kept: dropped
        "draw(slow)",                           # binds nothing: dropped
        "%matplotlib inline",                   # not plain Python: kept
        "table = run(model, N)\nprint(table)",  # the cell the Question reads
        "after = 1",                            # after it: cut by apply
    )
    edit = Edit(1, "N = 4", "N = 32", "`N = 32`", until="table = run(")
    copy = only_what_it_needs(apply(book, edit), edit)
    code = [c.source for c in copy.cells if c.cell_type == "code"]
    assert code == ["env = setup()", "N = 32\nSIZE = 2", "model = load(env)", "%matplotlib inline",
                    "table = run(model, N)\nprint(table)"]
    assert sum(c.cell_type == "markdown" for c in copy.cells) == 7  # every markdown cell up to the last one stays


def test_a_name_read_through_a_chain_of_cells_keeps_the_whole_chain():
    book = _book("env = setup()", "a = 1", "b = a + 1", "unused = 3", "c = b * 2", "K = 5", "print(c, K)")
    edit = Edit(1, "K = 5", "K = 6", "`K = 6`", until="print(c, K)")
    code = [c.source for c in only_what_it_needs(apply(book, edit), edit).cells if c.cell_type == "code"]
    assert code == ["env = setup()", "a = 1", "b = a + 1", "c = b * 2", "K = 6", "print(c, K)"]
