"""What only a CUDA device exercises: half-precision CB rollouts against the trainer's forward, and a GRPO step
with fp32 weights on the GPU. Marked `gpu`: skipped without CUDA (`tests/conftest.py`); `pytest -m gpu` runs them.
The async engine's stream ordering on a real GPU is in tests/test_async_rollouts.py, beside its CPU twin.
Only built-in models: a GPU machine has no hub and no gguf package.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from cbkit.models.load import load_policy, native_bf16
from cbkit.rollout import ContinuousBackend, SamplingParams
from cbkit.train.grpo import GRPOTrainer
from cbkit.train.logprobs import teacher_forced_logprobs
from tests.helpers import config, rounding_bound, trainer

pytestmark = pytest.mark.gpu

QUESTIONS = ["hi", "what is 12 + 30?", "Tom has 3 apples and buys 4 more. How many now?"]


def _prompts(tok) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_rollout_logprobs_match_the_training_forward(dtype, temperature):
    """The CB engine samples in `dtype` from the tiny model; each sampling logprob must equal the training forward's
    (`cbkit.train.logprobs.teacher_forced_logprobs`, same weights, same dtype) within what the dtype's rounding
    allows, not fp32's 1e-4: the two forwards do the same arithmetic with other kernels (paged attention over a
    packed batch against dense attention over a padded one), so they differ by rounding, 2 (2L + 1) eps Z
    (`tests.helpers.rounding_bound` derives it)."""
    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("bf16 is emulated on this GPU (compute capability < 8.0)")
    policy = load_policy("tiny", dtype=dtype, device="cuda", seed=0)
    model, tok = policy.model, policy.tokenizer
    sampling = SamplingParams(max_new_tokens=16, temperature=temperature, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, seed=0)
    rollout = ContinuousBackend(model).generate(_prompts(tok), 4, sampling)
    reference = teacher_forced_logprobs(model, rollout.completions, sampling)
    tol = rounding_bound(model, rollout.completions, temperature, dtype)
    assert 0 < tol < 1.0, f"a bound of {tol:.2f} nats could not tell a wrong logprob from rounding"
    worst = max((torch.tensor(c.sampling_logprobs) - r.float()).abs().max().item()
                for c, r in zip(rollout.completions, reference, strict=True))
    print(f"{dtype} T={temperature}: max |sampling - teacher-forced| = {worst:.2e}, bound {tol:.2e}")
    assert worst <= tol
    assert rollout.peak_mem_kind == "cuda_allocated"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_grpo_step_on_a_gpu_moves_its_fp32_weights(dtype):
    """One step of cbkit's loop with the CB backend on the GPU: the weights stay fp32 on the device, every one
    finite, and the update moves them. The engine samples the fp32 weights; the trainer's old-logprob forward runs
    in the loop's `dtype` (`training_precision`). Under float32 the two agree within 1e-3 (kernels differ: the CPU
    suite's 1e-4 is for the CPU's; 1e-3 still tells a wrong distribution). Under bf16 autocast (what `auto` is on a
    GPU with native bf16) they differ by bf16's roundings, up to 2 (2L + 1) eps Z (`tests.helpers.rounding_bound`;
    tests/test_precision.py checks the same bound on a CPU)."""
    if dtype == "bfloat16" and not native_bf16():
        pytest.skip("bf16 is emulated on this GPU (compute capability < 8.0): the loop refuses it")
    policy = load_policy("tiny", dtype=torch.float32, device="cuda", seed=0)
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    tr = trainer(config(use_transformers_continuous_batching=True, max_steps=1, dtype=dtype), policy=policy)
    with mock.patch.object(GRPOTrainer, "prepare", autospec=True, side_effect=GRPOTrainer.prepare) as prepare:
        try:
            record = tr.step()
        finally:
            tr.close()
    after = tr.model.state_dict()
    assert all(t.dtype == torch.float32 and t.device.type == "cuda" for t in after.values())
    assert all(torch.isfinite(t).all() for t in after.values())
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert moved, "the step left every weight as it was"
    m = record.metrics
    assert m["reward/zero_std_frac"] < 1.0  # some group's rewards differed: the loss had a gradient
    assert m["rollout/backend"] == "continuous"
    if dtype == "float32":
        tol = 1e-3
    else:  # the bound on the weights that sampled: a fresh load of the same seed, before the step moved them
        sampler = load_policy("tiny", dtype=torch.float32, device="cuda", seed=0).model
        tol = rounding_bound(sampler, prepare.call_args.args[1].completions, tr.config.temperature, torch.bfloat16)
        assert 1e-3 < tol < 1.0, tol
    print(f"GRPO step dtype={dtype}: logprob/max_abs_diff {m['logprob/max_abs_diff']:.2e}, bound {tol:.2e}")
    assert m["logprob/max_abs_diff"] < tol


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_weight_snapshots_of_a_gpu_model_live_where_their_place_says(where):
    """A model on the GPU: a "device" copy is on the GPU, a "host" copy in pinned CPU memory (none of the GPU's),
    and each comes back bitwise (bf16 too) into another model on the GPU."""
    from cbkit.train.snapshots import WeightSnapshots

    for dtype in (torch.float32, torch.bfloat16):
        model = load_policy("tiny", dtype=dtype, device="cuda", seed=0).model
        other = load_policy("tiny", dtype=dtype, device="cuda", seed=1).model
        start = {n: t.clone() for n, t in model.state_dict().items()}
        ring = WeightSnapshots(1, where)
        ring.append(0, model)
        if where != "disk":
            kept = ring._ring[0][1].values()
            assert all(t.device.type == ("cuda" if where == "device" else "cpu") for t in kept)
            assert where == "device" or all(t.is_pinned() for t in kept)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)  # the policy moves on; the snapshot must not
        ring.load_into(other)
        assert all(torch.equal(other.state_dict()[n], start[n]) for n in start)
        ring.close()


def _start_engine(model, pool, rows, new_tokens):
    """Start transformers' engine on `model` as cbkit's `Engine.run` does (its config, its attention, the workload
    hints) up to the pool being built: the engine's own admission check, on this GPU's own memory reading."""
    from cbkit.rollout.engine import Engine
    from cbkit.rollout.upstream import workload_hints

    engine = Engine(model, pool)
    cb = engine.config(rows, new_tokens, seed=0)
    gen = SamplingParams(max_new_tokens=new_tokens, eos_token_id=0, seed=0).generation_config()
    with engine._attention(cb):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb,
                                                 workload_hints=workload_hints(rows, new_tokens))
        try:
            processor = manager._create_batch_processor()
            return int(processor.cache.num_blocks)
        finally:
            manager.batch_processor = None
            manager.destroy()
            if hasattr(model, "_cached_continuous_batching_manager"):
                del model._cached_continuous_batching_manager


@pytest.mark.parametrize("machine", ["t4", "a100-40"])
@pytest.mark.parametrize("name", ["01_kv_slot_recycling", "03_n_sweep", "04_grpo_live", "05_off_policy"])
def test_each_tiers_pool_starts_where_the_admission_check_says(name, machine):
    """The notebook's fullest engine start on `machine` (`cbkit tiers`' plan), on this GPU with a ballast tensor
    leaving free what that GPU would have free there: the real engine starts exactly where cbkit's admission check
    (transformers' code on the meta device) said it would, and builds the pool it predicted. Then the same with
    cbkit's old gate (max_memory_percent 0.5 on a fixed pool), which the check refuses for 03 on a T4."""
    from transformers import AutoModelForCausalLM

    from cbkit.rollout.admission import admission
    from cbkit.rollout.engine_config import flash_versions
    from cbkit.teach.tiers import table
    from cbkit.teach.tiers.plan import plan_config, plan_notebook

    plan = plan_notebook(name, machine)
    start = min(plan.starts, key=lambda s: s.admission.available_bytes - s.admission.footprint_bytes)
    dtype = {4: torch.float32, 2: torch.float16 if machine == "t4" else torch.bfloat16}[start.dtype_bytes]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(plan_config(table.NOTEBOOKS[name].sizes[plan.tier].model),
                                                 dtype=dtype).eval()
    rows, new, what = [[1] * table.PROMPT_LEN] * start.requests, start.new_tokens, start.what
    tier_free = start.admission.available_bytes / 0.9  # what that GPU leaves free there (the check takes 0.9 of it)
    for pool in (plan.pool, {**plan.pool, "max_memory_percent": 0.5}):
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        if free < tier_free:
            pytest.skip(f"this GPU has {free / 2**30:.1f} GiB free, less than {machine}'s {tier_free / 2**30:.1f}")
        ballast = torch.empty(int(free - tier_free), dtype=torch.uint8, device="cuda")
        free, total = torch.cuda.mem_get_info()
        predicted = admission(model.config, pool, dtype=dtype, rows=rows, max_new_tokens=new, total_bytes=total,
                              used_bytes=total - free, capability=torch.cuda.get_device_capability(),
                              flash=flash_versions())
        try:
            started = _start_engine(model, pool, rows, new)
        except MemoryError:
            started = None
        finally:
            del ballast
        print(f"{name} {machine} {what} {pool.get('max_memory_percent', 'cbkit')}: {predicted.line()}; "
              f"engine built {started}")
        assert (started is not None) is predicted.fits
        assert started is None or started == predicted.num_blocks
