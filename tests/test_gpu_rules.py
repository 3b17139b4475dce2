"""The rules only a GPU exercises, checked on this CPU through transformers' own code with the GPU's conditions
patched in: the engine's admission check (its memory handler on a T4's or an A100's memory), the attention the engine
runs with (a device capability, flash-attn importable or not, the policy's dtype), and the engine settings cbkit
derives from them. Each test runs upstream's code, never a copy of its formula."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from cbkit.cli import main
from cbkit.rollout import engine_config
from cbkit.rollout.admission import admission
from cbkit.rollout.engine import Engine
from cbkit.rollout.engine_config import engine_attention, make_cb_config
from cbkit.rollout.upstream import workload_hints
from cbkit.rollout.varlen_attention import NAME as VARLEN
from cbkit.teach.tiers import table
from cbkit.teach.tiers.plan import parameter_count, plan_config, plan_notebook, pool_config

GiB = 2**30
T4, A100, H100 = (7, 5), (8, 0), (9, 0)


def _cb_fields() -> set[str]:
    from transformers import ContinuousBatchingConfig

    return {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}


# --- the engine settings ------------------------------------------------------------------------------------------


def test_a_fixed_pool_is_admitted_against_transformers_margin_not_cbkits_sizing_share():
    fixed = make_cb_config({"num_blocks": 100}, device=torch.device("cuda"))
    assert fixed.max_memory_percent == engine_config.FIXED_POOL_MEMORY_PERCENT
    # A share the user wrote stays theirs; without num_blocks the share sizes the pool, cbkit's 0.5.
    assert make_cb_config({"num_blocks": 100, "max_memory_percent": 0.3}).max_memory_percent == 0.3
    assert make_cb_config({}, device=torch.device("cuda")).max_memory_percent == 0.5


def test_pages_the_decode_kernel_cannot_take_turn_its_path_off_on_cuda():
    assert make_cb_config({"page_size": 32}, device=torch.device("cuda")).max_blocks_per_request == 0
    assert make_cb_config({"page_size": 512}, device=torch.device("cuda")).max_blocks_per_request is None
    assert make_cb_config({"page_size": 32, "max_blocks_per_request": 8},
                          device=torch.device("cuda")).max_blocks_per_request == 8


@pytest.mark.skipif("auto_switch_to_flash" not in _cb_fields(), reason="transformers < 5.2x has no such switch")
def test_cbkit_turns_the_engines_own_flash_switch_off():
    assert make_cb_config({}).auto_switch_to_flash is False


# --- the attention the engine runs with ---------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "capability", "dtype", "flash", "expected"), [
    ("cuda", T4, torch.float16, (2,), VARLEN),  # FA2 has no kernel below compute capability 8.0
    ("cuda", A100, torch.bfloat16, (2,), "flash_attention_2"),
    ("cuda", A100, torch.float32, (2,), VARLEN),  # a training policy's fp32 weights: flash-attn refuses them
    ("cuda", A100, torch.bfloat16, (), VARLEN),  # not installed (Colab's default image)
    ("cuda", H100, torch.bfloat16, (3, 2), "flash_attention_3"),
    ("cuda", H100, torch.bfloat16, (2,), "flash_attention_2"),
    ("cuda", A100, torch.bfloat16, (3, 2), "flash_attention_2"),  # FA3 is Hopper's
    ("cpu", None, torch.float32, (), VARLEN),
    ("cpu", None, torch.bfloat16, (3, 2), VARLEN),  # flash-attn is CUDA's, whatever is installed
])
def test_engine_attention_choice(device, capability, dtype, flash, expected):
    assert engine_attention(device, dtype, capability, flash) == expected
    # A model that needs the engine's own attention (a window, soft-capping) keeps it where no flash kernel runs.
    own = engine_attention(device, dtype, capability, flash, needs_own="a sliding window")
    assert own == (expected if expected.startswith("flash") else "sdpa")


def test_flash_versions_counts_no_hub_kernels():
    # With the `kernels` package, transformers' check answers yes by fetching hub kernels (kernels_fallback_ok=True):
    # cbkit asks for an installed flash-attn only. The checks answer here as where only the hub fallback exists.
    from transformers.utils import import_utils

    from cbkit.rollout.engine_config import flash_versions

    def hub_only(kernels_fallback_ok: bool = False) -> bool:
        return kernels_fallback_ok

    with (mock.patch.object(import_utils, "is_flash_attn_2_available", hub_only),
          mock.patch.object(import_utils, "is_flash_attn_3_available", hub_only)):
        assert flash_versions() == ()
        assert engine_attention("cuda", torch.bfloat16, A100) == VARLEN


@contextlib.contextmanager
def _flash_importable(versions: tuple[int, ...]):
    """transformers' import checks answering as on a machine with flash-attn `versions` installed: the engine's
    switch (continuous_api) and cbkit's `flash_versions` both ask them."""
    from transformers.generation.continuous_batching import continuous_api
    from transformers.utils import import_utils

    fa2, fa3 = (lambda *a, **k: 2 in versions), (lambda *a, **k: 3 in versions)
    with (mock.patch.object(continuous_api, "is_flash_attn_2_available", fa2),
          mock.patch.object(continuous_api, "is_flash_attn_3_available", fa3),
          mock.patch.object(import_utils, "is_flash_attn_2_available", fa2),
          mock.patch.object(import_utils, "is_flash_attn_3_available", fa3)):
        yield


def _engine_switch(model, cb) -> str:
    """What transformers' engine switches the model's attention to when it starts (its own
    `switch_to_cb_friendly_attn`), recording instead of loading a kernel this CPU does not have."""
    import inspect

    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    seen = {"impl": model.config._attn_implementation}
    manager = mock.Mock(_original_attn_impl=None)
    with mock.patch.object(model, "set_attn_implementation", lambda impl: seen.update(impl=impl)):
        switch = ContinuousBatchingManager.switch_to_cb_friendly_attn
        if "auto_switch_to_flash" in inspect.signature(switch).parameters:
            switch(manager, model, cb.auto_switch_to_flash)
        else:
            switch(manager, model)
    return seen["impl"]


def _engine_resolution(model, cb) -> tuple[bool, int, list[str]]:
    """What transformers' engine makes of the model's attention on a GPU, asked of its own code: whether it builds
    the dense block-diagonal mask (`attn_mask_is_needed`, the allocation in input_outputs.py), and the
    `max_blocks_per_request` its config resolution keeps, with CUDA present and every flash-attn kernel import it
    tries recorded (and answered with a kernel, as on a GPU that has one)."""
    from transformers.generation.continuous_batching import initialization
    from transformers.generation.continuous_batching.utils import attn_mask_is_needed

    imports: list[str] = []

    def lazy_import(impl, *a, **k):
        imports.append(impl)
        return (None, None, lambda *a, **k: None, None, None), (None, None)

    with (mock.patch("torch.cuda.is_available", return_value=True),
          mock.patch.object(initialization, "lazy_import_flash_attention", lazy_import)):
        resolved = initialization.resolve_continuous_batching_config(
            model.config, cb, workload_hints([[1] * 40] * 4, 40), has_logit_processors=True, device=torch.device("cuda"))
    return attn_mask_is_needed(model.config), resolved.max_blocks_per_request, imports


@pytest.mark.parametrize(("capability", "dtype", "importable", "expected"), [
    (T4, torch.float16, (2,), VARLEN),
    (A100, torch.float32, (2,), VARLEN),
    (A100, torch.bfloat16, (2,), "flash_attention_2"),
    (A100, torch.bfloat16, (), VARLEN),
    (H100, torch.bfloat16, (3, 2), "flash_attention_3"),
])
@pytest.mark.parametrize("page", [32, 256])
def test_the_engine_runs_cbkits_attention_and_builds_no_dense_mask(tiny, capability, dtype, importable, expected,
                                                                   page):
    # `Engine._attention` as `Engine.run` applies it on a GPU of `capability` with flash-attn `importable`; then
    # transformers' own switch (which would take flash-attn whenever importable), its mask rule and its decode-path
    # resolution, each asked what the engine does with the result.
    model = tiny.model
    with (_flash_importable(importable), mock.patch("torch.cuda.get_device_capability", return_value=capability),
          mock.patch.object(type(model), "device", property(lambda self: torch.device("cuda"))),
          mock.patch.object(type(model), "dtype", property(lambda self: dtype)),
          mock.patch.object(model, "set_attn_implementation",
                            lambda impl: setattr(model.config, "_attn_implementation", impl))):
        cb = make_cb_config({"page_size": page}, device=torch.device("cuda"))
        with Engine(model)._attention(cb):
            ran = _engine_switch(model, cb)
            dense_mask, blocks, imports = _engine_resolution(model, cb)
    assert ran == expected
    assert not dense_mask  # the issue: on a T4, for fp32 weights and without flash-attn the engine built one
    if expected == VARLEN:  # no flash-attn kernel is looked for, and the block-table path is off
        assert imports == [] and blocks == 0
    else:  # a real flash kernel keeps its block-table decode path where the pages fit it (make_cb_config)
        kernel_pages = page % 256 == 0
        assert imports == ([expected] if kernel_pages else []) and (blocks > 0) == kernel_pages
    assert model.config._attn_implementation == "sdpa"  # restored for the training forward


def test_a_model_that_needs_the_engines_own_attention_gets_its_dense_mask(tiny):
    # The one case left to the engine's SDPA and its mask: a model varlen cannot serve (here declared so), where no
    # flash kernel runs. transformers' own rule says the mask is built.
    model = tiny.model
    with (mock.patch("cbkit.rollout.varlen_attention.varlen_unsupported_reason", lambda m: "a sliding window"),
          mock.patch.object(type(model), "device", property(lambda self: torch.device("cuda"))),
          mock.patch("torch.cuda.get_device_capability", return_value=T4), pytest.warns(UserWarning, match="window")):
        cb = make_cb_config({}, device=torch.device("cuda"))
        with Engine(model)._attention(cb):
            ran = _engine_switch(model, cb)
            dense_mask, _, _ = _engine_resolution(model, cb)
    assert ran == "sdpa" and dense_mask


def test_cbkits_varlen_attention_refuses_cuda_graphs(tiny):
    model = tiny.model
    with mock.patch.object(type(model), "device", property(lambda self: torch.device("cuda"))):
        cb = make_cb_config({"use_cuda_graph": True}, device=torch.device("cuda"))
        with pytest.raises(ValueError, match="use_cuda_graph"), Engine(model, {"use_cuda_graph": True})._attention(cb):
            pass


def test_left_to_the_engine_a_t4_would_run_flash_attn(tiny):
    # The defect cbkit's choice removes: with flash-attn importable, transformers' own rule switches a half-precision
    # model to it whatever the GPU (FA2 has no kernel below compute capability 8.0: a T4 fails at the first forward),
    # and 5.24 switches fp32 weights too, which flash-attn refuses (5.25 checks the dtype).
    import copy

    from transformers import ContinuousBatchingConfig

    half = copy.deepcopy(tiny.model).half()
    with _flash_importable((2,)), mock.patch("torch.cuda.get_device_capability", return_value=T4):
        assert "flash" in _engine_switch(half, ContinuousBatchingConfig())
        assert engine_attention("cuda", torch.float16) == VARLEN


# --- the engine's admission check ---------------------------------------------------------------------------------


def _smollm2_t4_pool(percent: float | None) -> dict:
    """03's pool on a T4 (`pool_config`), with `max_memory_percent` as given (None: what cbkit sets)."""
    config = plan_config("smollm2-offline")
    pool = pool_config(config, table.NOTEBOOKS["03_n_sweep"].sizes["t4"], "t4", dtype_bytes=2)
    return {**pool, **({"max_memory_percent": percent} if percent is not None else {})}


def _t4_start(pool: dict):
    s = table.NOTEBOOKS["03_n_sweep"].sizes["t4"]
    return admission(plan_config(s.model), pool, dtype=torch.float16,
                     rows=[range(table.PROMPT_LEN)] * s.prompts * max(s.sweep_ns), max_new_tokens=s.max_new_tokens,
                     total_bytes=table.DEVICE_BYTES["t4"], used_bytes=GiB, capability=T4)


def _engines_own_attention():
    """`admission` as for a model cbkit's varlen attention cannot serve: the engine's SDPA and its dense mask."""
    return mock.patch("cbkit.rollout.admission.varlen_unsupported_reason", lambda config: "a sliding window")


def test_03s_t4_pool_is_refused_at_cbkits_old_share_and_admitted_now():
    # Issue 34, item 1: with num_blocks fixed, transformers still checks the pool, its buffers and SDPA's attention
    # mask against max_memory_percent x free memory. At 0.5 (cbkit's default share) a T4 refused the memory sweep's
    # pool (then 01's, now 03's: 01 no longer sweeps) under the engine's SDPA.
    with _engines_own_attention():
        refused = _t4_start(_smollm2_t4_pool(0.5))
        admitted = _t4_start(_smollm2_t4_pool(None))
    assert not refused.fits and "Memory footprint" in refused.error and refused.attention == "sdpa"
    assert admitted.fits and admitted.footprint_bytes == refused.footprint_bytes
    # Issue 40, item 5: cbkit's varlen attention runs on the T4 instead, and the engine's handler reserves no mask:
    # its footprint drops by the mask's bytes (PagedAttentionMemoryHandler.num_attention_masks = 0).
    varlen = _t4_start(_smollm2_t4_pool(None))
    assert varlen.attention == VARLEN and varlen.fits
    assert varlen.footprint_bytes < admitted.footprint_bytes


def test_the_admission_check_is_the_engines_own_at_the_boundary(tiny):
    # The same pool, checked on the meta device by `admission` and by a real engine start on this CPU, the memory
    # reading patched to the same numbers: both refuse below the footprint and both start above it.
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching import cache as cache_module

    pool = {"page_size": 32, "num_blocks": 40, "max_memory_percent": 1.0}
    rows = [[1] * 20] * 4
    used = 10 * 2**20
    need = admission(tiny.model.config, pool, dtype=torch.float32, rows=rows, max_new_tokens=8,
                     total_bytes=10 * GiB, used_bytes=used).footprint_bytes
    for total, starts in ((used + need - 1, False), (used + need + 1, True)):
        verdict = admission(tiny.model.config, pool, dtype=torch.float32, rows=rows, max_new_tokens=8,
                            total_bytes=total, used_bytes=used)
        assert verdict.fits is starts
        reading = (torch.device("cpu"), total, used, used)
        cb = make_cb_config(pool, device=torch.device("cpu"), rows=rows, max_new_tokens=8)
        # the attention `Engine.run` gives fp32 weights, as `admission` takes it
        with (mock.patch.object(cache_module, "get_device_and_memory_breakdown", lambda reading=reading: reading),
              Engine(tiny.model, pool)._attention(cb)):
            assert tiny.model.config._attn_implementation == verdict.attention
            try:
                manager = tiny.model.init_continuous_batching(generation_config=GenerationConfig(max_new_tokens=8),
                                                              continuous_batching_config=cb,
                                                              workload_hints=workload_hints(rows, 8))  # as Engine.run
                manager._create_batch_processor()
                started = True
            except MemoryError:
                started = False
            finally:
                manager.destroy()
                if hasattr(tiny.model, "_cached_continuous_batching_manager"):
                    del tiny.model._cached_continuous_batching_manager
        assert started is starts, (total, starts)


def test_cbkit_tiers_fails_where_the_engine_would_not_start(monkeypatch, capsys):
    # cbkit's old rules (the sizing share gating a fixed pool, the engine's SDPA on a T4) back in: the memory sweep's
    # largest point on a T4 refused, by the engine.
    monkeypatch.setattr(engine_config, "FIXED_POOL_MEMORY_PERCENT", 0.5)
    monkeypatch.setattr("cbkit.rollout.admission.varlen_unsupported_reason", lambda config: "a sliding window")
    assert main(["tiers", "--notebooks", "03_n_sweep", "--gpus", "t4"]) == 1
    out = capsys.readouterr().out
    largest = max(table.NOTEBOOKS["03_n_sweep"].sizes["t4"].sweep_ns)
    assert f"03_n_sweep on t4: the CB engine would not start for the rollout at N={largest}" in out
    assert "Memory footprint" in out


def test_every_engine_start_of_every_notebook_is_admitted():
    plans = [plan_notebook(n, m) for n in table.NOTEBOOKS for m in table.MACHINES]
    assert all(p.starts for p in plans)
    refused = [(p.notebook, p.machine, s.what) for p in plans for s in p.starts if not s.admission.fits]
    assert not refused
    # 04's step rollouts at their fullest point: with the trainer's state resident.
    p = plan_notebook("04_grpo_live", "t4")
    params = parameter_count(plan_config(table.GPU_MODEL))
    rollout = next(s for s in p.starts if "trainer's state resident" in s.what)
    # fp32 weights, gradients and AdamW's two moments (04 runs no async engine, so no snapshot beside them)
    assert rollout.resident_bytes == 16 * params


def test_05s_weight_copies_are_counted_where_the_tier_keeps_them(monkeypatch):
    """On a T4 05's seven copies go to files: neither the GPU nor a Colab runtime's RAM holds them. In host memory
    (the old place) they are over the runtime's RAM and `cbkit tiers` says so; on the GPU over its memory."""
    from cbkit.train import snapshots

    params = parameter_count(plan_config(table.GPU_MODEL))
    on_disk = plan_notebook("05_off_policy", "t4")
    assert not on_disk.problems() and not any(k.startswith("copies") for k in on_disk.parts)
    assert on_disk.host_bytes == 3 * 4 * params  # only section 2's three state dicts on the CPU
    monkeypatch.setitem(snapshots.TIER_PLACES, "t4", "host")
    on_host = plan_notebook("05_off_policy", "t4")
    assert on_host.peak_bytes == on_disk.peak_bytes and on_host.host_bytes == (7 + 3) * 4 * params
    assert on_host.host_bytes > 12.7e9 and on_host.problems()  # Colab's advertised 12.7 GB of RAM
    assert "does not fit in host RAM" in on_host.problems()[0]
    assert main(["tiers", "--notebooks", "05_off_policy", "--gpus", "t4"]) == 1
    monkeypatch.setitem(snapshots.TIER_PLACES, "t4", "device")  # the same copies on a T4's GPU: they do not fit
    on_gpu = plan_notebook("05_off_policy", "t4")
    copies = next(v for k, v in on_gpu.parts.items() if k.startswith("copies"))
    assert copies == 7 * 4 * params
    assert "does not fit:" in on_gpu.problems()[0]


def test_a_planned_copy_is_what_a_snapshot_keeps_of_the_tier_model():
    """The plan prices a copy of Qwen2.5-0.5B at 4 bytes a parameter, its tied embedding once: what a snapshot keeps
    (tests/test_offpolicy.py), counted here on the model transformers builds from the tier's config on the meta device
    (no weights): its distinct parameters, within the norms and biases `parameter_count` leaves out."""
    import transformers

    config = plan_config(table.GPU_MODEL)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    built = sum(p.numel() for p in model.parameters())  # a tied parameter once
    assert 0.99 * built < parameter_count(config) <= built
    assert sum(t.numel() for t in state.values()) > 1.2 * built  # what a copy of every name would have kept


def test_the_t4_is_planned_at_what_cuda_reports_with_slack_in_every_notebook():
    """A Colab T4 reports ~14.74 GiB (issue 40), not the datasheet's 15: every T4 plan is made against that less the
    CUDA context, and each notebook leaves at least 1.5 GiB of it free."""
    plans = [plan_notebook(n, "t4") for n in table.NOTEBOOKS]
    assert all(p.memory_bytes == int(14.74 * GiB) - table.CUDA_CONTEXT_BYTES for p in plans)
    assert min(p.memory_bytes - p.peak_bytes for p in plans) >= 1.5 * GiB


def test_the_held_trainer_state_is_what_adamw_keeps_after_trls_bf16_cast():
    """TRL under bf16 with CB casts the policy to bf16 in place; one real backward and torch's AdamW step on a bf16
    model then hold its gradients and two moments: the bytes the sweep holds (`trainer_state_bytes`), 6 a parameter."""
    from cbkit.measure.sweep_config import trainer_state_bytes
    from cbkit.models.load import load_policy

    model = load_policy("tiny", seed=0).model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    opt.step()
    held = sum(p.grad.nbytes for p in model.parameters()) + sum(
        t.nbytes for state in opt.state.values() for t in state.values() if t.dim() > 0)  # the step count is a scalar
    params = sum(p.numel() for p in model.parameters())
    assert trainer_state_bytes(model) == held == 6 * params


@pytest.mark.parametrize(("model", "dtype", "pool"), [
    ("smollm2-offline", torch.float16, {"page_size": 32, "num_blocks": 2000}),
    ("smollm2-offline", torch.float16, {}),
    (table.GPU_MODEL, torch.float32, {"page_size": 32, "num_blocks": 900}),
    ("llama-1b-random", torch.bfloat16, {"max_memory_percent": 0.4}),
])
@pytest.mark.parametrize("flash", [(), (2,)])
def test_the_planners_engine_budget_is_the_engines_own(model, dtype, pool, flash):
    # The planner's CB pool is the one pool model's (`admission`), given the budget as the free memory and the
    # attention it names: for the same pool, memory and attention it reserves what the engine check says.
    from cbkit.measure.planner import plan

    config = plan_config(model)
    free = 20 * GiB
    verdict = admission(config, pool, dtype=dtype, rows=[range(132)] * 64, max_new_tokens=512, total_bytes=free + GiB,
                        used_bytes=GiB, capability=A100, flash=flash)
    words = {VARLEN: "varlen", "sdpa": "sdpa"}
    planned = plan(config, num_prompts=8, num_generations=8, prompt_len=132, max_new_tokens=512,
                   dtype_bytes=dtype.itemsize, budget_bytes=free, cb_config=pool, device="cuda",
                   attn_implementation=words.get(verdict.attention, "flash"))
    assert planned.continuous.engine_reserved_bytes == verdict.footprint_bytes
    assert planned.continuous.num_blocks == verdict.num_blocks
    if not flash:  # the planner's own default is the engine's decision where no flash-attn is installed
        default = plan(config, num_prompts=8, num_generations=8, prompt_len=132, max_new_tokens=512,
                       dtype_bytes=dtype.itemsize, budget_bytes=free, cb_config=pool, device="cuda")
        assert default.continuous.engine_reserved_bytes == verdict.footprint_bytes


def test_what_the_pool_model_reads_of_the_engines_cache_beyond_the_admission_check():
    # cbkit.rollout.admission.admission also reads the mask the memory handler reserves and the cache tensor it builds
    # (the planner's CB peak): pinned here beside the names tests/test_engine_contract.py pins.
    import inspect

    from transformers.generation.continuous_batching import cache

    assert list(inspect.signature(cache.PagedAttentionMemoryHandler.attention_mask_bytes).parameters) == [
        "self", "max_batch_tokens", "num_sectors"], "PagedAttentionMemoryHandler.attention_mask_bytes(M, S)"
    assert "self.cache_tensor = " in inspect.getsource(cache.PagedAttentionCache.__init__), \
        "PagedAttentionCache.cache_tensor"
