"""The sweep's results file: one JSONL line per run, appended as it finishes.

The first line records the configuration, so a rerun resumes (skipping what is there) or refuses to mix a different
configuration into the same table; a torn last line, left by a crash mid-write, is dropped with a warning rather
than failing the whole file. `aggregate` turns runs into points: the median of a backend's repeats at one N, with
its ratios to generate() measured in the same process.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from pathlib import Path
from typing import Any


class ResultsFile:
    """The sweep's JSONL: a header line with the fingerprint, then one line per finished run."""

    def __init__(self, path: str | Path, fingerprint: dict[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.runs: list[dict[str, Any]] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"kind": "header", "fingerprint": fingerprint})

    def _load(self) -> None:
        lines = _read_jsonl(self.path, repair=True)
        if not lines or lines[0].get("kind") != "header":
            raise ValueError(f"{self.path} is not a cbkit sweep results file (no header line); use another --out.")
        theirs = lines[0]["fingerprint"]
        diff = {k: (theirs.get(k), v) for k, v in self.fingerprint.items() if theirs.get(k) != v}
        if diff:
            listed = "; ".join(f"{k}: file has {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{self.path} holds results of a different configuration ({listed}). Mixing them would put "
                "incomparable numbers in one table: use another --out, or rerun with the file's settings."
            )
        self.runs = [line for line in lines[1:] if line.get("kind") == "run"]

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def done(self, backend: str, n: int, repeat: int) -> bool:
        return any(r["backend"] == backend and r["N"] == n and r["repeat"] == repeat for r in self.runs)

    def add(self, run: dict[str, Any]) -> None:
        run = {"kind": "run", **run}
        self._append(run)
        self.runs.append(run)

    def add_line(self, record: dict[str, Any]) -> None:
        """A line that is not a run (a probe of the machine): kept in the file, skipped by `done` and `aggregate`."""
        self._append(record)


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats per (backend, N), then ratios to generate() at the same N."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["N"]), []).append(r)
    points = []
    for (backend, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rs if r["status"] == "ok"]
        point: dict[str, Any] = {"backend": backend, "N": n, "repeats": len(rs),
                                 "status": "ok" if ok else rs[0]["status"]}
        for key in ("tokens_per_s", "rollout_s", "step_s", "train_s", "peak_mem_bytes", "kv_bytes", "padding_share",
                    "mean_completion_len", "completion_tokens", "planned_peak_bytes", "plan_error", "length_mean",
                    "length_cv", "length_max", "static_padding_share", "mfu", "peak_flops", "peak_reserved_bytes",
                    "device_used_bytes", "nvml_bytes", "bytes_per_s", "roof_tokens_per_s", "roof_share"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            point[key] = statistics.median(vals) if vals else None
        if not ok:
            point["peak_mem_bytes"] = max((r["peak_mem_bytes"] or 0 for r in rs), default=None)
        point["peak_mem_kind"] = next((r.get("peak_mem_kind") for r in rs if r.get("peak_mem_kind")), None)
        point["lengths"] = next((r.get("lengths") for r in rs if r.get("lengths")), None)
        for key in ("roof_bound", "roof_missing"):  # what bound the roof, or why there is none: the same every repeat
            point[key] = next((r.get(key) for r in ok if r.get(key)), None)
        points.append(point)
    by_key = {(p["backend"], p["N"]): p for p in points}
    for p in points:
        g = by_key.get(("generate", p["N"]))
        p["speed_vs_generate"] = _ratio(p["tokens_per_s"], g and g["tokens_per_s"])
        p["mem_vs_generate"] = _ratio(p["peak_mem_bytes"], g and g["peak_mem_bytes"])
    return points


def _ratio(a, b) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    return [r for r in _read_jsonl(Path(path)) if r.get("kind") == "run"]


def _read_jsonl(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """The records of a results file. A torn *last* line (a sweep killed mid-write: the run in flight) is dropped
    with a warning, and with `repair` cut from the file, so the next append starts on a line of its own. Any other
    unreadable line is an error that names the file and the line."""
    text = path.read_text()
    records, offset, last_good_end = [], 0, 0
    lines = text.splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        offset += len(line)
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i != last:
                raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e}). Fix or delete that line.") from None
            warnings.warn(f"{path}, line {i + 1}: dropped a torn last line (a run interrupted while it was being "
                          "written); that run will be measured again.", UserWarning, stacklevel=3)
            if repair:
                with open(path, "r+") as f:
                    f.truncate(len(text[:last_good_end].encode()))
            break
        last_good_end = offset
    return records
