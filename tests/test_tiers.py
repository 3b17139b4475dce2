"""The notebooks' GPU tiers, checked without a GPU: `cbkit tiers` passes on the committed sizes and fails where a
size would not fit; 04's TRL step, built from the notebook's own cells at every
tier, generates prompts x N completions in micro-batches inside the logits budget; setup's bad inputs; the
precision rule. (Colab's restart check: tests/test_colab.py.)"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import nbformat
import pytest
import torch

from cbkit.cli import main
from cbkit.teach import notebook, trl_step
from cbkit.teach.tiers import table
from cbkit.teach.tiers.plan import parameter_count, plan_config, plan_notebook, pool_bytes

REPO = Path(__file__).resolve().parents[1]


def test_cbkit_tiers_passes_for_every_notebook_and_gpu(capsys):
    assert main(["tiers"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok\n") == len(table.NOTEBOOKS) * len(table.MACHINES) == 18 and "18 of 18" in out


# How each notebook asks for its pool (its own cells' call, with its sizes); 01 sizes its own, 05 fixes none.
_POOL_CALLS = {
    "00_quickstart": lambda env, s, model: env.pool_config(model),
    "04_grpo_live": lambda env, s, model: env.pool_config(model),
    # 02 passes its real prompts: lengths the plan cannot know, so they must not change the pool.
    "02_logprob_correctness": lambda env, s, model: env.pool_config(
        model, [[1] * (40 + 97 * i % 300) for i in range(s.prompts * s.n)], s.max_new_tokens),
    "03_n_sweep": lambda env, s, model: env.pool_config(
        model, requests=s.prompts * max(s.sweep_ns), max_new_tokens=s.max_new_tokens, pool_share=s.pool_share),
}


@pytest.mark.parametrize("machine", list(table.MACHINES))
@pytest.mark.parametrize("name", list(_POOL_CALLS))
def test_the_tier_check_plans_the_pool_the_notebook_allocates(name, machine):
    tier, rollout_dtype = table.MACHINES[machine]
    s = table.NOTEBOOKS[name].sizes[tier]
    spec = table.NOTEBOOKS[name]
    env = dataclasses.replace(_gpu_env(tier), notebook=name, sizes=s, trains=spec.kind == "train")
    # The weights the notebook rolls out from: fp32 where it trains or scores logprobs, else the tier's dtype.
    dtype = torch.float32 if spec.kind in ("train", "logprobs") else getattr(torch, rollout_dtype)
    model = types.SimpleNamespace(config=plan_config(s.model), parameters=lambda: iter([torch.zeros(1, dtype=dtype)]))
    allocated = _POOL_CALLS[name](env, s, model)
    assert allocated and plan_notebook(name, machine).pool == allocated


@pytest.mark.parametrize("machine", list(table.MACHINES))
def test_01_is_planned_with_the_pool_its_own_cells_allocate(machine):
    from cbkit.rollout.engine_config import workload_blocks

    tier = table.MACHINES[machine][0]
    cells = nbformat.read(REPO / "notebooks/01_kv_slot_recycling.ipynb", as_version=4).cells
    params = next(i for i, c in enumerate(cells) if c.source.startswith("## Parameters")) + 1
    ns: dict = {"env": types.SimpleNamespace(sizes=table.NOTEBOOKS["01_kv_slot_recycling"].sizes[tier], data="gsm8k")}
    exec(cells[params].source, ns)
    rows = [range(table.PROMPT_LEN)] * int(ns["PROMPTS"] * ns["N"] * ns["POOL_ROWS"])  # the plan's prompt length
    own = {"page_size": ns["PAGE_SIZE"], "max_batch_tokens": ns["TOKEN_BUDGET"],
           "num_blocks": workload_blocks(rows, ns["MAX_NEW_TOKENS"], ns["PAGE_SIZE"])}
    assert plan_notebook("01_kv_slot_recycling", machine).pool == own


def _with_sizes(monkeypatch, name: str, tier: str, **changes):
    spec = table.NOTEBOOKS[name]
    sizes = {**spec.sizes, tier: dataclasses.replace(spec.sizes[tier], **changes)}
    monkeypatch.setitem(table.NOTEBOOKS, name, dataclasses.replace(spec, sizes=sizes))


def test_too_large_a_step_does_not_fit(monkeypatch, capsys):
    _with_sizes(monkeypatch, "04_grpo_live", "t4", n=128)
    assert main(["tiers", "--notebooks", "04_grpo_live", "--gpus", "t4"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_05_is_planned_as_the_five_training_runs_it_makes():
    # One run per staleness in STALENESS, the uncorrected run at the correction's staleness (the corrected one is
    # the staleness run's, reused) and the async run: the notebook's own cells.
    source = "".join(c.source for c in nbformat.read(REPO / "notebooks/05_off_policy.ipynb", as_version=4).cells)
    staleness = next(line for line in source.splitlines() if line.startswith("STALENESS = "))
    assert len(table.NOTEBOOKS["05_off_policy"].train_runs) == len(eval(staleness.split("=", 1)[1])) + 1 + 1


def test_unknown_names_are_refused_with_the_valid_ones(capsys):
    assert main(["tiers", "--gpus", "v100"]) == 2
    err = capsys.readouterr().err
    assert all(gpu in err for gpu in ("v100", "t4", "a100-40", "a100-80"))
    assert main(["tiers", "--notebooks", "05_nope"]) == 2
    assert "03_n_sweep" in capsys.readouterr().err
    with pytest.raises(ValueError, match="00_quickstart"):
        table.notebook_spec("05_nope")


def test_parameter_count_matches_the_built_model():
    # Independent of the arithmetic: build Llama-3.2-1B's shape on the meta device and count its parameters
    # (1,235,814,400 for the real checkpoint); the plan leaves out only the norms.
    from transformers import AutoModelForCausalLM

    config = plan_config("llama-1b-random")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert built == 1_235_814_400
    assert abs(parameter_count(config) - built) / built < 1e-4


def test_the_pool_is_a_share_of_what_training_leaves():
    config = plan_config("llama-1b-random")
    # By hand: 0.4 x (40 GiB - 16 bytes x 1,235,746,816 parameters) = 0.4 x (42,949,672,960 - 19,771,949,056)
    assert pool_bytes(config, "a100", 0.4) == int(0.4 * (42_949_672_960 - 19_771_949_056))
    # The same pool on both A100s: sized for the tier's smallest GPU, so the sweep does not change with the card.
    assert plan_notebook("03_n_sweep", "a100-40").pool == plan_notebook("03_n_sweep", "a100-80").pool


# --- 04's TRL step, from the notebook's own cells -------------------------------------------------------------


def _gpu_env(tier: str) -> notebook.NotebookEnv:
    return notebook.NotebookEnv(
        profile="full", device="cpu", gpu_name=None, compute_capability=None, colab=False,
        rollout_dtype="bfloat16" if tier == "a100" else "float16", train_dtype="float32", model=table.GPU_MODEL,
        data="gsm8k:train", tier=tier, autocast_dtype="bfloat16" if tier == "a100" else None,
        notebook="04_grpo_live", sizes=table.NOTEBOOKS["04_grpo_live"].sizes[tier], trains=True)


@pytest.mark.parametrize("tier", table.GPU_TIERS)
def test_the_trl_step_04_builds_generates_prompts_times_n(tier, monkeypatch, tmp_path):
    from cbkit.trl.config import trl_grpo_config

    env = _gpu_env(tier)
    model = torch.nn.Linear(1, 1)
    model.config = plan_config(env.sizes.model)
    monkeypatch.setattr("cbkit.models.load.load_policy", lambda *a, **k: types.SimpleNamespace(model=model))
    cells = nbformat.read(REPO / "notebooks" / "04_grpo_live.ipynb", as_version=4).cells
    params = next(i for i, c in enumerate(cells) if c.source.startswith("## Parameters")) + 1
    config_cell = next(c for c in cells if c.cell_type == "code" and "config = CBGRPOConfig(" in c.source)
    ns: dict = {"env": env}
    exec(cells[params].source, ns)
    exec(config_cell.source, ns)
    config = ns["config"]
    args = trl_grpo_config(dataclasses.replace(config, max_steps=1), str(tmp_path), **trl_step.trl_step_overrides(env))
    prompts, n = env.sizes.prompts, env.sizes.n
    # TRL's own count of what it generates per step, and the micro-batches it trains in.
    assert args.generation_batch_size == prompts * n
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == prompts * n
    # Checkpointing off: TRL turns on the old name, which transformers >= 5.24 mirrors from the new one.
    assert args.gradient_checkpointing is False and args.activation_checkpointing is False


# --- setup: tiers, dry runs, bad input, the precision rule --------------------------------------------------------


def test_an_unknown_tier_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("CBKIT_TIER", "h100")
    with pytest.raises(ValueError, match=r"\('t4', 'a100'\)"):
        notebook.setup("00_quickstart", verbose=False)


def test_a_gpu_tier_without_a_gpu_says_how_to_get_one(monkeypatch):
    monkeypatch.setenv("CBKIT_TIER", "t4")
    with pytest.raises(RuntimeError, match="Runtime > Change runtime type"):
        notebook.setup("00_quickstart", profile="full", verbose=False)


@pytest.mark.parametrize("tier", table.GPU_TIERS)
def test_a_dry_run_takes_the_tiers_branches_at_ci_size(tier, monkeypatch, capsys):
    monkeypatch.setenv("CBKIT_TIER", tier)
    env = notebook.setup("03_n_sweep", profile="ci")
    assert env.dry_run and env.tier == tier and env.sizes == table.NOTEBOOKS["03_n_sweep"].sizes[tier].dry()
    assert env.rollout_dtype == ("bfloat16" if tier == "a100" else "float16")
    assert env.pick(ci=1, cpu=2, gpu=3) == 3
    pool = env.pool_config(types.SimpleNamespace(config=plan_config(env.sizes.model),
                                                 parameters=lambda: iter([torch.zeros(1, dtype=torch.bfloat16)])),
                           [[1] * 10] * 8, 8)
    from cbkit.rollout.engine_config import workload_blocks

    # Capped so a CPU does not allocate a T4's share: fewer blocks than the 8 requests need, so some wait.
    assert 0 < pool["num_blocks"] < workload_blocks([[1] * 10] * 8, 8, pool["page_size"])
    assert f"plan for {'t4' if tier == 't4' else 'a100-40'} (`cbkit tiers`): peak" in capsys.readouterr().out


def test_a_plan_that_does_not_fit_stops_before_any_model_time(monkeypatch):
    _with_sizes(monkeypatch, "04_grpo_live", "t4", n=128)
    monkeypatch.setenv("CBKIT_TIER", "t4")
    with pytest.raises(MemoryError, match="does not fit.*lower"):
        notebook.setup("04_grpo_live", profile="ci", verbose=False)


def test_the_precision_rule_follows_the_dtypes_the_code_uses():
    a100 = dataclasses.replace(_gpu_env("a100"))
    t4 = _gpu_env("t4")
    assert "samples from the float32 training weights" in a100.precision
    assert "under bfloat16 autocast" in a100.precision and f"{torch.finfo(torch.bfloat16).eps:.1e}" in a100.precision
    assert "autocast" not in t4.precision and f"{torch.finfo(torch.float32).eps:.1e}" in t4.precision
    rollout_only = dataclasses.replace(t4, trains=False)
    assert rollout_only.precision.startswith("rollouts sample from float16 weights")


def test_the_logprob_notebook_says_it_scores_in_fp32_and_samples_a_bf16_copy():
    env = dataclasses.replace(_gpu_env("t4"), notebook="02_logprob_correctness", trains=False)
    assert "section 2 from a bfloat16 copy" in env.precision and "teacher-forced in float32" in env.precision


def test_a_colab_runtime_without_a_gpu_is_told_how_to_switch(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.delenv("CBKIT_TIER", raising=False)
    env = notebook.setup("00_quickstart", profile="full", verbose=False)
    assert env.colab and env.tier == "cpu"
    assert "Runtime > Change runtime type" in capsys.readouterr().out


def test_the_step_timers_kept_copy_is_a_file_and_04_plans_no_async_snapshot(tiny):
    """The full-step timer puts the weights back from a copy kept in a file on every device, a GPU included (its
    `model.device` patched to CUDA here). 04 runs no async row, so its plan holds no engine snapshot and, on a t4,
    no copy on the GPU (its one copy is a file there)."""
    from unittest import mock

    from cbkit.measure.sweep import _keep_weights

    with mock.patch.object(type(tiny.model), "device", new_callable=mock.PropertyMock,
                           return_value=torch.device("cuda")):
        kept = _keep_weights(tiny.model)
    try:
        assert kept.where == "disk" and isinstance(kept._ring[0][1], Path)
    finally:
        kept.close()
    plan = plan_notebook("04_grpo_live", "t4")
    params = parameter_count(plan_config(table.GPU_MODEL))
    assert "the async engine's weight snapshot" not in plan.parts and params > 0
    assert not any(k.startswith("copies") for k in plan.parts) and plan.host_bytes == 0 and not plan.problems()


def test_the_pool_model_worked_by_hand():
    """`cbkit.rollout.admission`'s block count, on numbers worked by hand: a 10-token prompt in 4-token
    pages has 2 complete pages a group of 3 shares; each sequence at 7 tokens past it holds ceil(17/4) = 5 pages."""
    from cbkit.rollout.admission import blocks_needed

    assert blocks_needed(10, 7, 4, n=3) == 2 + 3 * (5 - 2) == 11
    assert blocks_needed(10, 7, 4, n=3, share_prompt=False) == 15 and blocks_needed(10, 7, 4) == 5
