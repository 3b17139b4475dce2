"""The sweep's results file: a header line with the configuration, then one JSONL line per run as it finishes.
`aggregate` turns runs into points (a backend's median at one N, with its ratios to generate() at that N), the
tables and the CSV show them; an empty cell is a number not measured, never a zero."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbkit.jsonl import append_jsonl, read_jsonl
from cbkit.measure.workload import parse_lengths


@dataclass
class Results:
    """A results file read: its configuration (the header's fingerprint), its runs and its matmul probes."""

    path: Path
    fingerprint: dict[str, Any]
    runs: list[dict[str, Any]]
    probes: list[dict[str, Any]]


def read_results(path: str | Path, *, repair: bool = False) -> Results:
    """A sweep results file, a torn last line dropped; a missing, empty or foreign file is an error."""
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
    """The sweep's JSONL for writing: a rerun resumes it, or refuses another configuration."""

    def __init__(self, path: str | Path, fingerprint: dict[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.runs: list[dict[str, Any]] = []
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl(self.path, {"kind": "header", "fingerprint": fingerprint})
            return
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

    def done(self, backend: str, n: int, repeat: int) -> bool:
        return any(r["backend"] == backend and r["N"] == n and r["repeat"] == repeat for r in self.runs)

    def add(self, run: dict[str, Any]) -> None:
        run = {"kind": "run", **run}
        append_jsonl(self.path, run)
        self.runs.append(run)


_MEDIANS = ("tokens_per_s", "rollout_s", "step_s", "train_s", "peak_mem_bytes", "kv_bytes", "kv_padding_share",
            "completion_tokens", "planned_peak_bytes", "plan_error", "length_mean", "length_cv", "length_max",
            "decode_padding_share", "mfu", "peak_flops", "peak_reserved_bytes", "device_used_bytes",
            "bytes_per_s", "roof_tokens_per_s", "roof_share", "old_logprob_s", "update_s", "other_s", "rollout_share")


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats per (backend, N), then ratios to generate() at the same N, and a full step's speed-up
    beside the Amdahl ceiling its rollout's speed-up predicts."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["N"]), []).append(r)
    points = []
    # by N, generate() first at each N: the reference the others' ratios are to
    for (backend, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != "generate", kv[0][0])):
        ok = [r for r in rs if r["status"] == "ok"]
        point: dict[str, Any] = {"backend": backend, "N": n, "repeats": len(rs),
                                 "status": "ok" if ok else rs[0]["status"]}
        for key in _MEDIANS:
            vals = [r[key] for r in ok if r.get(key) is not None]
            point[key] = statistics.median(vals) if vals else None
        if not ok:
            point["peak_mem_bytes"] = max((r["peak_mem_bytes"] or 0 for r in rs), default=None)
        for key in ("peak_mem_kind", "lengths", "roof_bound", "roof_missing"):  # the same every repeat
            point[key] = next((r.get(key) for r in rs if r.get(key)), None)
        points.append(point)
    by_key = {(p["backend"], p["N"]): p for p in points}
    for p in points:
        g = by_key.get(("generate", p["N"]))
        p["speed_vs_generate"] = _ratio(p["tokens_per_s"], g and g["tokens_per_s"])
        p["mem_vs_generate"] = _ratio(p["peak_mem_bytes"], g and g["peak_mem_bytes"])
        if p["step_s"] is not None:  # a full step: the step's speed-up beside the one the rollout alone predicts
            p["step_speedup"] = _ratio(g and g["step_s"], p["step_s"])
            speedup = _ratio(g and g["rollout_s"], p["rollout_s"])
            share = g["rollout_share"] if g else None
            p["amdahl_ceiling"] = amdahl_ceiling(share, speedup) if share is not None and speedup else None
            p["of_ceiling"] = _ratio(p["step_speedup"], p["amdahl_ceiling"])
    return points


def amdahl_ceiling(rollout_share: float, rollout_speedup: float) -> float:
    """Amdahl's law: the step speed-up from speeding up the rollout (``rollout_share`` of the step) alone."""
    if not 0 <= rollout_share <= 1 or rollout_speedup <= 0:
        raise ValueError(f"need a rollout share in [0, 1] and a positive speed-up, got {rollout_share}, "
                         f"{rollout_speedup}.")
    return 1 / ((1 - rollout_share) + rollout_share / rollout_speedup)


def _ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    return read_results(path).runs


def _f(v, fmt: str, unit: str = "") -> str:
    return "—" if v is None else format(v, fmt) + unit  # a number not measured: a dash, never a zero


def _table(head: list[str], rows: Iterable[list[str]]) -> str:
    """A markdown table with its columns padded to one width: it reads in a terminal and pastes into a doc."""
    cells = [head, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


def points_table(points: list[dict[str, Any]]) -> str:
    """Every point: speed, memory, its lengths (idle = a static batch's padding share), MFU, its roof (c = compute-,
    b = bandwidth-bound) and the share of it reached, the plan's error."""
    def row(p: dict[str, Any]) -> list[str]:
        mib = [p.get(k) and p[k] / 2**20 for k in ("peak_mem_bytes", "kv_bytes")]
        return [str(p["N"]), p["backend"], p["status"], _f(p["tokens_per_s"], ".1f"), _f(p["rollout_s"], ".1f"),
                _f(mib[0], ".0f"), _f(mib[1], ".1f"), _f(p.get("length_mean"), ".1f"), _f(p.get("length_cv"), ".2f"),
                _f(p.get("length_max"), ".0f"), _f(p.get("decode_padding_share"), ".2f"),
                _f(p["speed_vs_generate"], ".2f"), _f(p["mem_vs_generate"], ".2f"), _f(p.get("mfu"), ".1%"),
                _f(p.get("roof_tokens_per_s"), ".0f", f" {(p.get('roof_bound') or '?')[0]}"),
                _f(p.get("roof_share"), ".1%"), _f(p.get("plan_error"), "+.0%")]

    return _table(["N", "backend", "status", "tok/s", "rollout s", "peak MiB", "KV MiB", "len", "CV", "max", "idle",
                   "speed x", "mem x", "MFU", "roof", "of roof", "plan err"], map(row, points))


def step_split_table(points: list[dict[str, Any]]) -> str:
    """A full step (`--full-step`): each phase's seconds, and its speed-up over generate() beside the Amdahl ceiling."""
    def row(p: dict[str, Any]) -> list[str]:
        if p["status"] != "ok":
            return [str(p["N"]), p["backend"], p["status"].upper(), *["—"] * 8]
        return [str(p["N"]), p["backend"], _f(p.get("step_s"), ".2f"),
                f"{_f(p.get('rollout_s'), '.2f')} ({_f(p.get('roof_share'), '.0%')})",
                *[_f(p.get(k), ".2f") for k in ("old_logprob_s", "update_s", "other_s")],
                _f(p.get("rollout_share"), ".0%"), _f(p.get("step_speedup"), ".2f", "x"),
                _f(p.get("amdahl_ceiling"), ".2f", "x"), _f(p.get("of_ceiling"), ".0%")]

    return _table(["N", "backend", "step s", "rollout s (of roof)", "old-logprob fwd s", "update s", "other s",
                   "rollout share", "step speed-up", "Amdahl ceiling", "of ceiling"],
                  map(row, points))


def memory_table(points: list[dict[str, Any]]) -> str:
    """The planner's prediction beside every memory counter measured, per point, in GiB."""
    def row(p: dict[str, Any]) -> list[str]:
        gib = [_f(p.get(k) and p[k] / 2**30, ".2f") for k in ("planned_peak_bytes", "peak_mem_bytes",
                                                              "peak_reserved_bytes", "device_used_bytes")]
        return [str(p["N"]), p["backend"], *gib[:2], _f(p.get("plan_error"), "+.0%"), *gib[2:]]

    return _table(["N", "backend", "planned peak", "allocated peak", "plan error", "reserved peak", "device used"],
                  map(row, points))


def report_tables(points: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The tables a sweep prints and its HTML report shows, each with its title, those the points have data for."""
    tables = [("Points", points_table(points))]
    if any(p.get("step_s") is not None for p in points):
        tables.append(("One GRPO step split by phase; (of roof) = the rollout's share of its roof on this run's probe; "
                       "Amdahl ceiling = the step speed-up the rollout's speed-up alone predicts",
                       step_split_table(points)))
    if any(p.get("peak_reserved_bytes") is not None for p in points):
        tables.append(("Memory (GiB): the planner's prediction beside the measured peaks", memory_table(points)))
    return tables


def results_summary(results: Results | str | Path) -> str:
    """What a results file ran: its length workload, and the range each roof's probes read (or why one is missing)."""
    results = results if isinstance(results, Results) else read_results(results)
    fp = results.fingerprint
    out = [parse_lengths(fp.get("lengths") or "natural").describe(fp.get("max_new_tokens", 0))]
    for key, unit, what in (("peak_flops", "GFLOP/s", "matmul probe"), ("bytes_per_s", "GB/s", "read bandwidth")):
        vals = [p[key] / 1e9 for p in results.probes if p.get(key)]
        failed = sorted({p["probe_missing"][key] for p in results.probes if key in (p.get("probe_missing") or {})})
        if vals:
            out.append(f"{what}: {len(vals)} probe(s), {min(vals):.2f}-{max(vals):.2f} {unit}")
        if failed:
            out.append(f"{what}: missing ({'; '.join(failed)}); its columns stay empty")
    return "\n".join(out)
