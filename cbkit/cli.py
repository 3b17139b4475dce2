"""`cbkit <command>`: the kit's entry points. Each command is a function taking parsed args, easy to add to."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from cbkit.demo import format_table, run_demo

    results = run_demo(
        model=args.model,
        data=args.data,
        num_prompts=args.prompts,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        backends=tuple(args.backends.split(",")),
        cb_config=json.loads(args.cb_config) if args.cb_config else None,
        seed=args.seed,
        out=args.out,
    )
    print(f"\n{args.prompts} prompts x N={args.num_generations}, max_new_tokens={args.max_new_tokens}, "
          f"model={args.model}, data={args.data}")
    print("peak memory: CPU RSS above the post-load baseline (indicative); CUDA max_memory_allocated on a GPU")
    print(format_table(results))
    return 0


def _train(args: argparse.Namespace) -> int:
    from cbkit import checkpoint
    from cbkit.config import CBGRPOConfig
    from cbkit.grpo import GRPOTrainer

    given = {k: v for k, v in vars(args).items() if k in CBGRPOConfig.__dataclass_fields__}
    values = given
    if args.resume:
        # Resuming takes the checkpoint's config; flags given now override it and are then checked against it.
        path = args.resume if args.resume is not True else checkpoint.latest_checkpoint(given.get("output_dir", ""))
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint-<step> directory in {given.get('output_dir')!r}.")
        values = {**checkpoint.read_config(path).to_dict(), **given}
    if not values.get("output_dir"):
        raise ValueError("cbkit train needs --output-dir (metrics.jsonl and checkpoints go there).")
    config = CBGRPOConfig.from_dict(values)
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


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per CBGRPOConfig field (`--max-completion-length`), typed from its annotation, help from its
    metadata. Flags left out stay out of the namespace, so the config's own defaults apply."""
    import dataclasses
    import typing

    from cbkit.config import CBGRPOConfig

    hints = typing.get_type_hints(CBGRPOConfig)
    for f in dataclasses.fields(CBGRPOConfig):
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if optional else hint
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict = {"default": argparse.SUPPRESS, "help": f"{f.metadata['help']} (default: {default!r})"}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _flag_parser(base, optional)
            kwargs["metavar"] = f.name.upper()
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def _flag_parser(base, optional: bool):
    import typing

    origin = typing.get_origin(base)
    if origin is dict:
        parse = json.loads
    elif origin is list:
        (item,) = typing.get_args(base)
        def parse(text: str) -> list:
            return [item(x) for x in text.split(",") if x.strip()]
    else:
        parse = base

    def convert(text: str):
        if optional and text.lower() == "none":
            return None
        return parse(text)

    convert.__name__ = getattr(base, "__name__", str(base))  # argparse names the type in its error messages
    return convert


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cbkit.sweep import (
        DRY_RUN,
        PRESETS,
        SweepConfig,
        check_preset_device,
        points_table,
        results_summary,
        run_sweep,
        seed_table,
        write_csv,
    )

    if args.dry_run and not args.preset:
        raise ValueError("--dry-run runs a preset at test size on CPU: give --preset too (e.g. --preset seed).")
    if args.preset:
        check_preset_device(args.preset, dry_run=args.dry_run, dtype=args.dtype)  # before any model is loaded
    fields = dict(PRESETS[args.preset]) if args.preset else {}
    if args.dry_run:
        fields.update(DRY_RUN)
    given = {
        "model": args.model, "data": args.data, "num_prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "dtype": args.dtype, "seed": args.seed, "temperature": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k,
        "ns": _int_list(args.ns, "--ns") if args.ns else None,
        "backends": tuple(b.strip() for b in args.backends.split(",")) if args.backends else None,
        "cb_config": json.loads(args.cb_config) if args.cb_config else None,
        "cpu_varlen_attention": False if args.dense_cpu_attention else None,
        "full_step": True if args.full_step else None,
        # The GRPO loop's completions end at EOS, so a full step runs the natural workload unless told otherwise.
        "lengths": args.lengths or ("natural" if args.full_step else None),
    }
    fields.update({k: v for k, v in given.items() if v is not None})
    cfg = SweepConfig(**fields)
    out = Path(args.out)
    _random_weights_note(cfg.model)
    print(cfg.workload.describe(cfg.max_new_tokens))
    live = None
    if not args.no_live and _has_plotly():
        from cbkit.plots import LiveChart

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
    print(results_summary(out))
    print(points_table(points))
    print()
    print(seed_table(points))
    write_csv(points, out.with_suffix(".csv"))
    _gpu_tables(points, cfg.model, force=args.preset == "seed")
    _finish_report(points, out, cfg.fingerprint())
    return 0


def _random_weights_note(model: str) -> None:
    from cbkit.models import RANDOM_SHAPES, RANDOM_WEIGHTS_NOTE

    if model in RANDOM_SHAPES:
        print(f"model {model}: {RANDOM_WEIGHTS_NOTE}")


def _gpu_tables(points, model: str | None, *, force: bool = False) -> None:
    """On a GPU run (or the seed preset's dry run): every memory counter beside the planner, and TRL PR #5765's
    table beside this run's."""
    from cbkit.sweep import memory_table, trl_comparison_table

    if not force and not any(p.get("peak_reserved_bytes") is not None for p in points):
        return
    print("\nMemory (GiB): the planner's prediction beside the measured peaks")
    print(memory_table(points))
    print("\nThis run beside TRL PR #5765 (A100-80GB, Llama-3.2-1B-Instruct, GSM8K, up to 2048 new tokens)")
    print(trl_comparison_table(points))
    from cbkit.models import RANDOM_SHAPES, RANDOM_WEIGHTS_NOTE

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
    from cbkit.plots import write_report

    html = out.with_suffix(".html")
    write_report(points, html, meta)
    print(f"results: {out} (JSONL), {csv} (CSV), {html} (plotly report)")


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cbkit.sweep import aggregate, load_runs, points_table, results_summary, seed_table, write_csv

    out = Path(args.results)
    if not out.is_file():
        raise FileNotFoundError(f"No results file at {out}; run `cbkit sweep --out {out}` first.")
    header = json.loads(out.read_text().splitlines()[0])
    points = aggregate(load_runs(out))
    write_csv(points, out.with_suffix(".csv"))
    print(results_summary(out))
    print(points_table(points))
    print()
    print(seed_table(points))
    _gpu_tables(points, header.get("fingerprint", {}).get("model"))
    _finish_report(points, out, header.get("fingerprint", {}))
    return 0


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers like 8,16,32,64; got {text!r}.") from None
    if not values:
        raise ValueError(f"{flag} is empty; give comma-separated integers like 8,16,32,64.")
    return values


def _advise(args: argparse.Namespace) -> int:
    from cbkit.advise import DTYPE_BYTES, crossover_n, load_config, measured_from_sweep, plan, recommend

    if args.budget_gb is not None and not args.budget_gb > 0:
        raise ValueError(f"--budget-gb must be > 0 (GiB free after loading the weights), got {args.budget_gb}.")
    if args.dtype is not None and args.dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}; got {args.dtype!r}.")
    device = args.device or ("cuda" if args.budget_gb is not None else "cpu")
    if device == "cuda" and args.budget_gb is None:
        raise ValueError("on cuda the CB engine sizes its pool as a share of free memory: give --budget-gb, the "
                         "GiB free after loading the weights (e.g. ~76 on an A100-80GB with a 1B model in bf16).")
    budget = int(args.budget_gb * 1024**3) if args.budget_gb is not None else None
    dtype_bytes = DTYPE_BYTES[args.dtype] if args.dtype else (2 if device == "cuda" else 4)
    sizes = dict(num_prompts=args.prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                 mean_completion_len=args.mean_completion_len, dtype_bytes=dtype_bytes, budget_bytes=budget,
                 device=device)
    if args.num_generations < 1:
        raise ValueError(f"-N must be >= 1, got {args.num_generations}.")
    measured = measured_from_sweep(args.results_from, args.num_generations) if args.results_from else None
    config = load_config(args.model)
    memory = plan(config, num_generations=args.num_generations, model_name=args.model, **sizes)
    cross = crossover_n(config, max_n=max(1024, 4 * args.num_generations), **sizes)
    advice = recommend(args.num_generations, completion_cv=args.completion_cv,
                       mean_completion_len=args.mean_completion_len, max_new_tokens=args.max_new_tokens,
                       multimodal=args.multimodal, need_max_throughput=args.max_throughput, num_gpus=args.gpus,
                       tensor_parallel=args.tensor_parallel, memory=memory if budget is not None else None,
                       measured=measured)
    print("Predicted peak memory above the weights, one rollout:")
    print(memory.summary())
    print(f"crossover: CB's predicted peak is below generate()'s from N={cross}" if cross is not None
          else "crossover: CB's predicted peak stays above generate()'s for every N up to "
               f"{max(1024, 4 * args.num_generations)}")
    print(f"\nAdvice: {advice}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from cbkit.models import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="cbkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="one GRPO-shaped rollout through each backend, side by side")
    demo.add_argument("--model", default=DEFAULT_MODEL,
                      help="smollm2-offline (default), tiny, a hub id or a local directory")
    demo.add_argument("--data", default="synthetic",
                      help="synthetic (default, offline), gsm8k-local, gsm8k[:split] (hub), or a .jsonl path")
    demo.add_argument("--prompts", type=int, default=2, help="number of prompts")
    demo.add_argument("-N", "--num-generations", type=int, default=8, help="completions per prompt")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--temperature", type=float, default=1.0)
    demo.add_argument("--top-p", type=float, default=1.0)
    demo.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    demo.add_argument("--backends", default="generate,continuous")
    demo.add_argument("--cb-config", default=None,
                      help='JSON overrides for the CB engine, e.g. \'{"max_memory_percent": 0.4}\'')
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default=None, help="append one JSON line per backend to this file")
    demo.set_defaults(func=_demo)

    sweep = sub.add_parser("sweep", help="the N-sweep: both backends side by side at growing N (the main job)")
    sweep.add_argument("--preset", choices=["seed", "a100", "t4"], default=None,
                       help="sizes for one GPU: seed (Llama-3.2-1B's shape, random weights, no download; "
                            "scripts/gpu_sweep.sh), a100 / t4 (hub models); flags given explicitly override it")
    sweep.add_argument("--dry-run", action="store_true",
                       help="run the preset at test size on CPU (a tiny model of the same family, N=2,4, 8 "
                            "tokens): proves a GPU script end to end without a GPU")
    sweep.add_argument("--model", default=None, help="default smollm2-offline")
    sweep.add_argument("--data", default=None, help="default synthetic; gsm8k-local, gsm8k[:split], or a .jsonl")
    sweep.add_argument("--prompts", type=int, default=None, help="prompts per rollout (default 1)")
    sweep.add_argument("--ns", default=None, help="comma-separated N values (default 8,16,32,64)")
    sweep.add_argument("--backends", default=None, help="default generate,continuous")
    sweep.add_argument("--repeats", type=int, default=None, help="runs per point; the median is reported (default 2)")
    sweep.add_argument("--max-new-tokens", type=int, default=None, help="default 96")
    sweep.add_argument("--temperature", type=float, default=None)
    sweep.add_argument("--top-p", type=float, default=None)
    sweep.add_argument("--top-k", type=int, default=None)
    sweep.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: fp32 on CPU)")
    sweep.add_argument("--seed", type=int, default=None)
    sweep.add_argument("--cb-config", default=None, help="JSON overrides for the CB engine")
    sweep.add_argument("--out", default="runs/sweep.jsonl", help="results JSONL (appended; a rerun resumes)")
    sweep.add_argument("--no-live", action="store_true", help="no live chart")
    sweep.add_argument("--full-step", action="store_true",
                       help="time a whole GRPO step (rollout + training forward/backward) through cbkit's loop")
    sweep.add_argument("--lengths", default=None, metavar="WORKLOAD",
                       help="how long each completion runs: replay:gsm8k (default: GSM8K solution lengths scaled "
                            "so their p95 is --max-new-tokens, EOS ignored), fixed (all to the limit), natural "
                            "(EOS decides; the default with --full-step), or replay:FILE (a natural sweep's JSONL "
                            "or a list of lengths, replayed as they are)")
    sweep.add_argument("--dense-cpu-attention", action="store_true",
                       help="on CPU, run the CB engine's own dense-mask attention instead of cbkit's varlen one")
    sweep.set_defaults(func=_sweep)

    report = sub.add_parser("report", help="table, CSV and plotly HTML from a sweep results file")
    report.add_argument("results", help="the sweep's JSONL")
    report.set_defaults(func=_report)

    train = sub.add_parser(
        "train", help="GRPO training with CB rollouts: metrics JSONL and checkpoints in --output-dir",
        description="Every CBGRPOConfig field is a flag. Lists are comma-separated (--reward-funcs "
                    "correctness,format), dicts are JSON, optional values take 'none'.",
    )
    add_config_flags(train)
    train.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                       help="continue from the newest checkpoint in --output-dir, or from CHECKPOINT; the "
                            "checkpoint's config is used, flags given override it where a resume allows")
    train.set_defaults(func=_train)
    advise = sub.add_parser(
        "advise", help="predict both backends' peak memory and recommend generate, CB or vLLM",
        description="Reads only the model's config. Prints the planner's prediction for generate() and the CB "
                    "engine, the N from which CB uses less memory, and the seed's decision guide applied (its "
                    "thresholds from TRL's A100 benchmark), or with --from a sweep measured on this machine.",
    )
    advise.add_argument("--model", default=DEFAULT_MODEL,
                        help="smollm2-offline (default), tiny, a hub id or a local directory")
    advise.add_argument("-N", "--num-generations", type=int, required=True, help="completions per prompt")
    advise.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default 8)")
    advise.add_argument("--prompt-len", type=int, default=256, help="longest prompt, tokens (default 256)")
    advise.add_argument("--max-new-tokens", type=int, default=512, help="default 512")
    advise.add_argument("--mean-completion-len", type=float, default=None,
                        help="mean completion length in tokens, if known: measures the spread of lengths")
    advise.add_argument("--completion-cv", type=float, default=None,
                        help="coefficient of variation of completion lengths, if known")
    advise.add_argument("--budget-gb", type=float, default=None,
                        help="GiB free after loading the weights (needed for cuda)")
    advise.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda when --budget-gb is given, else cpu (where cbkit sizes the pool to the workload)")
    advise.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default bf16 on cuda, fp32 on cpu)")
    advise.add_argument("--multimodal", action="store_true", help="prompts carry images or audio")
    advise.add_argument("--max-throughput", action="store_true",
                        help="rollout throughput above all (weight sync to a separate engine acceptable)")
    advise.add_argument("--gpus", type=int, default=1, help="GPUs available (default 1)")
    advise.add_argument("--tensor-parallel", action="store_true", help="the model must be split over GPUs")
    advise.add_argument("--from", dest="results_from", default=None, metavar="SWEEP_JSONL",
                        help="decide from a `cbkit sweep` results file measured here (its speed and memory ratios "
                             "at the nearest N, and its length statistics) instead of the seed's A100 thresholds")
    advise.set_defaults(func=_advise)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError, FileExistsError, FloatingPointError) as e:
        # Bad input: one clear line that says what to change, not a traceback.
        print(f"cbkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
