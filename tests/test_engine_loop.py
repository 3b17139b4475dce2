"""The CB engine's loop (transformers' thread): a kept engine draws what a fresh one draws, and failures raise."""

from __future__ import annotations

import pytest

from cbkit.rollout import BACKENDS, ContinuousBackend, SamplingParams, make_backend
from cbkit.rollout.engine import engine_is_idle


def _prompts(tok):
    # The second prompt is long enough to fill KV pages of 4 tokens: shared among its N completions.
    return [tok("hi")["input_ids"], tok("what is 12 + 30? answer with a number")["input_ids"]]


def _rollout(backend, tok, n=3, seed=5, targets=None):
    sp = SamplingParams(max_new_tokens=10, temperature=1.3, seed=seed, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return backend.generate(_prompts(tok), n, sp, target_lengths=targets)


def _same(a, b):
    assert [c.completion_ids for c in a.completions] == [c.completion_ids for c in b.completions]
    assert [c.sampling_logprobs for c in a.completions] == [c.sampling_logprobs for c in b.completions]
    assert [c.finish_reason for c in a.completions] == [c.finish_reason for c in b.completions]


def test_a_kept_engine_matches_a_fresh_engine(tiny):
    tok, model = tiny.tokenizer, tiny.model
    reference = _rollout(ContinuousBackend(model), tok)
    kept = ContinuousBackend(model, persistent=True)
    try:
        first, second = _rollout(kept, tok), _rollout(kept, tok)
        assert getattr(model, "_cached_continuous_batching_manager", None) is not None, "engine was not kept"
        assert engine_is_idle(model)
    finally:
        kept.close()
    _same(first, reference)
    _same(second, reference)


def test_a_failing_step_raises_in_the_caller_and_leaves_the_model_usable(tiny, monkeypatch):
    tok, model = tiny.tokenizer, tiny.model
    original_impl = model.config._attn_implementation
    backend = ContinuousBackend(model)
    layer = model.model.layers[0].mlp
    real = layer.forward
    calls = {"n": 0}

    def broken(x):
        calls["n"] += 1
        if calls["n"] == 3:  # a few steps in: requests are running when it fails
            raise RuntimeError("injected failure in the MLP")
        return real(x)

    monkeypatch.setattr(layer, "forward", broken)
    with pytest.raises(RuntimeError, match="injected failure"):
        _rollout(backend, tok)
    monkeypatch.setattr(layer, "forward", real)
    assert model.config._attn_implementation == original_impl and engine_is_idle(model)
    # Nothing the failed call queued leaks into the next one.
    _same(_rollout(backend, tok), _rollout(ContinuousBackend(model), tok))


def test_the_loop_is_the_engines_choice_not_a_backend_or_an_option(tiny):
    assert sorted(BACKENDS) == ["continuous", "generate"]
    backend = make_backend("continuous", tiny.model)
    assert backend.name == "continuous"
    with pytest.raises(TypeError, match="engine_loop"):
        ContinuousBackend(tiny.model, engine_loop="thread")
