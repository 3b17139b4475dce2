"""Copies of the notebooks with the sections the facilitator's guide lets a session skip taken out, to run alone.

docs/workshop.md tells a facilitator to show some sections from the book rather than run them (02's section 3,
05's sections 2 and 3). A section after them must then run without them: `make test-skipped` (in `make test-more`) executes the copies
this script writes, so a cell that reads a name only a skipped section defines fails CI, not a workshop.

    python scripts/skip_sections.py --out runs/notebooks-skipped
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# notebook -> the "## N." headings of the sections docs/workshop.md shows from the book instead of running live
SKIPPABLE = {
    "02_logprob_correctness": ["## 3."],
    "05_off_policy": ["## 2.", "## 3."],
}


def without_sections(book, headings: list[str]):
    """`book` without each section whose heading starts with one of `headings`: its cells up to the next "## "."""
    kept, skipping, removed = [], False, set()
    for cell in book.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            match = next((h for h in headings if cell.source.startswith(h)), None)
            skipping = match is not None
            removed |= {match} if match else set()
        if not skipping:
            kept.append(cell)
    missing = set(headings) - removed
    if missing:
        raise ValueError(f"no section starts with {sorted(missing)}: update SKIPPABLE (scripts/skip_sections.py)")
    book.cells = kept
    return book


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, headings in SKIPPABLE.items():
        book = nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4)
        nbformat.write(without_sections(book, headings), args.out / f"{stem}.ipynb")
        print(f"skip_sections: {stem} without {', '.join(headings)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
