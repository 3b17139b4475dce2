"""The learning recipe and its figure: the recipe parses to the run docs/learning.md describes, the same command
gives the same metrics (two identical 2-step runs, tiny model, CB rollouts), and `cbkit plot` draws a
metrics.jsonl into an HTML file that embeds plotly.js."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from cbkit.cli import main
from cbkit.tasks.rewards import resolve_rewards
from cbkit.teach.notebook import SHORT_ANSWER_PROMPT
from tests.helpers import config, recipe, trainer, untimed_metrics

REPO = Path(__file__).resolve().parents[1]


def test_the_learning_recipe_is_the_run_the_docs_describe():
    c = recipe(REPO / "recipes" / "smollm2_arith.yaml")
    assert (c.model, c.data, c.reward_funcs) == ("smollm2-offline", "reasoning-gym:chain_sum", ["verified"])
    assert c.data_options == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    assert (c.prompts_per_step, c.num_generations, c.max_completion_length, c.max_steps) == (2, 8, 32, 40)
    assert (c.eval_steps, c.eval_num_problems, c.eval_num_generations, c.temperature) == (8, 64, 2, 1.0)
    assert c.learning_rate == 1e-5


def test_the_hacking_lesson_and_its_fix_differ_only_in_the_format_gate():
    hack = recipe(REPO / "recipes" / "smollm2_format_hack.yaml")
    fixed = recipe(REPO / "recipes" / "smollm2_format_fixed.yaml")
    assert hack.system_prompt == SHORT_ANSWER_PROMPT
    weights = [resolve_rewards(c.reward_funcs, c.reward_weights)[1] for c in (hack, fixed)]
    assert weights == [[0.5, 1.0], [0.5, 1.0]]
    assert hack.diff(fixed, ignore=("output_dir",)) == {
        "reward_funcs": (["format", "correctness"], ["format_if_correct", "correctness"]),
        "reward_weights": (None, [0.5, 1.0])}


def test_two_identical_runs_write_identical_metrics(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for run in ("a", "b"):
            trainer(config(max_steps=2, output_dir=str(tmp_path / run),
                           use_transformers_continuous_batching=True)).train()
    finally:
        torch.set_num_threads(n)
    a, b = untimed_metrics(tmp_path / "a" / "metrics.jsonl"), untimed_metrics(tmp_path / "b" / "metrics.jsonl")
    assert len(a) == 2 and a == b


def embeds_plotlyjs(html: str) -> bool:
    """The page carries the plotly.js library itself (its bundle's own code, megabytes), not a script tag that
    loads it from a CDN: a page that only calls `Plotly.newPlot` draws nothing offline."""
    return "Plotly.newPlot" in html and 'src="https://cdn.plot.ly' not in html and len(html) > 1_000_000


def test_the_embed_check_fails_on_a_page_that_loads_plotlyjs_from_a_cdn():
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(y=[1, 2]))
    assert embeds_plotlyjs(fig.to_html(include_plotlyjs=True))
    assert not embeds_plotlyjs(fig.to_html(include_plotlyjs="cdn"))
    assert not embeds_plotlyjs(fig.to_html(include_plotlyjs=False))


def test_cbkit_plot_writes_the_reward_curve(tmp_path, capsys):
    rows = [{"step": 0, "eval/accuracy": 0.25}]  # the evaluation before training, then two steps
    rows += [{"step": s, "reward/mean": r, "reward/format": f} for s, r, f in [(1, 0.2, 0.3), (2, 0.5, 0.9)]]
    rows[-1]["eval/accuracy"] = 0.5
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')  # a torn last line
    assert main(["plot", str(path)]) == 0
    html = (tmp_path / "reward.html").read_text()
    assert embeds_plotlyjs(html), "reward.html does not carry plotly.js itself: it would not draw offline"
    said = capsys.readouterr().out
    assert "2 steps: " in said and "reward/format 0.300 -> 0.900 (step 1 -> 2)" in said
    assert "eval/accuracy 0.250 -> 0.500 (step 0 -> 2)" in said
    assert main(["plot", str(path), "--keys", "nope"]) == 2  # a clear error, not a traceback


def test_cbkit_plot_png_writes_the_same_figure_as_an_image(tmp_path, capsys):
    if shutil.which("chromium") is None and not os.environ.get("BROWSER_PATH"):
        pytest.skip("no Chromium here: kaleido draws PNGs with the installed one")
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": r}) + "\n" for s, r in [(1, 0.1), (2, 0.4)]))
    png = tmp_path / "reward.png"
    assert main(["plot", str(path), "--keys", "reward/mean", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"image: {png}" in capsys.readouterr().out
