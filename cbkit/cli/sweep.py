"""`cbkit sweep` and `cbkit report`: the N-sweep, and what it prints at its end, printed again from its results
file: the tables, the CSV and the plotly HTML report."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from csv import DictWriter
from pathlib import Path

from cbkit.cli.flags import dataclass_flags, given_fields


def _sweep(args: argparse.Namespace) -> int:
    from cbkit.measure.sweep import run_sweep
    from cbkit.measure.sweep_config import DRY_RUN, PRESETS, SweepConfig, check_preset_device
    from cbkit.models.synthetic import RANDOM_SHAPES, RANDOM_WEIGHTS_NOTE

    if args.dry_run and not args.preset:
        raise ValueError("--dry-run runs a preset at test size on CPU: give --preset too (e.g. --preset trl-benchmark).")
    if args.preset and not args.dry_run:  # before any model is loaded; a dry run runs on this CPU
        check_preset_device(args.preset, dtype=getattr(args, "dtype", None))
    fields = {**(PRESETS[args.preset] if args.preset else {}), **(DRY_RUN if args.dry_run else {}),
              **given_fields(args, SweepConfig)}
    cfg = SweepConfig(**fields)
    out = Path(args.out)
    if cfg.model in RANDOM_SHAPES:
        print(f"model {cfg.model}: {RANDOM_WEIGHTS_NOTE}")
    print(cfg.workload.describe(cfg.max_new_tokens))
    live = None
    if not args.no_live and has_plotly():
        from cbkit.viz.live import LiveChart

        live = LiveChart("N-sweep: completion tokens/s", x_title="N")

    def on_run(run: dict) -> None:
        if live is not None and run["status"] == "ok":
            live.add(run["backend"], run["N"], run["tokens_per_s"])

    try:
        points = run_sweep(cfg, out, on_point=on_run)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished runs are kept in {out}; rerun the same command to resume.", file=sys.stderr)
        return 130
    finally:
        if live is not None:
            live.close()
    _print_results(points, out, cfg.fingerprint())
    return 0


def _print_results(points, out: Path, fingerprint: dict) -> None:
    """What a sweep prints at its end and `cbkit report` again: the tables, then the CSV and the HTML report."""
    from cbkit.measure import results

    print(results.results_summary(out))
    print("\n\n".join(f"{title}\n{table}" for title, table in results.report_tables(points)))
    csv = out.with_suffix(".csv")
    with open(csv, "w", newline="") as f:
        table = DictWriter(f, fieldnames=list(dict.fromkeys(k for p in points for k in p)))
        table.writeheader()
        table.writerows(points)
    if not has_plotly():  # a bare GPU box still gets the JSONL, the CSV and the tables
        print(f"results: {out} (JSONL), {csv} (CSV). No HTML report: it needs plotly (pip install plotly); "
              f"run `cbkit report {out}` on a machine that has it.")
        return
    from cbkit.viz.figures import write_report

    html = out.with_suffix(".html")
    write_report(points, html, fingerprint)
    print(f"results: {out} (JSONL), {csv} (CSV), {html} (plotly report)")


def has_plotly() -> bool:
    return importlib.util.find_spec("plotly") is not None


def _report(args: argparse.Namespace) -> int:
    from cbkit.measure.results import aggregate, read_results

    results = read_results(args.results)
    _print_results(aggregate(results.runs), Path(args.results), results.fingerprint)
    return 0


def add_sweep(sub: argparse._SubParsersAction) -> None:
    from cbkit.measure.sweep_config import SweepConfig

    sweep = sub.add_parser(
        "sweep", parents=[dataclass_flags(SweepConfig)],
        help="the N-sweep: both backends side by side at growing N (the main job)",
        description="Every SweepConfig field is a flag. Lists take commas or spaces (--ns 8,16,32), dicts JSON.",
    )
    sweep.add_argument("--preset", choices=["trl-benchmark"], default=None,
                       help="TRL PR #5765's setting on one GPU (Llama-3.2-1B's shape, random weights, no download); "
                            "flags given explicitly override it")
    sweep.add_argument("--dry-run", action="store_true",
                       help="run the preset at test size on CPU: proves a GPU script end to end without a GPU")
    sweep.add_argument("--out", default="runs/sweep.jsonl", help="results JSONL (appended; a rerun resumes)")
    sweep.add_argument("--no-live", action="store_true", help="no live chart")
    sweep.set_defaults(func=_sweep)

    report = sub.add_parser("report", help="table, CSV and plotly HTML from a sweep results file")
    report.add_argument("results", help="the sweep's JSONL")
    report.set_defaults(func=_report)
