"""The solutions edition of an executed notebook, for the facilitators' book (`make book`).

The learners' book shows each exercise as the learner meets it: the stub, and its check saying "not implemented
yet". The solutions edition is the same executed notebook with each stub cell's source replaced by the package's
solution (`cbkit.teach.exercises.solutions`, whose source is self-contained) and each check cell's output replaced
by what that check prints when it grades the solution, run here and now. Under the notebook's Questions comes the
facilitator's answer key (`cbkit.teach.exercises.answers`). Nothing else of the notebook is executed again: the
exercises never read the notebook's state, so the rest of its outputs stay true.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from typing import Any

from cbkit.teach.exercises import EXERCISES, solutions
from cbkit.teach.exercises.answers import ANSWERS, answer_key

__all__ = ["with_solutions"]


def with_solutions(book: Any, stem: str, *, seed: int = 1) -> Any:
    """`book` (an nbformat notebook of `stem`, executed or not) with every exercise answered and checked, and the
    answer key under its Questions, in place.

    Raises when a stub or its check cell is missing, when a check does not accept its solution (a solutions book
    must never show an answer that fails), or when the Questions and the answer key do not number alike."""
    import nbformat

    code = [cell for cell in book.cells if cell.cell_type == "code"]
    for name, check in EXERCISES[stem]:
        stubs = [i for i, cell in enumerate(code) if f"def {name}(" in cell.source]
        if len(stubs) != 1 or stubs[0] + 1 >= len(code) or check.__name__ not in code[stubs[0] + 1].source:
            raise ValueError(f"{stem}: expected one cell defining {name}() followed by a cell running {check.__name__}")
        stub, graded = code[stubs[0]], code[stubs[0] + 1]
        stub.source = inspect.getsource(getattr(solutions, name)).rstrip()
        stub.outputs = []
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = check(getattr(solutions, name), seed=seed)
        if not result.passed:
            raise AssertionError(f"{stem}: {check.__name__} refuses the solution: {result.message}")
        graded.outputs = [nbformat.v4.new_output("stream", name="stdout", text=out.getvalue())]
    questions = [i for i, cell in enumerate(book.cells)
                 if cell.cell_type == "markdown" and cell.source.startswith("## Questions")]
    if len(questions) != 1:
        raise ValueError(f"{stem}: expected one '## Questions' cell, found {len(questions)}")
    asked = len(re.findall(r"^\d+\. ", book.cells[questions[0]].source, re.M))
    if asked != len(ANSWERS[stem]):
        raise ValueError(f"{stem}: {asked} Questions but {len(ANSWERS[stem])} answers in "
                         "cbkit/teach/exercises/answers.py; write the missing answer")
    key = nbformat.v4.new_markdown_cell(answer_key(stem))
    key.id = "answer-key"
    book.cells.insert(questions[0] + 1, key)
    return book
