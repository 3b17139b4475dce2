"""Sampling comes from the rollout's settings alone: no field of the model's own `generation_config` changes it.

Checkpoints ship generation advice for chat (Qwen2.5-Instruct: repetition_penalty=1.05). `generate()` fills every
field its config leaves unset from the model's, so before `rollout_generation_config` the static batch sampled
under it while the loss assumed temperature / top-k / top-p alone (repetition_penalty=1.3 put the sampling
logprobs 0.98 nats from the policy's). For each field that would change the distribution (transformers'
`_get_logits_processor`, plus beams, extra sequences, stop strings, a time limit), set on the tiny model, both
backends must still sample what a teacher-forced forward at the rollout's own temperature says.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import warnings
from unittest import mock

import pytest
from transformers import GenerationConfig, WatermarkingConfig

from cbkit.rollout import SamplingParams, make_backend
from cbkit.rollout.generate import GENERATION_CONFIG_KEPT, rollout_generation_config
from tests.helpers import max_logprob_diff

ATOL = 1e-4
TEMPERATURE = 1.0


# Each field with a value that changes the distribution of the tiny model's next tokens (or, for the fields that only
# apply to encoder-decoder models or to the first position, would, on a model where they apply). Token ids are the
# tiny byte tokenizer's: 71 "h", 86 "w", 258 its EOS.
FIELDS = {
    "repetition_penalty": 1.3, "no_repeat_ngram_size": 1, "encoder_repetition_penalty": 1.3,
    "encoder_no_repeat_ngram_size": 1, "typical_p": 0.5, "min_p": 0.2, "top_h": 0.5, "epsilon_cutoff": 0.05,
    "eta_cutoff": 0.05, "top_k": 5, "top_p": 0.5, "temperature": 0.5, "bad_words_ids": [[71], [86]],
    "suppress_tokens": list(range(60, 120)), "begin_suppress_tokens": list(range(60, 120)),
    "sequence_bias": {(71,): 5.0}, "min_new_tokens": 6, "min_length": 40, "forced_eos_token_id": 258,
    "forced_bos_token_id": 71, "exponential_decay_length_penalty": (1, 3.0), "renormalize_logits": True,
    "remove_invalid_values": True, "guidance_scale": 1.5, "num_beams": 2, "num_return_sequences": 2,
    "max_time": 1e-6, "stop_strings": ["a"], "do_sample": False, "watermarking_config": WatermarkingConfig(bias=5.0),
}


@pytest.fixture(scope="module")
def policy():
    from cbkit.models.load import load_policy

    return load_policy("tiny", seed=0)


def _sampling(tok) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, seed=3, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)


def _prompts(tok):
    return [tok("hi there")["input_ids"], tok("what is 12 + 30? answer with a number")["input_ids"]]


@contextlib.contextmanager
def _model_config(model, **fields):
    original = model.generation_config
    model.generation_config = copy.deepcopy(original)
    for k, v in fields.items():
        setattr(model.generation_config, k, v)
    try:
        yield
    finally:
        model.generation_config = original


def test_every_distribution_field_is_covered():
    """Every field transformers reads in `_get_logits_processor` is either one the tests set or one a rollout keeps
    (ids, cache): a field a transformers upgrade adds there fails here until it has a test."""
    from transformers.generation.utils import GenerationMixin

    source = inspect.getsource(GenerationMixin._get_logits_processor)
    read = set(re.findall(r"generation_config\.([a-z_]+)", source))
    # max_length: the rollout's max_new_tokens wins; _eos_token_tensor: the EOS ids, which a rollout passes itself.
    covered = set(FIELDS) | set(GENERATION_CONFIG_KEPT) | {"max_length", "_eos_token_tensor"}
    assert read - covered == set(), f"fields that may change sampling and have no test: {read - covered}"


@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize("backend", ["generate", "continuous"])
def test_a_model_generation_config_field_does_not_change_the_rollout(policy, field, backend):
    model, tok = policy.model, policy.tokenizer
    sampling = _sampling(tok)
    with _model_config(model, **{field: FIELDS[field]}), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-model note that the field is ignored (tested below)
        rollout = make_backend(backend, model, pad_token_id=tok.pad_token_id).generate(_prompts(tok), 2, sampling)
    assert len(rollout.completions) == 4 and all(c.finish_reason in ("eos", "length") for c in rollout.completions)
    assert max_logprob_diff(model, rollout, sampling) < ATOL


def test_the_check_can_fail_without_the_reset(policy):
    """The same check, with the reset patched out of the static batch: the model's repetition penalty reaches the
    sampler and the logprobs leave the policy's (the defect this file guards against)."""
    model, tok = policy.model, policy.tokenizer
    sampling = _sampling(tok)
    with _model_config(model, repetition_penalty=3.0, no_repeat_ngram_size=1), \
            mock.patch("cbkit.rollout.generate.rollout_generation_config", lambda m: contextlib.nullcontext()):
        rollout = make_backend("generate", model, pad_token_id=tok.pad_token_id).generate(_prompts(tok), 2, sampling)
    assert max_logprob_diff(model, rollout, sampling) > 0.05


def test_what_is_dropped_is_named_once_and_the_model_keeps_its_config(policy):
    model = copy.deepcopy(policy.model)
    model.generation_config.repetition_penalty = 1.05
    before = model.generation_config
    with pytest.warns(UserWarning, match=r"repetition_penalty.*ignored while they run"), \
            rollout_generation_config(model):
        inside = model.generation_config
    assert model.generation_config is before and before.repetition_penalty == 1.05
    assert inside.repetition_penalty is None and inside.eos_token_id == before.eos_token_id
    assert inside.to_diff_dict().keys() - {"transformers_version"} <= set(GENERATION_CONFIG_KEPT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        with rollout_generation_config(model):
            pass
    assert isinstance(inside, GenerationConfig)
