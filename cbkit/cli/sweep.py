"""`cbkit sweep` and `cbkit report`: the N-sweep, and what it prints at its end, printed again from its results
file: the tables, the CSV and the plotly HTML report."""

from __future__ import annotations

import argparse
import sys

from cbkit.cli.flags import dataclass_flags, given_fields


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cbkit.measure.presets import DRY_RUN, PRESETS, check_preset_device
    from cbkit.measure.sweep import run_sweep
    from cbkit.measure.sweep_config import SweepConfig

    if args.dry_run and not args.preset:
        raise ValueError("--dry-run runs a preset at test size on CPU: give --preset too (e.g. --preset trl-benchmark).")
    if args.preset:
        check_preset_device(args.preset, dry_run=args.dry_run, dtype=getattr(args, "dtype", None))  # before any model is loaded
    fields = dict(PRESETS[args.preset]) if args.preset else {}
    if args.dry_run:
        fields.update(DRY_RUN)
    fields.update(given_fields(args, SweepConfig))
    cfg = SweepConfig(**fields)
    out = Path(args.out)
    _random_weights_note(cfg.model)
    print(cfg.workload.describe(cfg.max_new_tokens))
    live = None
    if not args.no_live and has_plotly():
        from cbkit.viz.live import LiveChart

        live = LiveChart("N-sweep: completion tokens/s", x_title="N")

    def on_run(run: dict) -> None:
        if live is not None and run["status"] == "ok":
            live.add(f"{run['backend']}", run["N"], run["tokens_per_s"])

    try:
        points = run_sweep(cfg, out, on_point=on_run)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished runs are kept in {out}; rerun the same command to resume.", file=sys.stderr)
        return 130
    finally:
        if live is not None:
            live.close()
    _print_results(points, out, cfg.fingerprint(), estimate=True, force_gpu_tables=args.preset == "trl-benchmark")
    return 0


def _print_results(points, out, fingerprint: dict, *, estimate: bool = False, force_gpu_tables: bool = False) -> None:
    """What a sweep prints at its end and `cbkit report` prints again from its file, in one order: what ran, the
    points, TRL's benchmark table, then a full-step sweep's split by phase (with ``estimate``, the same steps on
    GPUs, which reads the model's config); the CSV, the GPU tables, the HTML report."""
    from cbkit.measure.tables import (
        points_table,
        results_summary,
        step_split_table,
        trl_benchmark_table,
        write_csv,
    )

    print(results_summary(out))
    print(points_table(points))
    print()
    print(trl_benchmark_table(points))
    print()
    if any(p.get("step_s") is not None for p in points):
        print("One GRPO step split by phase; (of roof) = the phase's roof seconds on this run's probe over its "
              "seconds; Amdahl ceiling = the step speed-up the rollout's speed-up alone predicts")
        print(step_split_table(points))
        if estimate:
            _estimated_split(out, fingerprint["model"])
    write_csv(points, out.with_suffix(".csv"))
    _gpu_tables(points, fingerprint.get("model"), force=force_gpu_tables)
    _finish_report(points, out, fingerprint)


def _estimated_split(out, model: str) -> None:
    """Below a full-step sweep: the same steps (this model, these prompts, the lengths each N ran with) on a T4 and
    an A100, estimated from the roofline's assumptions and printed as such."""
    from cbkit.measure.results import read_results
    from cbkit.measure.tables import estimated_step_table
    from cbkit.models.load import load_config

    runs = [r for r in read_results(out).runs if r.get("status") == "ok" and r.get("prompt_lens")
            and r.get("completion_lengths")]
    if not runs:
        return
    lengths = {r["N"]: r["completion_lengths"] for r in runs if r["backend"] == "generate"}
    print("\nThe same steps on GPUs: an ESTIMATE from the roofline's assumptions (cbkit/measure/roofline.py: "
          "DECODE_EFFICIENCY, TRAIN_EFFICIENCY, the launch floor), not a measurement")
    print(estimated_step_table(load_config(model), prompt_lens=runs[0]["prompt_lens"], lengths_by_n=lengths))


def _random_weights_note(model: str) -> None:
    from cbkit.models.synthetic import RANDOM_SHAPES, RANDOM_WEIGHTS_NOTE

    if model in RANDOM_SHAPES:
        print(f"model {model}: {RANDOM_WEIGHTS_NOTE}")


def _gpu_tables(points, model: str | None, *, force: bool = False) -> None:
    """On a GPU run (or the trl-benchmark preset's dry run): every memory counter beside the planner, and TRL PR
    #5765's table beside this run's."""
    from cbkit.measure.tables import memory_table, trl_comparison_table

    if not force and not any(p.get("peak_reserved_bytes") is not None for p in points):
        return
    print("\nMemory (GiB): the planner's prediction beside the measured peaks")
    print(memory_table(points))
    print("\nThis run beside TRL PR #5765 (A100-80GB, Llama-3.2-1B-Instruct, GSM8K, up to 2048 new tokens)")
    print(trl_comparison_table(points))
    from cbkit.models.synthetic import RANDOM_SHAPES, RANDOM_WEIGHTS_NOTE

    if model in RANDOM_SHAPES:
        print(f"({model}: {RANDOM_WEIGHTS_NOTE}.)")


def has_plotly() -> bool:
    import importlib.util

    return importlib.util.find_spec("plotly") is not None


def _finish_report(points, out, meta) -> None:
    """The HTML report needs plotly; a machine without it (a bare GPU box) still gets the JSONL, the CSV and
    the tables, and renders the HTML later with `cbkit report` where plotly is installed."""
    csv = out.with_suffix(".csv")
    if not has_plotly():
        print(f"results: {out} (JSONL), {csv} (CSV). No HTML report: it needs plotly (pip install plotly); "
              f"run `cbkit report {out}` on a machine that has it.")
        return
    from cbkit.viz.figures import write_report

    html = out.with_suffix(".html")
    write_report(points, html, meta)
    print(f"results: {out} (JSONL), {csv} (CSV), {html} (plotly report)")


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cbkit.measure.results import aggregate, read_results

    out = Path(args.results)
    results = read_results(out)
    _print_results(aggregate(results.runs), out, results.fingerprint)
    return 0


def add_sweep(sub: argparse._SubParsersAction) -> None:
    """`cbkit sweep`, every `SweepConfig` field a flag, plus the GPU presets and their dry run."""
    from cbkit.measure.sweep_config import SweepConfig

    sweep = sub.add_parser(
        "sweep", parents=[dataclass_flags(SweepConfig)],
        help="the N-sweep: both backends side by side at growing N (the main job)",
        description="Every SweepConfig field is a flag. Lists take commas or spaces (--ns 8,16,32), dicts JSON.",
    )
    sweep.add_argument("--preset", choices=["trl-benchmark", "a100", "t4"], default=None,
                       help="sizes for one GPU: trl-benchmark (TRL PR #5765's setting: Llama-3.2-1B's shape, random "
                            "weights, no download; scripts/gpu_check.sh), a100 / t4 (hub models); flags given "
                            "explicitly override it")
    sweep.add_argument("--dry-run", action="store_true",
                       help="run the preset at test size on CPU (a tiny model of the same family, N=2,4, 8 "
                            "tokens): proves a GPU script end to end without a GPU")
    sweep.add_argument("--out", default="runs/sweep.jsonl", help="results JSONL (appended; a rerun resumes)")
    sweep.add_argument("--no-live", action="store_true", help="no live chart")
    sweep.set_defaults(func=_sweep)


def add_report(sub: argparse._SubParsersAction) -> None:
    """`cbkit report`: a sweep's tables, CSV and HTML again, from its JSONL."""
    report = sub.add_parser("report", help="table, CSV and plotly HTML from a sweep results file")
    report.add_argument("results", help="the sweep's JSONL")
    report.set_defaults(func=_report)
