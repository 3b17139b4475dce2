"""Pin what cbkit uses of transformers' CB engine, so an upgrade that moves it fails here, loudly, by name.

Like TRL's TestTransformersContinuousBatchingContract: the public entry points' arguments, and every private name
`cbkit.rollout.upstream` reaches (`upstream.PINNED`, read from its docstring), each pinned on a real manager of the
tiny model. The last tests keep those names in that one module. After an upgrade, fix `upstream.py` to the new API,
then the pin.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, ContinuousMixin
from transformers.generation.continuous_batching.requests import GenerationOutput

import cbkit
from cbkit.rollout import SamplingParams, upstream
from cbkit.rollout.engine import Engine
from cbkit.rollout.engine_config import make_cb_config
from cbkit.rollout.upstream import PINNED, watch_batches, workload_hints


def pin(ok: bool, what: str) -> None:
    assert ok, (f"transformers {transformers.__version__}: {what} is gone or has changed; cbkit/rollout/upstream.py "
                "relies on it (its docstring lists what it reaches). Fix it to the new API, then this pin.")


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
    pin("page_size" in fields, "ContinuousBatchingConfig.page_size")


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
    for name in ("is_running", "start", "destroy", "pause", "warmup"):
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


@pytest.fixture(scope="module")
def engine_objects(tiny):
    """A real manager on the tiny model with one batch prepared (no thread), and every object `PINNED` names."""
    model, tok = tiny.model, tiny.tokenizer
    gen = SamplingParams(max_new_tokens=3, eos_token_id=tok.eos_token_id, seed=0).generation_config()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=make_cb_config(
        device=model.device, rows=[[1] * 8], max_new_tokens=3))
    processor = manager.batch_processor = manager._create_batch_processor()
    try:
        manager.add_request([1] * 8, max_new_tokens=3)
        processor.prepare_next_batch()
        future = processor.inputs_and_outputs.requests_in_batch[0]
        from transformers.generation.continuous_batching import cache

        yield {"model": model, "manager": manager, "helper": manager.distributed_helper, "processor": processor,
               "cache": processor.cache, "allocator": next(iter(processor.cache.cache_allocators.values())),
               "io": processor.inputs_and_outputs, "future": future, "state": future.state,
               "handler": cache.PagedAttentionMemoryHandler, "transformers": transformers,
               "cb": transformers.generation.continuous_batching}
    finally:
        manager.batch_processor = None
        model.set_attn_implementation(manager._original_attn_impl)
        manager.destroy()


# Set in a method, not on the object `engine_objects` holds: pinned in the source that sets them.
SET_IN = {"model._cached_continuous_batching_manager": ContinuousMixin.init_continuous_batching,
          "handler.available_memory": "cache.PagedAttentionMemoryHandler.__init__"}


@pytest.mark.parametrize("name", PINNED)
def test_each_private_name_cbkit_reaches(engine_objects, name):
    root, *path, attr = name.split(".")
    where = SET_IN.get(name)
    if where is not None:
        if isinstance(where, str):
            module, *rest = where.split(".")
            where = importlib.import_module(f"transformers.generation.continuous_batching.{module}")
            for part in rest:
                where = getattr(where, part)
        pin(attr in inspect.getsource(where), name)
        return
    obj = engine_objects[root]
    for part in path:
        obj = getattr(obj, part, None) or importlib.import_module(f"{obj.__name__}.{part}")
    pin(hasattr(obj, attr), name)


def test_the_pinned_list_is_the_upstream_docstrings():
    assert len(PINNED) == len(set(PINNED)) > 30 and all(f"`{n}`" in upstream.__doc__ for n in PINNED)


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
    pin(sorted((r.prompt_len, r.past_len, r.query_len) for r in first) ==
        sorted((len(p), 0, len(p)) for p in prompts),
        "inputs_and_outputs.requests_in_batch (future.state.position_offset / initial_tokens, future.query_length)")
    last = batches[-1][0]
    assert all(r.query_len == 1 and r.past_len >= r.prompt_len for r in last)
    # Each request holds its own blocks (two different prompts share none) and the page size is the engine's.
    tables = [r.blocks for r in last]
    assert all(tables) and not set(tables[0]) & set(tables[1]) and page == 32 and pool > 0


def test_watching_batches_puts_the_engine_back():
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    before = ContinuousBatchProcessor.prepare_next_batch
    with watch_batches(lambda *a: None):
        assert ContinuousBatchProcessor.prepare_next_batch is not before
    assert ContinuousBatchProcessor.prepare_next_batch is before


# The private names above, as they appear in code (the distinctive ones), and the public entry points that build a
# manager: the first only in upstream.py, the second only there and in engine.py, which owns the manager.
PRIVATE = {n.rsplit(".", 1)[1] for n in PINNED} - {"model", "reset", "clear", "cache", "state", "request_id",
                                                   "num_blocks", "max_batch_tokens", "query_length"}
ENTRY = {"init_continuous_batching", "continuous_batching_context_manager", "generate_batch"}
ROLLOUT = Path(cbkit.__file__).parent / "rollout"


def _uses(path: Path, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")  # getattr(x, "name")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "transformers.generation.continuous_batching."):
            found.append(f"{path.name}:{node.lineno} from {node.module}")
    return found


@pytest.mark.parametrize("path", sorted(p for p in Path(cbkit.__file__).parent.rglob("*.py")
                                        if p != ROLLOUT / "upstream.py"),
                         ids=lambda p: str(p.relative_to(Path(cbkit.__file__).parent)))
def test_only_upstream_reaches_inside_the_engine(path):
    names = PRIVATE if path == ROLLOUT / "engine.py" else PRIVATE | ENTRY
    assert not _uses(path, names), (f"{path} reaches transformers' CB internals {_uses(path, names)}: go through "
                                    "cbkit.rollout.upstream (pinned here) or cbkit.rollout.engine, which owns the manager")


def test_the_internals_check_sees_upstream():
    uses = _uses(ROLLOUT / "upstream.py", PRIVATE)
    assert any("_use_prefix_sharing" in u for u in uses) and any("from transformers.generation" in u for u in uses)


def test_the_arguments_upstream_passes_its_internals():
    """`upstream.engine_footprint` (the admission check) calls the engine's config resolution and builds its cache on
    the meta device; the async engine orders its copies against the async IOs' stream (a GPU's; pinned in source)."""
    from transformers.generation.continuous_batching import cache, initialization
    from transformers.generation.continuous_batching.distributed import DistributedHelper
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs

    pin({"config", "continuous_batching_config", "device", "distributed_helper", "dtype",
         "model_supports_logits_to_keep"} <= _params(cache.PagedAttentionCache.__init__), "PagedAttentionCache's arguments")
    pin(len(_params(cache.PagedAttentionMemoryHandler._check_footprint)) == 3,
        "PagedAttentionMemoryHandler._check_footprint(max_batch_tokens, num_...)")
    pin({"config", "cb_config", "workload_hints", "has_logit_processors", "device"} <= _params(
        initialization.resolve_continuous_batching_config), "initialization.resolve_continuous_batching_config")
    pin({"device_mesh", "cpu_group_timeout", "tp_plan"} <= _params(DistributedHelper.__init__),
        "DistributedHelper's arguments")
    pin("lazy_import_flash_attention(" in inspect.getsource(initialization.ensure_decode_fast_path_is_available),
        "initialization.lazy_import_flash_attention (the decode path's kernel check, answered as on a GPU)")
    pin("self.compute_stream" in inspect.getsource(ContinuousBatchingAsyncIOs.__init__),
        "ContinuousBatchingAsyncIOs.compute_stream")


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
