"""The precision rule of training (DESIGN.md: the weights that train are fp32 on every device; bf16 only as an
autocast over them, only where native) and accelerate's mixed-precision wrapper on the CB path.

A GPU is emulated through torch's own queries (`torch.cuda.is_available`, `torch.cuda.get_device_capability`), as
a T4 (7.5: bf16 only emulated), an A100 (8.0) and an H100 (9.0); the expected outcome of each `dtype` on each is
the table of the rule, worked by hand. accelerate wraps a model's forward under bf16 mixed precision on a CPU as on
a GPU (`Accelerator.__init__`: `native_amp = True` for a CPU; `prepare_model` then installs the wrapper), so the
crash it causes on the CB path reproduces here.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cbkit.models.load import load_policy, training_precision
from cbkit.train.config import CBGRPOConfig
from cbkit.train.grpo import GRPOTrainer
from tests.helpers import PROBLEMS, config, letters_reward, weight_change

T4, A100, H100 = (7, 5), (8, 0), (9, 0)
REFUSED_T4 = "set dtype: auto, fp32 on this GPU"
REFUSED_FP16 = "fp16 autocast needs loss scaling"


def _emulate_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)


# --- the rule: one function, every device ---------------------------------------------------------------------


@pytest.mark.parametrize(("gpu", "dtype", "expected"), [
    (T4, "auto", None), (T4, "float32", None), (T4, "bfloat16", REFUSED_T4), (T4, "float16", REFUSED_FP16),
    (A100, "auto", torch.bfloat16), (A100, "float32", None), (A100, "bfloat16", torch.bfloat16),
    (A100, "float16", REFUSED_FP16),
    (H100, "auto", torch.bfloat16), (H100, "float32", None), (H100, "bfloat16", torch.bfloat16),
    (H100, "float16", REFUSED_FP16),
])
def test_training_precision_on_each_gpu(monkeypatch, gpu, dtype, expected):
    _emulate_gpu(monkeypatch, gpu)
    # What the T4 case guards against: torch calls bf16 "supported" there (emulated, slow).
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            training_precision(dtype, "cuda")
    else:
        assert training_precision(dtype, "cuda") is expected
        assert training_precision(dtype, torch.device("cuda", 0)) is expected


@pytest.mark.parametrize(("dtype", "expected"), [
    ("auto", None), ("float32", None), ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
    ("float16", REFUSED_FP16), ("fp16", REFUSED_FP16), ("float8", "not a training precision"),
])
def test_training_precision_on_a_cpu(monkeypatch, dtype, expected):
    """A CPU: 'auto' is fp32, bf16 autocast is allowed (torch's CPU autocast computes in bf16), fp16 refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            training_precision(dtype, "cpu")
    else:
        assert training_precision(dtype, "cpu") is expected


def test_the_config_refuses_what_no_device_allows_before_a_model_is_loaded():
    with pytest.raises(ValueError, match=REFUSED_FP16):
        CBGRPOConfig(model="tiny", dtype="float16")
    with pytest.raises(ValueError, match="use one of auto, float32, bfloat16, float16"):
        CBGRPOConfig(model="tiny", dtype="half")
    assert CBGRPOConfig(model="tiny", dtype="bfloat16").dtype == "bfloat16"  # the device decides, in the trainer


@pytest.mark.parametrize(("gpu", "forced", "expected"), [
    (T4, None, None), (A100, None, torch.bfloat16), (H100, None, torch.bfloat16),
    (A100, "t4", None),  # a forced t4 tier on an A100 rehearses a T4: fp32, which 'auto' would not give
])
def test_the_notebooks_config_dtype_is_their_precision_rule(monkeypatch, gpu, forced, expected):
    """The notebooks pass `env.compute_dtype` as the loop's dtype: it must resolve to the autocast their setup
    announces (`env.autocast_dtype`, printed in the precision rule)."""
    from cbkit.teach import notebook

    _emulate_gpu(monkeypatch, gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: type("Props", (), {"total_memory": 80 * 2**30})())
    monkeypatch.setattr("cbkit.teach.notebook.seed_everything", lambda seed: None)
    if forced:
        monkeypatch.setenv("CBKIT_TIER", forced)
    else:
        monkeypatch.delenv("CBKIT_TIER", raising=False)
    env = notebook.setup(profile="full", verbose=False)
    assert training_precision(env.compute_dtype, env.device) is expected
    assert env.autocast_dtype == (None if expected is None else "bfloat16")


def test_the_a100_tiers_dry_run_on_a_cpu_trains_under_bf16_autocast(monkeypatch):
    from cbkit.teach import notebook

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("cbkit.teach.notebook.seed_everything", lambda seed: None)
    monkeypatch.setenv("CBKIT_TIER", "a100")
    env = notebook.setup(profile="ci", verbose=False)
    assert env.dry_run and training_precision(env.compute_dtype, env.device) is torch.bfloat16


def test_a_full_step_sweep_refuses_what_the_loop_refuses(monkeypatch):
    from cbkit.measure.sweep_config import SweepConfig

    _emulate_gpu(monkeypatch, T4)
    with pytest.raises(ValueError, match=REFUSED_T4):
        SweepConfig(model="tiny", full_step=True, dtype="bfloat16")
    with pytest.raises(ValueError, match=REFUSED_FP16):
        SweepConfig(model="tiny", full_step=True, dtype="float16")
    SweepConfig(model="tiny", full_step=False, dtype="float16")  # rollouts alone may run in fp16 weights
    _emulate_gpu(monkeypatch, A100)
    SweepConfig(model="tiny", full_step=True, dtype="bfloat16")


# --- the trainer: fp32 weights whatever dtype says -------------------------------------------------------------


def _lm_head_dtypes(trainer: GRPOTrainer) -> tuple[set[torch.dtype], dict[str, float]]:
    """The dtypes the LM head computed in during one step (rollout and training forwards), and how far the step
    moved the weights."""
    seen: set[torch.dtype] = set()
    handle = trainer.model.lm_head.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    try:
        record = trainer.step()
    finally:
        handle.remove()
    assert record.metrics["train/grad_norm"] > 0
    return seen, {**weight_change(before, trainer.model), "_before": before}


@pytest.mark.parametrize(("dtype", "forward_dtypes"), [
    ("auto", {torch.float32}),  # on a CPU: no autocast
    ("bfloat16", {torch.float32, torch.bfloat16}),  # the rollout reads the fp32 weights; the training forwards bf16
])
def test_the_trainer_loads_fp32_weights_and_keeps_an_update_bf16_would_lose(dtype, forward_dtypes):
    """The trainer loads the policy itself (as `cbkit train` does). Whatever `dtype` says, the weights are fp32
    (before the fix, dtype='bfloat16' loaded bf16 weights on this CPU too). At lr 1e-6 AdamW's first step moves each
    weight by about 1e-6, far under half of bf16's spacing near the tiny model's weights (~6e-5 at 0.02): the same
    update added to bf16 copies of the weights rounds back to what they were, while the fp32 weights keep it."""
    trainer = GRPOTrainer(config(dtype=dtype, learning_rate=1e-6, max_steps=1), reward_funcs=[letters_reward],
                          problems=PROBLEMS)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert trainer.autocast_dtype is training_precision(dtype, "cpu")
    seen, moved = _lm_head_dtypes(trainer)
    assert seen == forward_dtypes
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert moved["changed_share"] > 0.5 and moved["relative_change"] > 0
    kept = total = 0
    for name, after in trainer.model.state_dict().items():
        old = moved["_before"][name]
        if not old.is_floating_point():
            continue
        as_bf16 = old.to(torch.bfloat16)
        kept += int(((as_bf16.float() + (after - old)).to(torch.bfloat16) != as_bf16).sum())
        total += old.numel()
    assert kept / total < 0.05, kept / total  # bf16 weights would have kept under 5% of it


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_half_precision_policy_is_refused_with_what_to_do(tiny, half):
    model = copy.deepcopy(tiny.model).to(half)
    with pytest.raises(ValueError, match=r"load_policy\(\.\.\., dtype='float32'\)") as err:
        GRPOTrainer(config(), policy=(model, tiny.tokenizer), problems=PROBLEMS)
    assert str(half) in str(err.value)


def test_a_fp32_policy_handed_in_trains_under_the_configs_autocast(tiny):
    model = copy.deepcopy(tiny.model)
    trainer = GRPOTrainer(config(dtype="bfloat16"), policy=(model, tiny.tokenizer), problems=PROBLEMS,
                          reward_funcs=[letters_reward])
    assert trainer.autocast_dtype is torch.bfloat16 and next(model.parameters()).dtype == torch.float32


def test_the_trainer_asks_for_fp32_where_auto_would_load_half(monkeypatch):
    """On an A100 `load_policy(dtype='auto')` loads bf16 weights (the rollouts' dtype); the trainer must ask for fp32
    whatever the config's dtype. Checked where it asks (the step itself runs on this CPU)."""
    import cbkit.models.load as load

    _emulate_gpu(monkeypatch, A100)
    assert load._resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16  # the hazard, on that GPU
    monkeypatch.undo()
    asked: list = []
    real = load.load_policy

    def spy(name, **kw):
        asked.append(kw.get("dtype"))
        return real(name, **kw)

    monkeypatch.setattr(load, "load_policy", spy)
    GRPOTrainer(config(dtype="auto"), reward_funcs=[letters_reward], problems=PROBLEMS)
    assert asked == ["float32"]


def test_load_policy_still_loads_the_rollout_dtype(monkeypatch):
    """Rollout-only callers (the sweep, notebooks 01 and 03) keep `load_policy`'s own 'auto': fp32 on a CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert next(load_policy("tiny", dtype="auto").model.parameters()).dtype == torch.float32


# --- accelerate's mixed-precision wrapper on the CB path ------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own default
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_disable` is deprecated:FutureWarning")
def test_02s_stock_trl_step_survives_bf16_mixed_precision(tiny, monkeypatch):
    """Notebook 02's stock TRL step with bf16=True, as `cbkit.trl.config` sets it on an A100/H100 (native_bf16).
    accelerate installs the same wrapper on this CPU (checked: the model it prepared has `_original_forward`), whose
    `.float()` on the PagedAttentionCache the CB forward returns (transformers 5.24.0 returns it, 5.17.0 does not:
    `tests.helpers.cb_forward_returns_its_cache`) killed the generation; the step must run TRL's own CB generation
    to the end and show what it shows on every device: completions, and no logprobs."""
    from accelerate import Accelerator

    from cbkit.tasks.data import load_problems
    from cbkit.tasks.rewards import DEFAULT_REWARDS
    from cbkit.teach.trl_step import stock_trl_cb_rollout
    from cbkit.trl.config import trl_dataset

    prepared = []
    real = Accelerator.prepare_model

    def spy(self, model, *a, **k):
        out = real(self, model, *a, **k)
        prepared.append((self.mixed_precision, "_original_forward" in vars(out)))
        return out

    monkeypatch.setattr(Accelerator, "prepare_model", spy)
    cfg = CBGRPOConfig(model="tiny", num_generations=4, prompts_per_step=1, max_completion_length=8, max_steps=1,
                       use_transformers_continuous_batching=True, disable_tqdm=True)
    dataset = trl_dataset(load_problems("synthetic", n=2))
    # use_cpu: transformers refuses bf16 on a machine without a bf16 GPU unless told it is a CPU run.
    seen = stock_trl_cb_rollout(tiny.model, tiny.tokenizer, DEFAULT_REWARDS, dataset, cfg, bf16=True, use_cpu=True,
                                report_to=[], logging_steps=1, save_strategy="no", per_device_train_batch_size=4)
    assert ("bf16", True) in prepared  # the wrapper was there
    assert seen["trainer"] == "trl.trainer.grpo_trainer.GRPOTrainer"
    assert seen["completions"] == 4 and seen["tokens"] > 0 and seen["logprobs"] is None


def test_a_cb_step_under_bf16_autocast_stays_inside_the_gpu_tests_rounding_bound():
    """The `gpu` test's bound for a GRPO step under bf16 autocast (tests/test_gpu.py), checked where torch's CPU
    autocast really computes in bf16: the engine samples the fp32 weights, the old-logprob forward runs under bf16
    autocast, and the two differ by bf16's roundings, within 2 (2L + 1) eps Z (`tests.helpers.rounding_bound`) but far
    beyond fp32's (the same step in float32, under the CPU suite's 1e-4): the bound is not so loose that a step
    without autocast would be needed to meet it."""
    from unittest import mock

    from tests.helpers import rounding_bound, trainer

    diffs = {}
    for dtype in ("float32", "bfloat16"):
        tr = trainer(config(use_transformers_continuous_batching=True, max_steps=1, dtype=dtype),
                     policy=load_policy("tiny", dtype=torch.float32, seed=0))
        with mock.patch.object(GRPOTrainer, "prepare", autospec=True, side_effect=GRPOTrainer.prepare) as prepare:
            try:
                diffs[dtype] = tr.step().metrics["logprob/max_abs_diff"]
            finally:
                tr.close()
        assert tr.autocast_dtype is (torch.bfloat16 if dtype == "bfloat16" else None)
    # The weights that sampled: a fresh load of the same seed, before the step moved them.
    sampler = load_policy("tiny", dtype=torch.float32, seed=0).model
    tol = rounding_bound(sampler, prepare.call_args.args[1].completions, tr.config.temperature, torch.bfloat16)
    print(f"CPU GRPO step: logprob/max_abs_diff {diffs}, bf16 autocast bound {tol:.3f}")
    assert diffs["float32"] < 1e-4 < 1e-3 < diffs["bfloat16"] < tol < 1.0, (diffs, tol)
