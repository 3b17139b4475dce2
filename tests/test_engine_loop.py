"""The CB engine's loop driven from the caller's thread: the same rollout as transformers' thread, failures raise.

The thread driver is the reference: both run the manager's own scheduler, cache and sampler, so with one seed they
must draw the same tokens with the same logprobs, with and without prefix sharing and with a kept engine.
"""

from __future__ import annotations

import pytest

from cbkit.rollout import BACKENDS, ContinuousBackend, SamplingParams, make_backend
from cbkit.rollout.engine import engine_is_idle


def _on_loop(loop, model, cb_config=None, persistent=False):
    """The CB backend with its engine's loop in `loop` ("caller", the CPU's default, or "thread")."""
    backend = ContinuousBackend(model, cb_config, persistent=persistent)
    backend.engine.thread_loop = loop == "thread"
    return backend


def _threaded(model, cb_config=None):
    return _on_loop("thread", model, cb_config)


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


@pytest.mark.parametrize("cb_config", [{}, {"page_size": 4}, {"allow_block_sharing": False}])
def test_caller_loop_samples_what_the_thread_samples(tiny, cb_config):
    tok, model = tiny.tokenizer, tiny.model
    caller = _on_loop("caller", model, cb_config)
    thread = _threaded(model, cb_config)
    a, b = _rollout(caller, tok), _rollout(thread, tok)
    _same(a, b)
    assert len({c.completion_ids for c in a.completions}) > 1, "sampling drew one sequence: the test cannot tell"
    # Replayed targets take the per-request path (EOS off, one max_new_tokens each).
    targets = [3, 9, 5, 10, 1, 7]
    a, b = _rollout(caller, tok, targets=targets), _rollout(thread, tok, targets=targets)
    _same(a, b)
    assert [len(c.completion_ids) for c in a.completions] == targets
    assert engine_is_idle(model)


def test_kept_engine_on_the_caller_loop_matches_a_fresh_thread_engine(tiny):
    tok, model = tiny.tokenizer, tiny.model
    reference = _rollout(_threaded(model), tok)
    kept = _on_loop("caller", model, persistent=True)
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
    backend = _on_loop("caller", model)
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
    _same(_rollout(backend, tok), _rollout(_threaded(model), tok))


def test_the_loop_is_the_engines_choice_not_a_backend_or_an_option(tiny):
    assert sorted(BACKENDS) == ["continuous", "generate"]
    backend = make_backend("continuous", tiny.model)
    assert backend.name == "continuous" and not backend.engine.thread_loop
    with pytest.raises(TypeError, match="engine_loop"):
        ContinuousBackend(tiny.model, engine_loop="thread")
