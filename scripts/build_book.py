"""`make book`: the executed notebooks and the facilitator's guide as a static site, built offline.

Reads the notebooks `make test-notebooks` executed (runs/notebooks), adds a PNG of every figure to them
(`cbkit.viz.static`: what github.com's viewer shows, where plotly.js does not run), stages them with
docs/workshop.md, docs/objective.md and docs/book/ into one source folder laid out as the repository is (so the guide's links to
../notebooks/ work on GitHub and in the book alike), and runs Sphinx with myst-nb on it, without executing
anything again. The site's front page is <out>/index.html.

Beside it, the facilitators' solutions book (<out>-solutions/index.html): the same executed notebooks with each
exercise's stub replaced by the package's solution and each check's output by that check grading it
(`cbkit.teach.exercises.book.with_solutions`, which runs the checks only, offline, in seconds).

    python scripts/build_book.py [--notebooks runs/notebooks] [--out runs/book]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["00_quickstart", "01_kv_slot_recycling", "02_logprob_correctness", "03_n_sweep", "04_grpo_live", "05_off_policy"]


def executed_notebooks(folder: Path) -> list[Path]:
    import nbformat

    paths = [folder / f"{stem}.ipynb" for stem in NOTEBOOKS]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        sys.exit(f"build_book: {', '.join(missing)} not in {folder}: run `make test-notebooks` first (it executes "
                 "every notebook there), or give --notebooks a folder of executed notebooks.")
    for p in paths:
        book = nbformat.read(p, as_version=4)
        unrun = [i for i, c in enumerate(book.cells) if c.cell_type == "code" and c.execution_count is None]
        if unrun:
            sys.exit(f"build_book: {p} has cells {unrun} that never ran: run `make test-notebooks` again.")
    return paths


# Mime types only a live front end reads: plotly's JSON (JupyterLab draws it; the saved text/html draws
# everywhere else) and the phenomena the guards read (cbkit.teach.notebook.record_phenomena). Sphinx would warn
# on each, so the staged copy keeps the rest of every bundle: text/html, the PNG and text/plain.
FRONT_END_ONLY = ("application/vnd.plotly.v1+json", "application/vnd.cbkit.phenomena+json")


def stage_notebook(path: Path, dest: Path, solutions: bool = False) -> None:
    import nbformat

    book = nbformat.read(path, as_version=4)
    if solutions:
        from cbkit.teach.exercises.book import with_solutions

        with_solutions(book, path.stem)
    for cell in book.cells:
        for out in cell.get("outputs", []):
            for mime in FRONT_END_ONLY:
                out.get("data", {}).pop(mime, None)
    nbformat.write(book, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=REPO / "runs" / "notebooks")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "book")
    args = parser.parse_args(argv)
    from cbkit.viz.static import add_png_fallbacks

    start = time.perf_counter()
    paths = executed_notebooks(args.notebooks)
    drawn = sum(add_png_fallbacks(p) for p in paths)
    print(f"build_book: {drawn} figures drawn as PNG fallbacks in {time.perf_counter() - start:.1f} s")
    rc = build(paths, args.out, solutions=False)
    if rc == 0:
        print(f"build_book: {args.out / 'index.html'} in {time.perf_counter() - start:.1f} s")
        solutions_out = args.out.with_name(args.out.name + "-solutions")
        rc = build(paths, solutions_out, solutions=True)
        if rc == 0:
            print(f"build_book: the solutions book, {solutions_out / 'index.html'}, in "
                  f"{time.perf_counter() - start:.1f} s")
    return rc


SOLUTIONS_NOTE = (
    "\n**The solutions edition**, for facilitators: each exercise's stub is replaced by its solution from "
    "`cbkit.teach.exercises.solutions`, and the check under it shows that check grading the solution. Learners "
    "get the other edition, where every stub is still to write.\n")


def build(paths: list[Path], out: Path, solutions: bool) -> int:
    """Stage the notebooks (the solutions edition when `solutions`) with the guide and run Sphinx into `out`."""
    from sphinx.cmd.build import build_main

    src = out.with_name(out.name + "-src")
    shutil.rmtree(src, ignore_errors=True)
    (src / "notebooks").mkdir(parents=True)
    (src / "docs").mkdir()
    shutil.copy(REPO / "docs" / "book" / "conf.py", src / "conf.py")
    index = (REPO / "docs" / "book" / "index.md").read_text()
    if solutions:
        title, rest = index.split("\n", 1)
        index = f"{title} (solutions)\n{SOLUTIONS_NOTE}{rest}"
    (src / "index.md").write_text(index)
    # The guide (where its numbers come from is lab/workshop-provenance.md, outside the book).
    shutil.copy(REPO / "docs" / "workshop.md", src / "docs" / "workshop.md")
    # The GRPO objective, written once (its formulas drawn as MathML by conf.py, offline); the notebooks link to it.
    shutil.copy(REPO / "docs" / "objective.md", src / "docs" / "objective.md")
    # The learning results (docs/learning.md): the figure of CB against generate() and the hacking lesson, with the
    # numbers scripts/learning_report.py printed from the runs.
    shutil.copy(REPO / "docs" / "learning.md", src / "docs" / "learning.md")
    shutil.copytree(REPO / "docs" / "learning", src / "docs" / "learning")
    for p in paths:
        stage_notebook(p, src / "notebooks" / p.name, solutions=solutions)
    shutil.rmtree(out, ignore_errors=True)
    # -W: a warning (a broken toctree, an output it cannot render) fails the build; -n: nitpicky off.
    return build_main(["-b", "html", "-q", "-W", "--keep-going", str(src), str(out)])


if __name__ == "__main__":
    sys.exit(main())
