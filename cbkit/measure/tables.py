"""A sweep's points as text tables and CSV. An empty cell is a number not measured, never a zero."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cbkit.measure.results import Results, read_results
from cbkit.measure.workload import parse_lengths


def _f(v, fmt: str, unit: str = "", empty: str = "—") -> str:
    return format(v, fmt) + unit if v is not None else empty


def points_table(points: list[dict[str, Any]]) -> str:
    """Every point: speed, memory, its lengths (idle = a static batch's padding share), MFU, its roof (c = compute-,
    b = bandwidth-bound) and the share of it reached, the plan's error."""
    head = (f"{'N':>4} {'backend':<17} {'status':<6} {'tok/s':>8} {'rollout s':>9} {'peak MiB':>9} {'KV MiB':>8} "
            f"{'len':>6} {'CV':>5} {'max':>4} {'idle':>5} {'speed x':>7} {'mem x':>6} {'MFU':>6} {'roof':>7} "
            f"{'of roof':>7} {'plan err':>8}")
    lines = [head, "-" * len(head)]
    for p in points:
        mib = {k: p.get(k) and p[k] / 2**20 for k in ("peak_mem_bytes", "kv_bytes")}
        roof = "-" if p.get("roof_tokens_per_s") is None else \
            f"{p['roof_tokens_per_s']:.0f} {(p.get('roof_bound') or '?')[0]}"
        cells = [(p["tokens_per_s"], "8.1f"), (p["rollout_s"], "9.1f"), (mib["peak_mem_bytes"], "9.0f"),
                 (mib["kv_bytes"], "8.1f"), (p.get("length_mean"), "6.1f"), (p.get("length_cv"), "5.2f"),
                 (p.get("length_max"), "4.0f"), (p.get("decode_padding_share"), "5.2f"),
                 (p["speed_vs_generate"], "7.2f"), (p["mem_vs_generate"], "6.2f"), (p.get("mfu"), "6.1%")]
        widths = [8, 9, 9, 8, 6, 5, 4, 5, 7, 6, 6]
        lines.append(f"{p['N']:>4} {p['backend']:<17} {p['status']:<6} "
                     + " ".join(f"{_f(v, fmt, empty='-'):>{w}}" for (v, fmt), w in zip(cells, widths, strict=True))
                     + f" {roof:>7} {_f(p.get('roof_share'), '7.1%', empty='-'):>7} "
                     f"{_f(p.get('plan_error'), '+8.0%', empty='-'):>8}")
    return "\n".join(lines)


def step_split_table(points: list[dict[str, Any]]) -> str:
    """A full GRPO step per backend and N (`--full-step`): each phase's seconds, the rollout's share, the step's
    speed-up over generate() beside its Amdahl ceiling."""
    rows = ["| N | backend | step s | rollout s (of roof) | old-logprob fwd s | update s | other s | rollout share "
            "| step speed-up | Amdahl ceiling | of ceiling |", "|" + " --- |" * 11]
    for p in sorted(points, key=lambda p: (p["N"], p["backend"] != "generate", p["backend"])):
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['backend']} | {p['status'].upper()} |" + " — |" * 8)
            continue
        rows.append(f"| {p['N']} | {p['backend']} | {_f(p.get('step_s'), '.2f')} | {_f(p.get('rollout_s'), '.2f')} "
                    f"({_f(p.get('roof_share'), '.0%')}) | {_f(p.get('old_logprob_s'), '.2f')} | "
                    f"{_f(p.get('update_s'), '.2f')} | {_f(p.get('other_s'), '.2f')} | "
                    f"{_f(p.get('rollout_share'), '.0%')} | {_f(p.get('step_speedup'), '.2f', 'x')} | "
                    f"{_f(p.get('amdahl_ceiling'), '.2f', 'x')} | {_f(p.get('of_ceiling'), '.0%')} |")
    return "\n".join(rows)


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


def write_csv(points: list[dict[str, Any]], path: str | Path) -> None:
    import csv

    keys = list(dict.fromkeys(k for p in points for k in p))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(points)


def memory_table(points: list[dict[str, Any]]) -> str:
    """The planner's prediction beside every memory counter measured, per point, in GiB."""
    rows = ["| N | backend | planned peak | allocated peak | plan error | reserved peak | device used |",
            "|" + " --- |" * 7]
    for p in points:
        gib = [_f(p.get(k) and p[k] / 2**30, ".2f") for k in ("planned_peak_bytes", "peak_mem_bytes",
                                                              "peak_reserved_bytes", "device_used_bytes")]
        rows.append(f"| {p['N']} | {p['backend']} | {gib[0]} | {gib[1]} | {_f(p.get('plan_error'), '+.0%')} | "
                    f"{gib[2]} | {gib[3]} |")
    return "\n".join(rows)
