"""The JSONL files cbkit appends to (the sweep's results, the loop's metrics): a crash leaves at most a torn *last*
line, dropped with a warning (with ``repair``, cut from the file); any other bad line is an error."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any


def read_jsonl(path: str | os.PathLike[str], *, repair: bool = False, what: str = "record") -> list[dict[str, Any]]:
    """The records of a JSONL file, a torn last line dropped; ``what`` names a record in the warning."""
    lines = Path(path).read_text().splitlines(keepends=True)
    filled = [i for i, line in enumerate(lines) if line.strip()]
    records: list[dict[str, Any]] = []
    for i in filled:
        try:
            record = json.loads(lines[i])
        except json.JSONDecodeError as e:
            if i != filled[-1]:
                raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e}). Fix or delete that line.") from None
            warnings.warn(f"{path}, line {i + 1}: dropped a torn last line (a {what} interrupted while "
                          "it was being written).", UserWarning, stacklevel=2)
            if repair:
                with open(path, "r+") as f:
                    f.truncate(len("".join(lines[:i]).encode()))
            break
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {i + 1}: a JSON {type(record).__name__}, not a record (an object).")
        records.append(record)
    return records


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One record as one line; the file is closed, so flushed, before this returns."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
