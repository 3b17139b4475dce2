"""Pin what cbkit uses of transformers' CB engine, so an upgrade that moves it fails here, loudly, by name.

Like TRL's TestTransformersContinuousBatchingContract: names, signatures and fields (the rollout tests cover
behaviour). The engine's modules (`ENGINE_MODULES`: rollout/engine.py and the three it is split into) are the only
ones that touch the engine's internals, and engine.py's docstring lists them; every pin below says which transformers
version it failed on. After an upgrade, fix those modules to the new API, then the pin. The last tests keep the
internals in those modules: no other module of cbkit reaches them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, ContinuousMixin
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs
from transformers.generation.continuous_batching.requests import GenerationOutput

import cbkit
from cbkit.rollout import SamplingParams
from cbkit.rollout.engine import Engine
from cbkit.rollout.engine_config import cb_config_keys, make_cb_config
from cbkit.rollout.engine_io import compute_stream, watch_batches, workload_hints


def pin(ok: bool, what: str) -> None:
    assert ok, (f"transformers {transformers.__version__}: {what} is gone or has changed; cbkit/rollout/engine.py "
                "and its modules rely on it (its docstring lists what they use). Fix them to the new API, then this pin.")


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_transformers_version_in_supported_range():
    v = Version(transformers.__version__)
    assert Version("5.24") <= v < Version("6"), f"cbkit supports transformers >=5.24,<6; found {v}"


def test_cb_config_has_the_fields_cbkit_sets():
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    pin({"return_logprobs", "max_memory_percent", "use_cuda_graph", "seed", "num_blocks", "max_batch_tokens",
         "allow_block_sharing", "max_blocks_per_request", "use_async_batching"} <= fields,
        f"ContinuousBatchingConfig's fields ({sorted(fields)})")
    pin(bool(fields & {"page_size", "block_size"}), "ContinuousBatchingConfig.page_size (block_size in 5.17.0)")
    assert set(cb_config_keys()) == fields


@pytest.mark.parametrize("spelling", ["page_size", "block_size"])
def test_a_page_size_under_either_name_reaches_the_engine(spelling):
    """cbkit writes page_size (5.24.0's name), 5.17.0 knows only block_size: either reaches the installed field."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    installed = "page_size" if "page_size" in fields else "block_size"
    assert getattr(make_cb_config({spelling: 16}), installed) == 16
    with pytest.raises(ValueError, match="are one setting"):
        make_cb_config({"page_size": 16, "block_size": 32})


def test_cbkit_defaults_reach_the_engine_config():
    cfg = make_cb_config({"max_memory_percent": 0.4}, seed=7)
    assert cfg.return_logprobs is True and cfg.max_memory_percent == 0.4 and cfg.seed == 7
    assert cfg.use_cuda_graph is False  # cbkit's default; TRL's CB default sets only max_memory_percent=0.5
    assert make_cb_config().max_memory_percent == 0.5


def test_entry_points_and_their_arguments():
    pin({"generation_config", "continuous_batching_config", "workload_hints"} <= _params(
        ContinuousMixin.init_continuous_batching), "ContinuousMixin.init_continuous_batching's arguments")
    pin({"generation_config", "continuous_batching_config", "block", "timeout", "persistent_manager", "warmup",
         "workload_hints"} <= _params(ContinuousMixin.continuous_batching_context_manager),
        "ContinuousMixin.continuous_batching_context_manager's arguments")
    # A kept manager lives on the model under this name; init_continuous_batching hands it to whoever asks next.
    pin("_cached_continuous_batching_manager" in inspect.getsource(ContinuousMixin.init_continuous_batching),
        "the model attribute _cached_continuous_batching_manager")
    pin({"inputs", "max_new_tokens", "record_timestamps"} <= _params(ContinuousBatchingManager.add_requests),
        "ContinuousBatchingManager.add_requests' arguments")
    pin({"input_ids", "request_id", "max_new_tokens", "eos_token_id", "record_timestamps"} <= _params(
        ContinuousBatchingManager.add_request), "ContinuousBatchingManager.add_request's arguments")
    pin({"timeout"} <= _params(ContinuousBatchingManager.get_result), "ContinuousBatchingManager.get_result")
    pin({"keep_for_next_session", "block", "timeout"} <= _params(ContinuousBatchingManager.stop),
        "ContinuousBatchingManager.stop's arguments")
    for name in ("is_running", "start", "destroy", "pause", "warmup", "_create_batch_processor", "_generation_step"):
        pin(callable(getattr(ContinuousBatchingManager, name, None)), f"ContinuousBatchingManager.{name}")
    pin(hasattr(transformers.LlamaForCausalLM, "continuous_batching_context_manager"),
        "the models' continuous_batching_context_manager")


def test_generation_output_fields():
    fields = {f.name for f in dataclasses.fields(GenerationOutput)}
    pin({"request_id", "generated_tokens", "logprobs", "error", "timestamps"} <= fields,
        f"GenerationOutput's fields ({sorted(fields)})")
    pin(callable(GenerationOutput.is_finished), "GenerationOutput.is_finished")
    pin(hasattr(GenerationOutput, "lifespan"), "GenerationOutput.lifespan")


def test_workload_hints_fields():
    hints = workload_hints([[1, 2, 3]], 5)
    pin(hints is not None and (hints.max_prompt_length, hints.max_generated_length) == (3, 5),
        "transformers.generation.continuous_batching.utils.WorkloadHints")


def test_generation_config_accepts_what_sampling_params_builds():
    gc = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, eos_token_id=2, max_new_tokens=8).generation_config()
    assert isinstance(gc, GenerationConfig)
    assert (gc.do_sample, gc.temperature, gc.top_k, gc.top_p, gc.eos_token_id) == (True, 0.7, 20, 0.9, 2)


def test_the_manager_and_processor_internals(tiny):
    """A real manager on the tiny model: every attribute the caller's loop, `_own`, `forget_cached_kv`, `_reseed`
    and `resolved_config` read, and what a scheduled batch holds (`scheduled`, read by the trace and async)."""
    model, tok = tiny.model, tiny.tokenizer
    gen = SamplingParams(max_new_tokens=3, eos_token_id=tok.eos_token_id, seed=0).generation_config()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=make_cb_config(
        device=model.device, rows=[[1] * 8], max_new_tokens=3))
    try:
        for name in ("_original_attn_impl", "_use_prefix_sharing", "batch_processor", "input_queue", "warmed_up",
                     "is_tp_driver", "continuous_batching_config", "model"):
            pin(hasattr(manager, name), f"ContinuousBatchingManager.{name}")
        status = manager.background_thread_status
        pin(callable(getattr(status, "clear", None)) and callable(getattr(status, "mark_as_stopped", None)),
            "ContinuousBatchingManager.background_thread_status.clear / mark_as_stopped")
        pin(hasattr(manager.output_router, "output_queue"), "ContinuousBatchingManager.output_router.output_queue")
        pin(callable(getattr(manager.distributed_helper, "set_tp_seed", None)),
            "ContinuousBatchingManager.distributed_helper.set_tp_seed")
        processor = manager._create_batch_processor()
        for name in ("prepare_next_batch", "update_batch", "inputs_and_outputs", "cache"):
            pin(hasattr(processor, name), f"ContinuousBatchProcessor.{name}")
        # The stream the forwards run on, which AsyncEngine.publish orders its copies against: None on a CPU, on the
        # async-batching IOs too (which only a GPU can build; its source is pinned instead).
        pin(hasattr(processor.inputs_and_outputs, "compute_stream"), "ContinuousBatchProcessor.inputs_and_outputs"
            ".compute_stream")
        pin("self.compute_stream" in inspect.getsource(ContinuousBatchingAsyncIOs.__init__),
            "ContinuousBatchingAsyncIOs.compute_stream")
        manager.batch_processor = processor
        assert compute_stream(manager) is None and compute_stream(None) is None
        cache = processor.cache
        pin(callable(getattr(cache, "reset", None)) and isinstance(cache.num_blocks, int), "PagedAttentionCache")
        allocator = next(iter(cache.cache_allocators.values()))
        pin(hasattr(allocator, "block_table") and isinstance(allocator.tokens_per_page, int),
            "PagedAttentionCache.cache_allocators[...].block_table / tokens_per_page")
    finally:
        manager.batch_processor = None
        model.set_attn_implementation(manager._original_attn_impl)
        manager.destroy()


def test_a_scheduled_batch_reads_as_requests_in_positions(tiny):
    """The first batch prefills each prompt from position 0 (one chunk: the prompts are short), later ones decode
    one token each, each request from blocks of its own (CPU pages: 32 tokens)."""
    model, tok = tiny.model, tiny.tokenizer
    prompts = [tok("hi")["input_ids"], tok("what is 12 + 30?")["input_ids"]]
    batches = []
    with watch_batches(lambda requests, pool, page: batches.append((requests, pool, page))):
        Engine(model).run([list(p) for p in prompts], SamplingParams(max_new_tokens=4, eos_token_id=tok.eos_token_id, seed=0)
                          .generation_config(), max_new_tokens=4, seed=0)
    pin(len(batches) >= 4, "ContinuousBatchProcessor.prepare_next_batch (no batch was seen)")
    first, pool, page = batches[0]
    pin(sorted((len(r.prompt), r.past_len, r.query_len) for r in first) ==
        sorted((len(p), 0, len(p)) for p in prompts),
        "inputs_and_outputs.requests_in_batch (future.state.position_offset / initial_tokens, future.query_length)")
    last = batches[-1][0]
    assert all(r.query_len == 1 and r.past_len >= len(r.prompt) for r in last)
    # Each request holds its own blocks (two different prompts share none) and the page size is the engine's.
    tables = [r.blocks for r in last]
    assert all(tables) and not set(tables[0]) & set(tables[1]) and page == 32 and pool > 0


def test_watching_batches_puts_the_engine_back():
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    before = ContinuousBatchProcessor.prepare_next_batch
    with watch_batches(lambda *a: None):
        assert ContinuousBatchProcessor.prepare_next_batch is not before
    assert ContinuousBatchProcessor.prepare_next_batch is before


# Attributes and modules of transformers' CB engine that are not its public entry points (add_requests & co.).
INTERNALS = {"_generation_step", "_create_batch_processor", "_original_attn_impl", "_cached_continuous_batching_manager",
             "_use_prefix_sharing", "batch_processor", "background_thread_status", "output_router", "input_queue",
             "distributed_helper", "requests_in_batch", "inputs_and_outputs", "cache_allocators", "block_table",
             "init_continuous_batching", "continuous_batching_context_manager", "generate_batch", "warmed_up",
             "compute_stream"}


def _internal_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in INTERNALS:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")  # getattr(x, "name")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "transformers.generation.continuous_batching"):
            found.append(f"{path.name}:{node.lineno} from {node.module}")
    return found


# The engine, split by concept: the class and its manager (engine.py), who runs the loop, what goes in and out, and
# the admission check. These alone reach transformers' CB internals.
ENGINE_MODULES = ("engine.py", "engine_loops.py", "engine_io.py", "admission.py")
ROLLOUT = Path(cbkit.__file__).parent / "rollout"


@pytest.mark.parametrize("path", sorted(p for p in Path(cbkit.__file__).parent.rglob("*.py")
                                        if not (p.parent == ROLLOUT and p.name in ENGINE_MODULES)),
                         ids=lambda p: str(p.relative_to(Path(cbkit.__file__).parent)))
def test_only_the_engine_modules_reach_inside_the_engine(path):
    assert not _internal_uses(path), (f"{path} uses transformers' CB internals {_internal_uses(path)}: go through "
                                      "cbkit.rollout.engine, which owns the manager (and tests/test_engine_contract.py)")


def test_the_internals_check_sees_each_engine_module():
    uses = {name: _internal_uses(ROLLOUT / name) for name in ENGINE_MODULES}
    assert all(uses.values()), f"an engine module reaches no internal: drop it from ENGINE_MODULES ({uses})"
    assert any("_generation_step" in u for u in uses["engine_loops.py"])
    assert any("from transformers.generation" in u for u in uses["admission.py"])


def test_what_the_admission_check_builds_on():
    # cbkit.rollout.admission.admission: the engine's config resolution, then its cache built on the meta device with its
    # memory reading patched; the footprint read where the handler checks it.
    from transformers.generation.continuous_batching import cache, initialization
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    pin(callable(getattr(cache, "get_device_and_memory_breakdown", None)),
        "continuous_batching.cache.get_device_and_memory_breakdown (the handler's memory reading, looked up there)")
    pin({"config", "continuous_batching_config", "device", "distributed_helper", "dtype"} <= _params(
        cache.PagedAttentionCache.__init__), "PagedAttentionCache's arguments")
    pin("self.num_blocks" in inspect.getsource(cache.PagedAttentionCache.__init__), "PagedAttentionCache.num_blocks")
    handler = cache.PagedAttentionMemoryHandler
    pin(len(_params(handler._check_footprint)) == 3 and callable(getattr(handler, "compute_memory_footprint", None)),
        "PagedAttentionMemoryHandler._check_footprint(max_batch_tokens, num_...) and compute_memory_footprint")
    pin("self.available_memory" in inspect.getsource(handler.__init__), "PagedAttentionMemoryHandler.available_memory")
    pin({"config", "cb_config", "workload_hints", "has_logit_processors"} <= _params(
        initialization.resolve_continuous_batching_config), "initialization.resolve_continuous_batching_config")
    pin({"device_mesh", "cpu_group_timeout"} <= _params(DistributedHelper.__init__), "DistributedHelper's arguments")
    pin("lazy_import_flash_attention(" in inspect.getsource(initialization.ensure_decode_fast_path_is_available),
        "initialization.lazy_import_flash_attention (the decode path's kernel check, answered as on a GPU)")
    # The attention switch cbkit steers (cbkit.rollout.engine.attention_for_engine).
    pin(callable(getattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)),
        "ContinuousBatchingManager.switch_to_cb_friendly_attn")


def test_how_the_engine_recognises_a_varlen_attention():
    # cbkit's varlen attention (cbkit/rollout/varlen_attention.py) is registered under a name the engine treats as
    # flash, so it builds no dense mask and hands over the sequence boundaries, and without a version digit, so it
    # never looks for flash-attn's block-table kernel. Both decided by these functions, by name.
    from transformers.generation.continuous_batching import initialization
    from transformers.generation.continuous_batching.utils import attn_mask_is_needed
    from transformers.utils import import_utils
    from transformers.utils.generic import is_flash_attention_requested

    from cbkit.rollout.varlen_attention import NAME

    config = type("Config", (), {"_attn_implementation": NAME})()
    pin(not attn_mask_is_needed(config), "continuous_batching.utils.attn_mask_is_needed (sdpa/eager only)")
    pin(is_flash_attention_requested(requested_attention_implementation=NAME)
        and not is_flash_attention_requested(requested_attention_implementation=NAME, version=[2, 3]),
        "utils.generic.is_flash_attention_requested ('flash' in the name; a version by 'flash...N')")
    pin("is_flash_attention_requested(config, version=[2, 3])" in inspect.getsource(
        initialization.ensure_decode_fast_path_is_available), "the decode path's flash-attn check by version")
    # cbkit.rollout.engine_config.flash_versions asks for an installed flash-attn only (no hub kernels).
    for check in (import_utils.is_flash_attn_2_available, import_utils.is_flash_attn_3_available):
        pin("kernels_fallback_ok" in _params(check), f"import_utils.{check.__name__}(kernels_fallback_ok=...)")
