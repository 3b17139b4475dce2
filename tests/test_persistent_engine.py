"""A CB engine kept alive across rollouts: same results, and training forwards stay causal in between.

transformers issue #48296: a plain forward with a CB manager attached went silently non-causal. cbkit's
persistent engine stops its thread after every call (which restores the model's attention), so the
training forward between two rollouts must give exactly the logprobs it gives with no engine at all.
"""

from __future__ import annotations

import torch

from cbkit.logprobs import teacher_forced_logprobs
from cbkit.rollout import ContinuousBackend, SamplingParams
from cbkit.rollout.continuous import engine_is_idle


def _prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in ("hi", "what is 12 + 30?")]


def test_persistent_engine_matches_fresh_engine_and_keeps_forward_causal(tiny):
    tok, model = tiny.tokenizer, tiny.model
    sp = SamplingParams(max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    prompts = _prompts(tok)
    fresh = ContinuousBackend(model).generate(prompts, 2, sp)
    reference = teacher_forced_logprobs(model, fresh.completions)  # no engine attached

    kept = ContinuousBackend(model, persistent=True)
    try:
        first = kept.generate(prompts, 2, sp)
        assert getattr(model, "_cached_continuous_batching_manager", None) is not None, "engine was not kept"
        assert engine_is_idle(model)
        between = teacher_forced_logprobs(model, fresh.completions)  # training forward with the engine kept
        second = kept.generate(prompts, 2, sp)
    finally:
        kept.close()
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    for a, b in zip(reference, between, strict=True):
        assert torch.equal(a, b)
    ids = [c.completion_ids for c in fresh.completions]
    assert [c.completion_ids for c in first.completions] == ids == [c.completion_ids for c in second.completions]


def test_persistent_engine_rebuilds_when_sampling_changes(tiny):
    tok, model = tiny.tokenizer, tiny.model
    prompts = _prompts(tok)
    kept = ContinuousBackend(model, persistent=True)
    try:
        greedy = SamplingParams(max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
        kept.generate(prompts, 1, greedy)
        engine = model._cached_continuous_batching_manager
        hot = SamplingParams(max_new_tokens=8, temperature=2.0, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, seed=3)
        kept.generate(prompts, 1, hot)
        assert model._cached_continuous_batching_manager is not engine, "a changed sampler must not reuse the engine"
    finally:
        kept.close()
