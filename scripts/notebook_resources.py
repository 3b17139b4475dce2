"""Each notebook kernel's wall time and peak RSS, recorded where `make test-notebooks` executes the notebooks.

The kernel is its own process, not pytest's, so the kernel reports on itself: `mark` gives the last code cell of
every notebook in a folder an nbmake `post_cell_execute` step (run in the kernel after that cell, not shown in the
notebook) that writes `<stem>.resources.json` beside it: seconds since the kernel process started, and its peak
RSS since then (`cbkit.telemetry.process_peak_rss`: VmHWM, and what the notebook's own memory probes reset of it).
`table` prints them as a table, and fails when a notebook wrote none.

    python scripts/notebook_resources.py mark runs/notebooks     # before nbmake
    python scripts/notebook_resources.py table runs/notebooks    # after
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SUFFIX = ".resources.json"

REPORT = """\
def _cbkit_report_resources():  # a function, so the kernel's namespace gains nothing but this name, deleted below
    import json
    import time

    import psutil

    from cbkit.telemetry import process_peak_rss

    with open({path!r}, "w") as f:
        json.dump({{"notebook": {stem!r}, "seconds": round(time.time() - psutil.Process().create_time(), 1),
                   "peak_rss_bytes": process_peak_rss()}}, f)
_cbkit_report_resources()
del _cbkit_report_resources
"""


def mark(folder: Path) -> int:
    import nbformat

    paths = sorted(folder.glob("*.ipynb"))
    for path in paths:
        book = nbformat.read(path, as_version=4)
        last = [c for c in book.cells if c.cell_type == "code"][-1]
        report = REPORT.format(path=str((folder / f"{path.stem}{SUFFIX}").resolve()), stem=path.stem)
        last.metadata.setdefault("nbmake", {})["post_cell_execute"] = report.splitlines()
        nbformat.write(book, path)
    return len(paths)


def records(folder: Path) -> dict[str, dict]:
    """stem -> its record, for every notebook in `folder` (None where the kernel wrote none)."""
    out = {}
    for path in sorted(folder.glob("*.ipynb")):
        record = folder / f"{path.stem}{SUFFIX}"
        out[path.stem] = json.loads(record.read_text()) if record.is_file() else None
    return out


def table(folder: Path) -> str:
    rows = ["| notebook | kernel wall time | kernel peak RSS |", "| --- | --- | --- |"]
    for stem, rec in records(folder).items():
        rows.append(f"| `{stem}` | {rec['seconds']:.0f} s | {rec['peak_rss_bytes'] / 2**30:.2f} GiB |" if rec
                    else f"| `{stem}` | no record | no record |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["mark", "table"])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.action == "mark":
        print(f"notebook_resources: {mark(args.folder)} notebooks in {args.folder} will record their kernel's "
              f"time and peak RSS (*{SUFFIX})")
        return 0
    print(table(args.folder))
    missing = [stem for stem, rec in records(args.folder).items() if rec is None]
    if missing:
        print(f"notebook_resources: no record from {', '.join(missing)} (did the last cell run?)")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
