"""The package side of the notebooks: setup and profiles, the live hooks, the tables, the recycling model and the
logprob figures. The notebooks themselves run under nbmake (`make test`); tests/test_notebooks.py checks their
committed form."""

from __future__ import annotations

import dataclasses

import plotly.graph_objects as go
import pytest
import torch

from cbkit.rollout import SamplingParams, make_backend
from cbkit.tasks.data import load_problems
from cbkit.teach import live, notebook, trl_step
from cbkit.train.grpo import GRPOTrainer
from cbkit.train.hooks import StepRecord

# --- setup and profiles ----------------------------------------------------------------------------------


def test_profile_comes_from_the_argument_the_environment_or_pytest(monkeypatch):
    monkeypatch.delenv("CBKIT_PROFILE", raising=False)
    assert notebook.resolve_profile() == "ci"  # under pytest, as nbmake runs notebooks
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert notebook.resolve_profile() == "full"
    monkeypatch.setenv("CBKIT_PROFILE", "ci")
    assert notebook.resolve_profile() == "ci"
    assert notebook.resolve_profile("full") == "full"
    monkeypatch.setenv("CBKIT_PROFILE", "tiny")
    with pytest.raises(ValueError, match="CBKIT_PROFILE='tiny' is not a profile; use one of"):
        notebook.resolve_profile()


def test_make_cpu_notebooks_runs_the_kernels_at_the_full_profile(monkeypatch):
    """`make cpu-notebooks` executes under pytest (nbmake), where an unset profile is ci: its recipe must name the
    full profile, or the "CPU-size" runs the guide tells facilitators to show are CI-size (they were, until it did)."""
    import os
    import re
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    recipe = subprocess.run(["make", "-n", "cpu-notebooks"], cwd=repo, capture_output=True, text=True, check=True).stdout
    command = next(line for line in recipe.splitlines() if "--nbmake" in line).split("-m pytest")[0]
    for name in re.findall(r"-u (\w+)", command):
        monkeypatch.delenv(name, raising=False)
    for name, value in re.findall(r"(?:^|\s)([A-Z_]+)=(\S+)", command):
        monkeypatch.setenv(name, value)
    assert "PYTEST_CURRENT_TEST" in os.environ  # as in the kernel nbmake starts
    assert notebook.resolve_profile() == "full"


def test_setup_on_this_cpu_picks_fp32_the_offline_model_and_ci_sizes(monkeypatch, capsys):
    monkeypatch.setenv("CBKIT_PROFILE", "ci")
    env = notebook.setup()
    assert (env.device, env.rollout_dtype, env.train_dtype, env.model) == ("cpu", "float32", "float32", "smollm2-offline")
    assert env.data in ("gsm8k-local:train", "synthetic")
    assert env.pick(ci=1, cpu=2, gpu=3) == 1
    assert "profile 'ci'" in capsys.readouterr().out
    full = notebook.NotebookEnv("full", "cpu", None, None, False, "float32", "float32", "m", "d")
    assert full.pick(ci=1, cpu=2, gpu=3) == 2


@pytest.mark.parametrize(("cc", "memory_gib", "rollout", "autocast", "tier"), [
    ((7, 5), 15, "float16", None, "t4"),  # a T4: no native bf16, 15 GiB
    ((8, 9), 22, "bfloat16", "bfloat16", "t4"),  # an L4: native bf16 but T4-sized memory
    ((8, 0), 40, "bfloat16", "bfloat16", "a100"),  # an A100-40GB
])
def test_setup_on_a_gpu_picks_the_tier_and_keeps_fp32_weights(monkeypatch, cc, memory_gib, rollout, autocast, tier):
    """A T4 (7.5) reports is_bf16_supported() through emulation; setup must not believe it. Training weights
    are fp32 on every GPU (master weights); bf16 is the forward's autocast where it is native."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: type("Props", (), {"total_memory": memory_gib * 2**30})())
    monkeypatch.setattr("cbkit.teach.notebook.seed_everything", lambda seed: None)
    env = notebook.setup(profile="full", verbose=False)
    assert (env.rollout_dtype, env.train_dtype, env.autocast_dtype, env.tier) == (rollout, "float32", autocast, tier)
    assert env.model == notebook.GPU_MODEL
    assert env.pick(ci=1, cpu=2, gpu=3) == 3
    assert ("no native bf16" in env.summary()) == (cc[0] < 8) and f"tier '{tier}'" in env.summary()
    # The tier's logits budget sets the micro-batches: 128 completions x 256 tokens over Qwen2.5's vocabulary
    # (0.58 GiB a completion in the loss) is 128 micro-batches of 1 on a T4 (1 GiB), 16 of 8 on an A100 (8 GiB).
    assert env.micro_batches(128, 256, 151_936) == {"t4": 128, "a100": 16}[tier]


def _config(**kw):
    from cbkit.train.config import CBGRPOConfig

    return CBGRPOConfig(model="tiny", disable_tqdm=True, **kw)


def test_check_fits_adds_training_memory_to_the_planners_rollout(tiny):
    env = notebook.NotebookEnv("full", "cpu", None, None, False, "float32", "float32", "tiny", "d")
    params = sum(p.numel() for p in tiny.model.parameters())
    config = _config(num_generations=4, max_completion_length=8, gradient_accumulation_steps=2)
    line = env.check_fits(tiny.model, config, [[5, 6, 7], [8, 9]])
    # 16 bytes a parameter (fp32 weights, gradients, two AdamW moments), computed here from the model itself.
    assert f"weights, gradients, AdamW: {16 * params / 2**30:.2f}" in line and "rollout peak" in line


# --- the live hook, the tables ------------------------------------------------------------------------------


def _train(tiny, hooks, **kw):
    from cbkit.train.config import CBGRPOConfig

    cfg = CBGRPOConfig(model="tiny", system_prompt=None, prompts_per_step=2, num_generations=4,
                       max_completion_length=8, max_steps=2, disable_tqdm=True, **kw)
    trainer = GRPOTrainer(cfg, policy=tiny, problems=load_problems("synthetic", n=8), hooks=hooks)
    trainer.train()
    return trainer


def test_live_metrics_hook_draws_every_step_of_two_runs_into_one_chart(tiny):
    from cbkit.viz.live import LiveChart

    chart = LiveChart("t", [p for p, _ in live.TRAINING_PANELS])
    first = live.LiveMetricsHook("continuous", chart=chart, close_on_end=False)
    _train(tiny, [first], use_transformers_continuous_batching=True)
    second = live.LiveMetricsHook("generate", chart=chart)
    _train(tiny, [second], use_transformers_continuous_batching=False)
    fig = chart._final
    assert isinstance(fig, go.Figure)  # closed when the second run ended
    names = {t.name for t in fig.data}
    for label in ("continuous", "generate"):
        for series in ("train reward", "tokens/s", "peak memory", "max |diff|", "ratio mean"):
            assert f"{label}: {series}" in names
    tokens = next(t for t in fig.data if t.name == "continuous: tokens/s")
    assert list(tokens.x) == [1, 2]
    assert list(tokens.y) == [r.metrics["rollout/tokens_per_s"] for r in first.records]
    memory = next(t for t in fig.data if t.name == "generate: peak memory")
    assert list(memory.y) == pytest.approx([r.metrics["rollout/peak_mem_bytes"] / 2**20 for r in second.records])
    assert [r.metrics["rollout/backend"] for r in first.records + second.records] == ["continuous"] * 2 + ["generate"] * 2


def test_nan_metrics_are_not_points():
    from cbkit.viz.live import LiveChart

    chart = LiveChart("t", [p for p, _ in live.TRAINING_PANELS])
    hook = live.LiveMetricsHook(chart=chart)
    hook.on_step_end(StepRecord(1, {"logprob/max_abs_diff": float("nan"), "reward/mean": 0.5}))
    names = {t.name for t in chart.figure().data}
    assert names == {"train reward"}


def test_live_sweep_draws_each_run_and_redraws_a_resumed_file(tiny, tmp_path, monkeypatch):
    from cbkit.measure.sweep_config import SweepConfig
    from cbkit.viz.live import LiveChart

    drawn: list[tuple] = []
    monkeypatch.setattr(LiveChart, "add", lambda self, series, x, y, panel=None: drawn.append((series, x, panel)))
    cfg = SweepConfig(model="tiny", ns=(1, 2), repeats=1, max_new_tokens=4, num_prompts=1)
    points = live.live_sweep(cfg, tmp_path / "s.jsonl", policy=tiny)
    assert {(p["backend"], p["N"]) for p in points} == {(b, n) for b in ("generate", "continuous") for n in (1, 2)}
    assert sorted(d[:2] for d in drawn if d[2] == "tokens/s") == sorted((p["backend"], p["N"]) for p in points)
    drawn.clear()
    live.live_sweep(cfg, tmp_path / "s.jsonl", policy=tiny)
    assert len([d for d in drawn if d[2] == "tokens/s"]) == 4  # nothing measured again, every finished run drawn


# --- logprob pairs and their figures -------------------------------------------------------------------------


def test_the_processed_reference_separates_the_truncation_from_the_engine(tiny):
    """02's top-p comparison: under the sampler's nucleus the teacher-forced logprobs agree with the engine's; the
    temperature-only reference (TRL's) gives every sampled token less mass, so every sequence ratio is below 1."""
    from cbkit.train.logprobs import teacher_forced_logprobs

    tok = tiny.tokenizer
    nucleus = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.7, top_k=0, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, seed=0)
    rollout = make_backend("continuous", tiny.model).generate([[5, 6, 7, 8]], 4, nucleus)
    sampled = [torch.tensor(c.sampling_logprobs) for c in rollout.completions]
    processed = torch.cat(teacher_forced_logprobs(tiny.model, rollout.completions, nucleus))
    plain = teacher_forced_logprobs(tiny.model, rollout.completions, dataclasses.replace(nucleus, top_p=1.0))
    assert (torch.cat(sampled) - processed).abs().max() < 1e-4  # same distribution: agree
    assert (torch.cat(plain) <= processed + 1e-6).all()
    assert (torch.cat(plain) < processed - 1e-3).any()
    assert all((p - s).sum() < 0 for p, s in zip(plain, sampled, strict=True))


def test_without_logprobs_drops_them_and_says_why(tiny):
    tok = tiny.tokenizer
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, seed=0)
    rollout = make_backend("generate", tiny.model, pad_token_id=tok.pad_token_id).generate([[5, 6]], 2, sampling)
    dropped = rollout.without_logprobs("as TRL's CB path")
    assert not dropped.has_logprobs and dropped.logprobs_missing_reason == "as TRL's CB path"
    assert all(c.sampling_logprobs is None for c in dropped.completions) and rollout.has_logprobs
    dropped.validate()




@pytest.mark.parametrize(("profile", "device", "tier", "dry_run", "place"), [
    ("full", "cpu", "cpu", False, "disk"),  # a laptop's RAM is short: a file
    ("ci", "cpu", "ci", False, "disk"),
    ("ci", "cuda", "ci", False, "host"),  # the ci profile on any GPU, a T4 included
    ("full", "cuda", "t4", False, "disk"),  # no room on the GPU nor in a Colab runtime's RAM for 05's copies
    ("full", "cuda", "a100", False, "device"),
    ("ci", "cpu", "t4", True, "disk"),  # a dry run takes its tier's branch
    ("ci", "cpu", "a100", True, "device"),
])
def test_each_tier_keeps_its_copy_of_the_weights_where_it_has_room(profile, device, tier, dry_run, place):
    from cbkit.train.snapshots import place_for_tier

    env = notebook.NotebookEnv(profile, device, None, None, False, "float32", "float32", "tiny", "d", tier=tier,
                               dry_run=dry_run)
    assert env.weights_place == place
    if tier in ("t4", "a100"):
        assert place_for_tier(tier) == place  # what the tiers' planner reads, without a NotebookEnv


def test_a_cpu_notebook_trains_in_small_chunks_and_keeps_its_weight_copy_on_disk(tiny, monkeypatch):
    """On a CPU a notebook forwards a small chunk of completions at a time, hands TRL micro-batches of that size, keeps
    the weights it comes back to in a file; a GPU tier (and its dry run on a CPU) keeps the config's chunk and the
    config's micro-batches. check_fits plans the chunk it is given, not the micro-batch."""
    from cbkit.train.config import CBGRPOConfig

    cpu = notebook.NotebookEnv("full", "cpu", None, None, False, "float32", "float32", "tiny", "d")
    dry = notebook.NotebookEnv("ci", "cpu", None, None, False, "float32", "float32", "tiny", "d", tier="t4",
                               dry_run=True)
    assert (cpu.forward_chunk_rows, cpu.weights_place) == (notebook.CPU_FORWARD_CHUNK_ROWS, "disk")
    assert dry.forward_chunk_rows == CBGRPOConfig.forward_chunk_rows
    assert cpu.trl_micro_batches(16, 1) == 16 // notebook.CPU_FORWARD_CHUNK_ROWS
    monkeypatch.setattr(notebook, "CPU_FORWARD_CHUNK_ROWS", 2)
    assert cpu.trl_micro_batches(16, 1) == 8
    assert dry.trl_micro_batches(16, 1) == 1
    whole, chunk = (cpu.check_fits(tiny.model, _config(num_generations=4, max_completion_length=8,
                                                       forward_chunk_rows=c), [[5, 6, 7]] * 2) for c in (None, 2))
    assert "one forward of 8 rows" in whole and "one forward of 2 rows" in chunk


def test_check_fits_refuses_a_gpu_run_that_would_not_fit(tiny, monkeypatch):
    gpu = notebook.NotebookEnv("full", "cuda", "Fake", (7, 5), False, "float16", "float32", "tiny", "d",
                               tier="t4", gpu_memory_bytes=2**20)  # 1 MiB: the weights alone do not fit
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**40, 2**40))  # the rollout fits anything
    config = _config(num_generations=2, max_completion_length=4)
    with pytest.raises(MemoryError, match="needs more than this GPU.s 0.0 GiB"):
        gpu.check_fits(tiny.model, config, [[5, 6, 7]])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**10, 2**40))  # 1 KiB free: no KV pool fits
    with pytest.raises(MemoryError, match="the rollout does not fit"):
        gpu.check_fits(tiny.model, config, [[5, 6, 7]])


# --- sentences printed from a run -------------------------------------------------------------------------------


def test_stock_trl_on_a_cpu_gets_the_workload_pool_not_a_share_of_host_ram(tiny, monkeypatch):
    """02's stock TRL step: TRL hands the engine max_memory_percent, which a CPU reads as a share of host RAM (02 at
    CPU size peaked at 16.1 GiB for it). On a CPU the helper gives the engine the pool cbkit's own CPU engine gets:
    every completion of the step at the longest prompt and the completion limit."""
    pytest.importorskip("trl")
    import trl

    from cbkit.rollout.engine_config import page_size, workload_blocks
    from cbkit.tasks.rewards import DEFAULT_REWARDS
    from cbkit.train.config import CBGRPOConfig
    from cbkit.trl.config import trl_dataset

    seen = {}

    class Stop(Exception):
        pass

    class Stock:
        def __init__(self, *, args, **kwargs):
            seen["cb"] = dict(args.transformers_continuous_batching_config)
            raise Stop

    monkeypatch.setattr(trl, "GRPOTrainer", Stock)
    problems = load_problems("synthetic", n=3)
    dataset = trl_dataset(problems)
    cfg = CBGRPOConfig(model="tiny", num_generations=4, prompts_per_step=3, max_completion_length=10, max_steps=1,
                       use_transformers_continuous_batching=True, disable_tqdm=True)
    with pytest.raises(Stop):
        trl_step.stock_trl_cb_rollout(tiny.model, tiny.tokenizer, DEFAULT_REWARDS, dataset, cfg, report_to=[],
                                      save_strategy="no", per_device_train_batch_size=12)
    longest = max(len(tiny.tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                                         return_dict=True)["input_ids"]) for r in dataset)
    assert seen["cb"]["num_blocks"] == workload_blocks([[0] * longest] * 12, 10, page_size(seen["cb"]))


def test_training_chart_is_a_grid_with_one_legend_entry_per_run_and_labelled_quantities():
    first = live.LiveMetricsHook("continuous", close_on_end=False)
    for hook in (first, live.LiveMetricsHook("generate", chart=first.chart)):
        for step in (1, 2, 3):
            hook.on_step_end(StepRecord(step, {"reward/mean": 0.1 * step, "logprob/max_abs_diff": 1e-6,
                                               "logprob/mean_abs_diff": 1e-7, "rollout/tokens_per_s": 10.0}))
    fig = first.chart.figure()
    assert [t.name for t in fig.data if t.showlegend] == ["continuous", "generate"]  # a legend of runs
    assert fig.layout.height <= 800  # three rows of two panels: read without scrolling
    drift = [t for t in fig.data if t.yaxis == "y5"]  # the fifth panel: row 3, column 1
    assert fig.layout.yaxis5.title.text == "logprob drift (nats)" and len(drift) == 4
    cb_max, cb_mean = [t for t in drift if t.name == "continuous"]
    assert cb_max.line.color != cb_mean.line.color and cb_max.marker.symbol != cb_mean.marker.symbol
    assert list(cb_max.text) == ["", "", "max |diff|"]  # the quantity beside its last point
    tokens = next(t for t in fig.data if t.yaxis == "y3")
    assert tokens.text is None  # one quantity in its panel: nothing to tell apart
