"""`cbkit <command>`: the kit's entry points. Each command is a function taking parsed args, easy to add to.

`train`, `sweep`, `demo` and `advise` take one flag per field of their config dataclass (`CBGRPOConfig`,
`SweepConfig`, `DemoConfig`, `AdviseConfig`), made by transformers' `HfArgumentParser`, the parser TRL's scripts
use: typed from the annotation, help from the field's metadata, both `--num_generations` and `--num-generations`
(and a field's `aliases`, such as `-N`), booleans as `--flag [true|false]` plus `--no-flag` where the default is
True. A field added to a dataclass is a flag without touching this file; a field without a default is a required
flag.
`cbkit train --config recipe.yaml` reads a run from a YAML file of `CBGRPOConfig` fields, the way TRL's
`TrlParser` reads `--config`; flags given next to it win. (TRL itself is not imported: a bare GPU image has
transformers but not trl.) What `HfArgumentParser` cannot express is adapted in `_given_flags_only`, each
reason beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from cbkit.teach.demo import DemoConfig, format_table, run_demo

    cfg = DemoConfig(**given_fields(args, DemoConfig))
    results = run_demo(**dataclasses.asdict(cfg))
    print(f"\n{cfg.num_prompts} prompts x N={cfg.num_generations}, max_new_tokens={cfg.max_new_tokens}, "
          f"model={cfg.model}, data={cfg.data}")
    print("peak memory: CPU RSS above the post-load baseline (indicative); CUDA max_memory_allocated on a GPU")
    print(format_table(results))
    return 0


def _train(args: argparse.Namespace) -> int:
    from cbkit.train import checkpoint
    from cbkit.train.grpo import GRPOTrainer

    config = train_config_from_args(args)
    if not config.output_dir:
        raise ValueError("cbkit train needs --output-dir (metrics.jsonl and checkpoints go there), on the command "
                         "line or in the --config recipe.")
    trainer = GRPOTrainer(config)
    try:
        state = trainer.train(resume_from=args.resume or None)
    except KeyboardInterrupt:
        last = checkpoint.latest_checkpoint(config.output_dir)
        print(f"\ninterrupted after step {trainer.state.step}; last checkpoint: {last}. "
              f"Continue with: cbkit train --output-dir {config.output_dir} --resume", file=sys.stderr)
        return 130
    print(f"trained {state.step} steps; metrics: {config.output_dir}/metrics.jsonl; "
          f"checkpoint: {checkpoint.latest_checkpoint(config.output_dir)}")
    return 0


def train_config_from_args(args: argparse.Namespace):
    """Layers, later ones winning: the config's defaults, the checkpoint's config (`--resume`), the recipe
    (`--config`), the flags given. Resuming then checks the result against the checkpoint."""
    from cbkit.train import checkpoint
    from cbkit.train.config import CBGRPOConfig, read_recipe

    values = read_recipe(args.config) if args.config else {}
    values.update(given_fields(args, CBGRPOConfig))
    if args.resume:
        out = values.get("output_dir") or ""
        path = args.resume if args.resume is not True else checkpoint.latest_checkpoint(out)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint-<step> directory in {out!r}.")
        values = {**checkpoint.read_config(path).to_dict(), **values}
    return CBGRPOConfig.from_dict(values)


def given_fields(args: argparse.Namespace, dtype: type) -> dict[str, Any]:
    """The fields of `dtype` that were given as flags, as the dataclass takes them."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(dtype) if f.name in vars(args)}


def dataclass_flags(dtype: type) -> argparse.ArgumentParser:
    """One flag per field of `dtype`, made by `HfArgumentParser` and adapted by `_given_flags_only`: a parent
    parser for `add_parser(..., parents=[...])`, argparse's own way of sharing arguments."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dtype, add_help=False)
    _given_flags_only(parser, dtype)
    return parser


def _given_flags_only(parser: argparse.ArgumentParser, dtype: type) -> None:
    """What `HfArgumentParser` cannot express, fixed on the flags it made:

    * Defaults. It fills every field's default into the namespace, so a flag left out is indistinguishable
      from one given with the default value. cbkit layers a resumed checkpoint's config and a recipe under the
      flags, so only the flags given may override them: the defaults become `SUPPRESS` (the help still
      shows them).
    * `none` for an Optional field: argparse calls the inner type (`float("none")` fails), so an Optional
      with a non-None default (e.g. `system_prompt`) could not be set back to None from the command line.
    * dict fields take JSON: `HfArgumentParser` passes `dict[str, Any]` itself as the type, which cannot parse.
    * list and tuple fields take comma-separated values too (`--ns 8,16,32`, the syntax cbkit's scripts and
      README use) as well as space-separated ones; `HfArgumentParser` has no tuple support.
    """
    hints = typing.get_type_hints(dtype)
    fields = {f.name: f for f in dataclasses.fields(dtype)}
    for action in parser._actions:
        f = fields.get(action.dest)
        if f is None:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else f.default if f.default is not dataclasses.MISSING else f.default_factory()
        action.default, action.required = argparse.SUPPRESS, required and not isinstance(action,
                                                                                         argparse._StoreFalseAction)
        if isinstance(action, argparse._StoreFalseAction):  # the --no-<flag> twin of a boolean
            continue
        text = f.metadata.get("help") or f"{dtype.__name__}.{f.name}"
        action.help = (text if required else f"{text} (default: {default!r})").replace("%", "%%")
        base, optional = _strip_optional(hints[f.name])
        flag = action.option_strings[-1]
        if typing.get_origin(base) is dict:
            action.type = _json_value(flag)
        elif _collection(base):
            action.type, action.nargs = _comma_list(typing.get_args(base)[0], flag), "+"
            action.__class__ = _ListFlag  # was a plain store action: store the words' lists as one list
        if optional:
            action.type = _or_none(action.type)


class _ListFlag(argparse._StoreAction):
    """A list flag whose words may each hold a comma-separated list: `--ns 8,16 32` is [8, 16, 32]; `none`
    (an Optional list) is None."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, None if None in values else [x for part in values for x in part])


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def _collection(hint: Any) -> bool:
    return typing.get_origin(hint) in (list, tuple)


def _named(fn, name: str):
    fn.__name__ = name  # argparse names the type in "invalid <name> value" errors
    return fn


def _json_value(flag: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} is not valid JSON ({e.msg}): {text!r}. Example: {flag} "
                                             "'{\"page_size\": 32, \"num_blocks\": 256}'") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object of settings ({{...}}), got {text!r}.")
        return value

    return _named(parse, "JSON")


def _comma_list(item: type, flag: str):
    def parse(text: str) -> list:
        try:
            return [item(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            kind = "integers like 8,16,32,64" if item is int else f"{item.__name__} values"
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated {kind}; got {text!r}.") from None

    return _named(parse, f"{item.__name__} list")


def _or_none(parse):
    def convert(text: str):
        return None if text.lower() == "none" else parse(text)

    return _named(convert, getattr(parse, "__name__", "value"))


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cbkit.measure.sweep import DRY_RUN, PRESETS, SweepConfig, check_preset_device, run_sweep

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
    if not args.no_live and _has_plotly():
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
    GPUs, which reads the model's config) or the roofline shares; the CSV, the GPU tables, the HTML report."""
    from cbkit.measure.tables import (
        points_table,
        results_summary,
        roof_table,
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
    else:
        print(roof_table(points))
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
    """The planner's peak term by term beside each measured peak; on a GPU run (or the trl-benchmark preset's dry
    run) also every memory counter beside the planner, and TRL PR #5765's table beside this run's."""
    from cbkit.measure.tables import memory_table, plan_terms_table, trl_comparison_table

    terms = plan_terms_table(points)
    if terms is not None:
        print("\nThe planned peak, term by term, beside the measured peak (MiB)")
        print(terms)
    if not force and not any(p.get("peak_reserved_bytes") is not None for p in points):
        return
    print("\nMemory (GiB): the planner's prediction beside the measured peaks")
    print(memory_table(points))
    print("\nThis run beside TRL PR #5765 (A100-80GB, Llama-3.2-1B-Instruct, GSM8K, up to 2048 new tokens)")
    print(trl_comparison_table(points))
    from cbkit.models.synthetic import RANDOM_SHAPES, RANDOM_WEIGHTS_NOTE

    if model in RANDOM_SHAPES:
        print(f"({model}: {RANDOM_WEIGHTS_NOTE}.)")


def _has_plotly() -> bool:
    import importlib.util

    return importlib.util.find_spec("plotly") is not None


def _finish_report(points, out, meta) -> None:
    """The HTML report needs plotly; a machine without it (a bare GPU box) still gets the JSONL, the CSV and
    the tables, and renders the HTML later with `cbkit report` where plotly is installed."""
    csv = out.with_suffix(".csv")
    if not _has_plotly():
        print(f"results: {out} (JSONL), {csv} (CSV). No HTML report: it needs plotly (pip install plotly); "
              f"run `cbkit report {out}` on a machine that has it.")
        return
    from cbkit.viz.figures import write_report

    html = out.with_suffix(".html")
    write_report(points, html, meta)
    print(f"results: {out} (JSONL), {csv} (CSV), {html} (plotly report)")


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not _has_plotly():
        raise ModuleNotFoundError("cbkit plot draws with plotly: pip install plotly.")
    from cbkit.viz.training import read_metrics, reward_curve

    path = Path(args.metrics)
    if not path.is_file():
        raise FileNotFoundError(f"No metrics file at {path}; `cbkit train --output-dir DIR` writes DIR/metrics.jsonl.")
    rows = read_metrics(path)
    keys = [k for k in args.keys.split(",") if k]
    absent = [k for k in keys if not any(k in r for r in rows)]
    if len(absent) == len(keys):
        raise ValueError(f"None of {keys} is in {path}; it has e.g. {sorted(rows[0])[:8]}. Choose --keys from those.")
    out = Path(args.out) if args.out else path.with_name("reward.html")
    fig = reward_curve(rows, keys, title=f"Reward per step: {path}")
    fig.write_html(out, include_plotlyjs=True)  # plotly.js embedded: the file opens offline
    said = []
    for k in keys:  # each metric's first and last measured value (eval/* only exists on the steps that evaluated)
        have = [r for r in rows if isinstance(r.get(k), int | float)]
        if have:
            said.append(f"{k} {have[0][k]:.3f} -> {have[-1][k]:.3f} (step {have[0]['step']} -> {have[-1]['step']})")
    trained = sum(r["step"] > 0 for r in rows)
    print(f"{trained} steps: {', '.join(said)}; figure: {out}")
    if args.png:  # the same figure as a static image (a README, a slide), drawn by the installed Chromium
        from cbkit.viz.static import figure_pngs

        Path(args.png).write_bytes(figure_pngs([fig])[0])
        print(f"image: {args.png}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cbkit.measure.results import aggregate, read_results

    out = Path(args.results)
    results = read_results(out)
    _print_results(aggregate(results.runs), out, results.fingerprint)
    return 0


def _advise(args: argparse.Namespace) -> int:
    from cbkit.measure.advise import AdviseConfig, measured_from_sweep, recommend
    from cbkit.measure.planner import crossover_n, plan
    from cbkit.models.load import load_config

    a = AdviseConfig(**given_fields(args, AdviseConfig))
    sizes = dict(num_prompts=a.num_prompts, prompt_len=a.prompt_len, max_new_tokens=a.max_new_tokens,
                 mean_completion_len=a.mean_completion_len, dtype_bytes=a.dtype_bytes, budget_bytes=a.budget_bytes,
                 device=a.device)
    measured = measured_from_sweep(a.results_from, a.num_generations) if a.results_from else None
    config = load_config(a.model)
    memory = plan(config, num_generations=a.num_generations, model_name=a.model, **sizes)
    cross = crossover_n(config, max_n=max(1024, 4 * a.num_generations), **sizes)
    advice = recommend(a.num_generations, completion_cv=a.completion_cv, mean_completion_len=a.mean_completion_len,
                       max_new_tokens=a.max_new_tokens, multimodal=a.multimodal,
                       need_max_throughput=a.max_throughput, num_gpus=a.gpus, tensor_parallel=a.tensor_parallel,
                       memory=memory if a.budget_bytes is not None else None, measured=measured)
    print("Predicted peak memory above the weights, one rollout:")
    print(memory.summary())
    print(f"crossover: CB's predicted peak is below generate()'s from N={cross}" if cross is not None
          else "crossover: CB's predicted peak stays above generate()'s for every N up to "
               f"{max(1024, 4 * a.num_generations)}")
    print(f"\nAdvice: {advice}")
    return 0


def _tiers(args: argparse.Namespace) -> int:
    from cbkit.teach.tiers import MACHINES, NOTEBOOKS, plan_all, plan_presets, plan_recipes, tiers_report

    def names(value: str | None, valid, what: str) -> list[str] | None:
        if not value:
            return None
        chosen = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in valid]
        if unknown:
            raise ValueError(f"unknown {what} {unknown}; choose from {', '.join(valid)}.")
        return chosen

    plans = plan_all(names(args.notebooks, list(NOTEBOOKS), "notebook(s)"), names(args.gpus, list(MACHINES), "GPU(s)"))
    print(tiers_report(plans))
    failed = [p for p in plans if not p.ok]
    print(f"\n{len(plans) - len(failed)} of {len(plans)} notebook x GPU plans fit, finish within budget and show "
          "their phenomenon" + ("." if not failed else f"; {len(failed)} do not (above)."))
    if not args.notebooks:  # the learning recipe on the same GPUs: its CB and generate() runs with evaluations
        recipes = plan_recipes(names(args.gpus, list(MACHINES), "GPU(s)"))
        print("\nThe learning recipe (recipes/smollm2_arith.yaml) on the GPU tiers: one CB run with its held-out "
              "evaluations. AN ESTIMATE: no GPU has run it; the GPU model needs its difficulty measured "
              "first (docs/learning.md).\n" + "\n".join(p.line() for p in recipes))
        for p in recipes:
            for problem in p.problems():
                print(f"  {p.notebook} on {p.machine}: {problem}")
        failed += [p for p in recipes if not (p.fits and p.admitted)]
        presets = plan_presets()
        print("\nThe sweep's GPU presets (cbkit sweep --preset), the largest point on the smallest GPU each is for, "
              "with transformers' own admission check:\n" + "\n".join(p.line() for p in presets))
        failed += [p for p in presets if not p.ok]
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from cbkit.teach.demo import DemoConfig

    demo = sub.add_parser("demo", parents=[dataclass_flags(DemoConfig)],
                          help="one GRPO-shaped rollout through each backend, side by side",
                          description="Every DemoConfig field is a flag; those the training run also has carry "
                                      "CBGRPOConfig's help.")
    demo.set_defaults(func=_demo)

    from cbkit.measure.sweep import SweepConfig

    sweep = sub.add_parser(
        "sweep", parents=[dataclass_flags(SweepConfig)],
        help="the N-sweep: both backends side by side at growing N (the main job)",
        description="Every SweepConfig field is a flag. Lists take commas or spaces (--ns 8,16,32), dicts JSON.",
    )
    sweep.add_argument("--preset", choices=["trl-benchmark", "a100", "t4"], default=None,
                       help="sizes for one GPU: trl-benchmark (TRL PR #5765's setting: Llama-3.2-1B's shape, random "
                            "weights, no download; scripts/gpu_sweep.sh), a100 / t4 (hub models); flags given "
                            "explicitly override it")
    sweep.add_argument("--dry-run", action="store_true",
                       help="run the preset at test size on CPU (a tiny model of the same family, N=2,4, 8 "
                            "tokens): proves a GPU script end to end without a GPU")
    sweep.add_argument("--out", default="runs/sweep.jsonl", help="results JSONL (appended; a rerun resumes)")
    sweep.add_argument("--no-live", action="store_true", help="no live chart")
    sweep.set_defaults(func=_sweep)

    report = sub.add_parser("report", help="table, CSV and plotly HTML from a sweep results file")
    report.add_argument("results", help="the sweep's JSONL")
    report.set_defaults(func=_report)

    plot = sub.add_parser("plot", help="the reward curve of a training run, as plotly HTML, from its metrics.jsonl")
    plot.add_argument("metrics", help="a run's metrics.jsonl (cbkit train --output-dir DIR writes DIR/metrics.jsonl)")
    plot.add_argument("--out", default=None, help="HTML file to write (default: reward.html beside the metrics)")
    plot.add_argument("--keys", default=",".join(("reward/mean", "reward/format", "reward/correctness",
                                                  "eval/accuracy")),
                      help="comma-separated metrics to draw (default: the reward, its two built-in parts and held-out accuracy)")
    plot.add_argument("--png", default=None, metavar="FILE.png",
                      help="also write the figure as a PNG (kaleido on the installed Chromium; for a README or a slide)")
    plot.set_defaults(func=_plot)

    from cbkit.train.config import CBGRPOConfig

    train = sub.add_parser(
        "train", parents=[dataclass_flags(CBGRPOConfig)], help="GRPO training with CB rollouts: metrics JSONL and checkpoints in --output-dir",
        description="Every CBGRPOConfig field is a flag. Lists take commas or spaces (--reward-funcs "
                    "correctness,format), dicts JSON, optional values 'none'. --config reads them from a YAML "
                    "recipe; flags given win over it.",
    )
    train.add_argument("--config", default=None, metavar="RECIPE.yaml",
                       help="a YAML file of CBGRPOConfig fields (the format of TRL's --config); flags override it")
    train.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                       help="continue from the newest checkpoint in --output-dir, or from CHECKPOINT; the "
                            "checkpoint's config is used, the recipe and flags given override it where a resume "
                            "allows")
    train.set_defaults(func=_train)
    from cbkit.measure.advise import AdviseConfig

    advise = sub.add_parser(
        "advise", parents=[dataclass_flags(AdviseConfig)],
        help="predict both backends' peak memory and recommend generate, CB or vLLM",
        description="Reads only the model's config. Prints the planner's prediction for generate() and the CB "
                    "engine, the N from which CB uses less memory, and the decision guide applied (its "
                    "thresholds from TRL's A100 benchmark), or with --from a sweep measured on this machine. Every "
                    "AdviseConfig field is a flag.",
    )
    advise.set_defaults(func=_advise)
    tiers = sub.add_parser(
        "tiers", help="plan every notebook on a T4 and an A100 (40/80 GB): fit, runtime, crossover; no GPU needed",
        description="For every notebook and GPU tier (t4: 15 GiB fp16; a100: 40 and 80 GiB bf16): the planned peak "
                    "against memory (the training step included where the notebook trains), the estimated runtime "
                    "against the budget (~10 min on a T4, ~5 on an A100), and whether each memory sweep's "
                    "crossover lies inside its swept N. Exits 1 where a configuration does not fit, overruns its "
                    "budget or hides its phenomenon. Sizes: cbkit/teach/tiers.py.",
    )
    tiers.add_argument("--notebooks", default=None, help="comma-separated notebook names (default: all)")
    tiers.add_argument("--gpus", default=None, help="comma-separated: t4, a100-40, a100-80 (default: all)")
    tiers.set_defaults(func=_tiers)
    for command in (parser, *sub.choices.values()):
        # A flag's bad value reaches main() as an ArgumentError, which prints it as the one line every other
        # bad input gets, instead of argparse's usage dump.
        command.exit_on_error = False
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error (status 2) or the help (status 0)
        return int(e.code or 0)
    except argparse.ArgumentError as e:
        # cbkit's own flag types name the flag in their message; argparse's ("invalid int value") need its name.
        said = e.message if e.message.startswith("--") else str(e)
        print(f"cbkit {argv[0] if argv else ''}: error: {said}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError, FileExistsError, FloatingPointError) as e:
        # Bad input: one clear line that says what to change, not a traceback.
        print(f"cbkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
