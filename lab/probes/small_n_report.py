"""lab/small_n.md's tables, printed from the sweeps' results files (nothing typed by hand).

For each results file: what ran and the probes (`results_summary`), then one row per N with CB (caller's-thread
loop, the default on CPU) and CB on transformers' thread against generate(), the caller/thread ratio measured in
the same process, CB's peak memory against generate()'s, and the repeats behind each median; then every backend
against the roofline of its shape.
Usage: python lab/probes/small_n_report.py lab/results/small-n-fixed.jsonl lab/results/small-n-replay.jsonl
"""
# Runs against cbkit as of commit e0f16eb (`git worktree add /tmp/at-e0f16eb e0f16eb`): the names it imports left the
# package after this probe was run; its result stays in lab/ with the command that made it.

from __future__ import annotations

import sys

from cbkit.measure.tables import results_summary, roof_table

from cbkit.measure.results import aggregate, read_results


def ratio_table(points) -> str:
    by = {(p["backend"], p["N"]): p for p in points}
    rows = ["| N | CB vs generate | CB on the thread vs generate | CB caller / thread | CB peak memory vs generate "
            "| repeats (gen, CB, thread) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for n in sorted({p["N"] for p in points}):
        g, c, t = (by.get((b, n)) for b in ("generate", "continuous", "continuous-thread"))

        def x(p):
            return f"{p['speed_vs_generate']:.2f}x" if p and p.get("speed_vs_generate") is not None else "—"

        ct = (f"{c['tokens_per_s'] / t['tokens_per_s']:.2f}x" if c and t and c.get("tokens_per_s")
              and t.get("tokens_per_s") else "—")
        reps = ", ".join(str(p["repeats"]) if p else "0" for p in (g, c, t))
        mem = f"{c['mem_vs_generate']:.2f}x" if c and c.get("mem_vs_generate") is not None else "—"
        rows.append(f"| {n} | {x(c)} | {x(t)} | {ct} | {mem} | {reps} |")
    return "\n".join(rows)


def main() -> None:
    for path in sys.argv[1:]:
        results = read_results(path)
        points = aggregate(results.runs)
        print(f"### `{path}`\n")
        print("```\n" + results_summary(results) + "\n```\n")
        print(ratio_table(points) + "\n")
        print(roof_table(points) + "\n")


if __name__ == "__main__":
    main()
