"""docs/learning.md's tables and figures, printed and drawn from the learning runs' metrics.jsonl files.

    python scripts/learning_report.py [RESULTS_DIR]    # default lab/results; figures go to docs/learning/

Reads `arith-<backend>-s<seed>-metrics.jsonl` (the recipe recipes/smollm2_arith.yaml with CB rollouts and with
generate() rollouts, seeds 0 and 1), `arith-cb-s0-nois-metrics.jsonl` (CB without the importance-sampling
correction) and `format-{hack,fixed}-metrics.jsonl` (the reward-hacking lesson and its fix), prints Markdown
tables of held-out accuracy and step time, and writes the figures as PNG (kaleido on the installed Chromium).
Every number in docs/learning.md's results sections is one this script prints.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from cbkit.viz.figures import PALETTE, TEMPLATE, backend_color, figure_pngs, read_metrics

REPO = Path(__file__).resolve().parents[1]


def runs_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], key: str, *, title: str | None = None,
                dashes: Mapping[str, str] | None = None, colors: Mapping[str, str] | None = None) -> go.Figure:
    """One metric of several runs against step, one colour per run. Rows without the metric are left out, so a
    held-out metric (`eval/*`) draws as a line through its evaluations."""
    fig = go.Figure()
    for i, (name, rows) in enumerate(runs.items()):
        have = [r for r in rows if isinstance(r.get(key), int | float)]
        fig.add_scatter(x=[r["step"] for r in have], y=[r[key] for r in have], mode="lines+markers", name=name,
                        line=dict(color=(colors or {}).get(name, PALETTE[i % len(PALETTE)]),
                                  dash=(dashes or {}).get(name, "solid")))
    fig.update_layout(template=TEMPLATE, title=title or key, xaxis_title="step", yaxis_title=key, height=380)
    return fig


def evals(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/accuracy"]) for r in rows if isinstance(r.get("eval/accuracy"), int | float)]


def steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["step"] > 0]


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in steps(rows))


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| run | held-out accuracy at each evaluation (step: accuracy) | first -> last | change | "
             "median step s | median rollout s | median train s | eval s (each) | run s (steps + evals) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in runs.items():
        e = evals(rows)
        trail = ", ".join(f"{s}: {a:.3f}" for s, a in e)
        run_s = sum(r["step/seconds"] for r in steps(rows)) + sum(r.get("eval/seconds", 0) for r in rows)
        eval_s = statistics.median(r["eval/seconds"] for r in rows if "eval/seconds" in r)
        lines.append(f"| {name} | {trail} | {e[0][1]:.3f} -> {e[-1][1]:.3f} | {e[-1][1] - e[0][1]:+.3f} | "
                     f"{median(rows, 'step/seconds'):.1f} | {median(rows, 'rollout/seconds'):.1f} | "
                     f"{median(rows, 'train/seconds'):.1f} | {eval_s:.1f} | {run_s:.0f} |")
    return "\n".join(lines)


def seed_summary(runs: dict[str, list[dict]], backend: str) -> str:
    last = [evals(rows)[-1][1] for name, rows in runs.items() if name.startswith(backend)]
    gain = [evals(rows)[-1][1] - evals(rows)[0][1] for name, rows in runs.items() if name.startswith(backend)]
    spread = (max(last) - min(last)) / 2
    return (f"{backend}: last held-out accuracy mean {statistics.mean(last):.3f} +- {spread:.3f} (half the range "
            f"over {len(last)} seeds); change from step 0: {', '.join(f'{g:+.3f}' for g in gain)}")


def main(results: Path) -> None:
    out = REPO / "docs" / "learning"
    out.mkdir(exist_ok=True)
    read = {name: read_metrics(results / f"{name}-metrics.jsonl") for name in (
        "arith-cb-s0", "arith-cb-s1", "arith-gen-s0", "arith-gen-s1", "arith-cb-s0-nois", "format-hack",
        "format-fixed") if (results / f"{name}-metrics.jsonl").is_file()}
    label = {"arith-cb-s0": "CB, seed 0", "arith-cb-s1": "CB, seed 1", "arith-gen-s0": "generate(), seed 0",
             "arith-gen-s1": "generate(), seed 1", "arith-cb-s0-nois": "CB without IS, seed 0",
             "format-hack": "format reward (gamed)", "format-fixed": "format only if correct (fix)"}
    runs = {label[k]: v for k, v in read.items()}
    figures = []

    learn = {k: v for k, v in runs.items() if k.startswith(("CB, seed", "generate()"))}
    if learn:
        print("## CB and generate(): the recipe, two seeds each\n")
        print(table(learn) + "\n")
        for backend in ("CB", "generate()"):
            if any(k.startswith(backend) for k in learn):
                print(seed_summary(learn, backend))
        colors = {k: backend_color("continuous" if k.startswith("CB") else "generate") for k in learn}
        dashes = {k: "dot" for k in learn if k.endswith("seed 1")}
        fig = runs_curves(learn, "eval/accuracy", title="Held-out accuracy: CB and generate() rollouts, two seeds",
                          colors=colors, dashes=dashes)
        fig.update_yaxes(title="held-out accuracy (math-verify)", range=[0, 1])
        figures.append(("heldout-cb-vs-generate", fig))
    if "CB without IS, seed 0" in runs and "CB, seed 0" in runs:
        pair = {k: runs[k] for k in ("CB, seed 0", "CB without IS, seed 0")}
        print("\n## The importance-sampling correction on and off (CB, seed 0)\n")
        print(table(pair) + "\n")
        drift = max(r.get("logprob/max_abs_diff", 0) or 0 for r in steps(runs["CB, seed 0"]))
        ratio = [r["is/ratio_mean"] for r in steps(runs["CB, seed 0"]) if "is/ratio_mean" in r]
        print(f"largest |sampling - policy| logprob gap over the CB run: {drift:.2e} nats; IS ratio mean per step "
              f"{min(ratio):.6f} .. {max(ratio):.6f}")
        fig = runs_curves(pair, "eval/accuracy", title="Held-out accuracy with and without the IS correction (CB)")
        fig.update_yaxes(title="held-out accuracy (math-verify)", range=[0, 1])
        figures.append(("heldout-is-on-off", fig))
    if "format reward (gamed)" in runs and "format only if correct (fix)" in runs:
        pair = {k: runs[k] for k in ("format reward (gamed)", "format only if correct (fix)")}
        print("\n## Reward hacking and its fix (synthetic word problems)\n")
        print("| run | reward/mean first -> last step | format, first -> last step | held-out accuracy, step 0 -> "
              "last | mean length, first -> last step |\n| --- | --- | --- | --- | --- |")
        for name, rows in pair.items():
            s = steps(rows)
            fmt = "reward/format" if "reward/format" in s[0] else "reward/format_if_correct"
            e = evals(rows)
            print(f"| {name} | {s[0]['reward/mean']:.3f} -> {s[-1]['reward/mean']:.3f} | {fmt.split('/')[1]} "
                  f"{s[0][fmt]:.3f} -> {s[-1][fmt]:.3f} | {e[0][1]:.3f} -> {e[-1][1]:.3f} | "
                  f"{s[0]['completion/mean_length']:.1f} -> {s[-1]['completion/mean_length']:.1f} |")
        for key, title in (("reward/mean", "Train reward"), ("eval/accuracy", "Held-out accuracy")):
            fig = runs_curves(pair, key, title=f"{title}: a gamed format reward and its fix")
            figures.append((f"hack-vs-fix-{key.split('/')[0]}", fig))
    hacked = {f"{p.stem.removesuffix('-metrics')} (verifier gamed)": read_metrics(p)
              for p in sorted((results / "verifier-hack").glob("*-metrics.jsonl"))}
    if hacked:
        print("\n## The verifier gamed: the same recipe when math-verify accepted a final expression\n")
        print("| run | held-out accuracy at each evaluation (step: accuracy), as scored then |\n| --- | --- |")
        for name, rows in hacked.items():
            print(f"| {name} | {', '.join(f'{s}: {a:.3f}' for s, a in evals(rows))} |")
    for (name, _), png in zip(figures, figure_pngs([f for _, f in figures]), strict=True):
        (out / f"{name}.png").write_bytes(png)
        print(f"figure: docs/learning/{name}.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "lab" / "results")
