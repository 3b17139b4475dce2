"""`cbkit train` and `cbkit plot`: a GRPO run from flags and a YAML recipe (resumable), and its reward curve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cbkit.cli.flags import dataclass_flags, given_fields
from cbkit.cli.sweep import has_plotly


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


def _plot(args: argparse.Namespace) -> int:
    if not has_plotly():
        raise ModuleNotFoundError("cbkit plot draws with plotly: pip install plotly.")
    from cbkit.viz.figures import read_metrics, reward_curve

    path = Path(args.metrics)
    if not path.is_file():
        raise FileNotFoundError(f"No metrics file at {path}; `cbkit train --output-dir DIR` writes DIR/metrics.jsonl.")
    rows = read_metrics(path)
    keys = [k for k in args.keys.split(",") if k]
    if not any(k in r for k in keys for r in rows):
        raise ValueError(f"None of {keys} is in {path}; it has e.g. {sorted(rows[0])[:8]}. Choose --keys from those.")
    out = Path(args.out) if args.out else path.with_name("reward.html")
    fig = reward_curve(rows, keys, title=f"Reward per step: {path}")
    fig.write_html(out, include_plotlyjs=True)  # plotly.js embedded: the file opens offline
    said = []
    for k in keys:  # each metric's first and last measured value
        have = [r for r in rows if isinstance(r.get(k), int | float)]
        if have:
            said.append(f"{k} {have[0][k]:.3f} -> {have[-1][k]:.3f} (step {have[0]['step']} -> {have[-1]['step']})")
    trained = sum(r["step"] > 0 for r in rows)
    print(f"{trained} steps: {', '.join(said)}; figure: {out}")
    if args.png:
        from cbkit.viz.figures import figure_pngs

        Path(args.png).write_bytes(figure_pngs([fig])[0])
        print(f"image: {args.png}")
    return 0


def add_plot(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser("plot", help="the reward curve of a training run, as plotly HTML, from its metrics.jsonl")
    plot.add_argument("metrics", help="a run's metrics.jsonl (cbkit train --output-dir DIR writes DIR/metrics.jsonl)")
    plot.add_argument("--out", default=None, help="HTML file to write (default: reward.html beside the metrics)")
    plot.add_argument("--keys", default="reward/mean,reward/format,reward/correctness,eval/accuracy",
                      help="comma-separated metrics to draw")
    plot.add_argument("--png", default=None, metavar="FILE.png", help="also write the figure as a PNG (kaleido)")
    plot.set_defaults(func=_plot)


def add_train(sub: argparse._SubParsersAction) -> None:
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
                       help="continue from the newest checkpoint in --output-dir, or from CHECKPOINT, under its "
                            "config (the recipe and flags given override it where a resume allows)")
    train.set_defaults(func=_train)
