"""Pin the transformers CB API cbkit calls, so an upgrade that moves it fails here, loudly, by name.

Like TRL's TestTransformersContinuousBatchingContract: signatures and fields, not behaviour (the rollout
tests cover behaviour). If one of these fails after an upgrade, fix cbkit/rollout/continuous.py to the new
API, then update the pin.
"""

from __future__ import annotations

import dataclasses
import inspect

import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager, ContinuousMixin
from transformers.generation.continuous_batching.requests import GenerationOutput

import cbkit.rollout.continuous as cb


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_transformers_version_in_supported_range():
    v = Version(transformers.__version__)
    assert Version("5.9") <= v < Version("6"), f"cbkit supports transformers >=5.9,<6; found {v}"


def test_cb_config_has_the_fields_cbkit_sets():
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert {"return_logprobs", "max_memory_percent", "use_cuda_graph", "seed", "num_blocks",
            "max_batch_tokens"} <= fields
    assert fields & {"page_size", "block_size"}, "neither page_size nor block_size: the pool's page field moved"
    assert set(cb.cb_config_keys()) == fields


def test_cbkit_defaults_reach_the_engine_config():
    cfg = cb.make_cb_config({"max_memory_percent": 0.4}, seed=7)
    assert cfg.return_logprobs is True and cfg.max_memory_percent == 0.4 and cfg.seed == 7
    assert cfg.use_cuda_graph is False  # cbkit's default; TRL's CB default sets only max_memory_percent=0.5
    assert cb.make_cb_config().max_memory_percent == 0.5


def test_entry_points_and_their_arguments():
    assert {"generation_config", "continuous_batching_config", "block", "timeout", "workload_hints"} <= _params(
        ContinuousMixin.continuous_batching_context_manager
    )
    assert {"inputs", "generation_config", "continuous_batching_config", "record_timestamps"} <= _params(
        ContinuousMixin.generate_batch
    )
    assert {"inputs", "max_new_tokens", "record_timestamps"} <= _params(ContinuousBatchingManager.add_requests)
    assert {"timeout"} <= _params(ContinuousBatchingManager.get_result)
    assert callable(ContinuousBatchingManager.is_running)
    assert hasattr(transformers.LlamaForCausalLM, "continuous_batching_context_manager")


def test_generation_output_fields():
    fields = {f.name for f in dataclasses.fields(GenerationOutput)}
    assert {"request_id", "prompt_ids", "generated_tokens", "logprobs", "error", "status", "timestamps"} <= fields
    assert callable(GenerationOutput.is_finished)


def test_generation_config_accepts_what_sampling_params_builds():
    from cbkit.rollout import SamplingParams

    gc = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, eos_token_id=2, max_new_tokens=8).generation_config()
    assert isinstance(gc, GenerationConfig)
    assert (gc.do_sample, gc.temperature, gc.top_k, gc.top_p, gc.eos_token_id) == (True, 0.7, 20, 0.9, 2)
