"""The sweep's results file: one JSONL line per run, appended as it finishes.

The first line records the configuration, so a rerun resumes (skipping what is there) or refuses to mix a different
configuration into the same table; a torn last line, left by a crash mid-write, is dropped with a warning
(`cbkit.jsonl`) rather than failing the whole file. `aggregate` turns runs into points: the median of a backend's
repeats at one N, with its ratios to generate() measured in the same process.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbkit.jsonl import append_jsonl, read_jsonl


@dataclass
class Results:
    """A results file read: its configuration (the header's fingerprint), its runs and its matmul probes."""

    path: Path
    fingerprint: dict[str, Any]
    runs: list[dict[str, Any]]
    probes: list[dict[str, Any]]


def read_results(path: str | Path, *, repair: bool = False) -> Results:
    """A sweep results file, a torn last line dropped (`cbkit.jsonl.read_jsonl`), run lines of older cbkit
    versions read under today's names. A missing, empty or foreign file is an error that says what to do."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No results file at {path}; run `cbkit sweep --out {path}` first.")
    lines = read_jsonl(path, repair=repair, what="run")
    if not lines:
        raise ValueError(f"{path} is empty: no header line and no runs (a sweep stopped before it wrote anything). "
                         f"Delete it and run `cbkit sweep --out {path}` again.")
    if lines[0].get("kind") != "header":
        raise ValueError(f"{path} is not a cbkit sweep results file (its first line is no header); use another "
                         "--out, or give the file `cbkit sweep` wrote.")
    return Results(path, lines[0].get("fingerprint", {}),
                   [x for x in lines[1:] if x.get("kind") == "run"],
                   [x for x in lines[1:] if x.get("kind") == "probe"])


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
        theirs = read_results(self.path, repair=True)
        diff = {k: (theirs.fingerprint.get(k), v) for k, v in self.fingerprint.items()
                if theirs.fingerprint.get(k) != v}
        if diff:
            listed = "; ".join(f"{k}: file has {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{self.path} holds results of a different configuration ({listed}). Mixing them would put "
                "incomparable numbers in one table: use another --out, or rerun with the file's settings."
            )
        self.runs = theirs.runs

    def _append(self, record: dict[str, Any]) -> None:
        append_jsonl(self.path, record)

    def done(self, backend: str, n: int, repeat: int) -> bool:
        return any(r["backend"] == backend and r["N"] == n and r["repeat"] == repeat for r in self.runs)

    def add(self, run: dict[str, Any]) -> None:
        run = {"kind": "run", **run}
        self._append(run)
        self.runs.append(run)

    def add_line(self, record: dict[str, Any]) -> None:
        """A line that is not a run (a probe of the machine): kept in the file, skipped by `done` and `aggregate`."""
        self._append(record)


# What `aggregate` takes the median of: a run's speed, memory and lengths, its roofs, a full step's phases and their
# roofs, the async row's waits.
_MEDIANS = ("tokens_per_s", "rollout_s", "step_s", "train_s", "peak_mem_bytes", "kv_bytes", "kv_padding_share",
            "completion_tokens", "planned_peak_bytes", "plan_error", "length_mean", "length_cv", "length_max",
            "decode_padding_share", "mfu", "peak_flops", "peak_reserved_bytes", "device_used_bytes", "nvml_bytes",
            "bytes_per_s", "roof_tokens_per_s", "roof_share", "old_logprob_s", "update_s", "other_s", "rollout_share",
            "rollout_roof_share", "old_logprob_roof_share", "update_roof_share", "rollout_roof_s",
            "old_logprob_roof_s", "update_roof_s", "planned_rollout_peak_bytes", "rollout_wait_s", "publish_wait_s",
            "rollout_wall_s", "rollout_wall_roof_share", "steady_steps", "first_step_s")


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats per (backend, N), then ratios to generate() at the same N; a full step's speed-up beside
    the Amdahl ceiling its rollout's speed-up predicts; the async row (`continuous-async`) beside synchronous CB at its
    N: ``overlap_s``, CB's rollout seconds minus what the async trainer still waited for its rollout, and
    ``step_vs_sync``, its step's speed-up over CB's (the two differ by what running decode and training at once costs
    each on shared hardware)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["N"]), []).append(r)
    points = []
    for (backend, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rs if r["status"] == "ok"]
        point: dict[str, Any] = {"backend": backend, "N": n, "repeats": len(rs),
                                 "status": "ok" if ok else rs[0]["status"]}
        for key in _MEDIANS:
            vals = [r[key] for r in ok if r.get(key) is not None]
            point[key] = statistics.median(vals) if vals else None
        if point["rollout_share"] is None and point["step_s"] and point["rollout_s"] is not None:
            point["rollout_share"] = point["rollout_s"] / point["step_s"]  # a full step written before the split
        if not ok:
            point["peak_mem_bytes"] = max((r["peak_mem_bytes"] or 0 for r in rs), default=None)
        for key in ("peak_mem_kind", "lengths"):
            point[key] = next((r.get(key) for r in rs if r.get(key)), None)
        for key in ("roof_bound", "roof_missing", "planned_phase"):  # the same every repeat
            point[key] = next((r.get(key) for r in ok if r.get(key)), None)
        points.append(point)
    by_key = {(p["backend"], p["N"]): p for p in points}
    for p in points:
        g = by_key.get(("generate", p["N"]))
        p["speed_vs_generate"] = _ratio(p["tokens_per_s"], g and g["tokens_per_s"])
        p["mem_vs_generate"] = _ratio(p["peak_mem_bytes"], g and g["peak_mem_bytes"])
        if p.get("step_s") is not None:  # a full step: the step's speed-up beside the one the rollout alone predicts
            p["step_speedup"] = _ratio(g and g["step_s"], p["step_s"])
            p["rollout_speedup"] = _ratio(g and g["rollout_s"], p["rollout_s"])
            p["amdahl_ceiling"] = (amdahl_ceiling(g["rollout_share"], p["rollout_speedup"])
                                   if g and g.get("rollout_share") is not None and p["rollout_speedup"] else None)
            p["of_ceiling"] = _ratio(p["step_speedup"], p["amdahl_ceiling"])
        if p.get("rollout_wall_s") is not None:  # async CB: against synchronous CB's step at the same N
            c = by_key.get(("continuous", p["N"]))
            sync = c if c and c["status"] == "ok" else None
            p["overlap_s"] = sync["rollout_s"] - p["rollout_s"] if sync and p["rollout_s"] is not None else None
            p["step_vs_sync"] = _ratio(sync and sync["step_s"], p["step_s"])
    return points


def amdahl_ceiling(rollout_share: float, rollout_speedup: float) -> float:
    """The step speed-up that speeding the rollout alone up by ``rollout_speedup`` gives, when the rollout is
    ``rollout_share`` of the reference step (Amdahl's law): 1 / ((1 - r) + r / s). A backend whose step beats it
    also sped up something besides the rollout; one that falls short pays for something outside the rollout."""
    if not 0 <= rollout_share <= 1 or rollout_speedup <= 0:
        raise ValueError(f"need a rollout share in [0, 1] and a positive speed-up, got {rollout_share}, "
                         f"{rollout_speedup}.")
    return 1 / ((1 - rollout_share) + rollout_share / rollout_speedup)


def _ratio(a, b) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    return read_results(path).runs
