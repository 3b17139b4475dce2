"""A CB engine kept alive across rollouts: same results, and training forwards stay causal in between.

transformers issue #48296: a plain forward with a CB manager attached went silently non-causal. cbkit's
persistent engine stops its thread after every call (which restores the model's attention), so the
training forward between two rollouts must give exactly the logprobs it gives with no engine at all.
"""

from __future__ import annotations

import torch

from cbkit.models.load import load_policy
from cbkit.rollout import ContinuousBackend, GenerateBackend, SamplingParams
from cbkit.rollout.engine import engine_is_idle
from cbkit.train.logprobs import teacher_forced_logprobs


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


# --- the kept engine never samples on KV from older weights, nor lends itself to another backend ---------------


def _long_prompt(tok) -> list[int]:
    """169 tokens: ten full 16-token pages, which the engine hashes and keeps as a prefix cache."""
    ids = tok.apply_chat_template([{"role": "user", "content": "x" * 150}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert len(ids) > 10 * 16
    return ids


def _greedy(tok, n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)


@torch.no_grad()
def _perturb(model, seed: int) -> None:
    """An optimizer step, as far as the engine can tell: every weight moves."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.5)


def _generate_ids(model, tok, prompt, sp) -> list[tuple[int, ...]]:
    r = GenerateBackend(model, pad_token_id=tok.pad_token_id).generate([prompt], 1, sp)
    return [c.completion_ids for c in r.completions]


def test_kept_engine_after_a_weight_change_matches_generate_on_the_new_weights():
    """Before the fix the second call reused the first call's hashed pages (KV of the old weights): its greedy tokens
    were (168, 88, 5, ...) where generate() and a fresh engine give (145, 135, 47, ...) on the new weights."""
    model, tok = load_policy("tiny", seed=0)
    prompt, sp = _long_prompt(tok), _greedy(tok)
    kept = ContinuousBackend(model, cb_config={"page_size": 16}, persistent=True)
    try:
        before = kept.generate([prompt], 1, sp)
        assert [c.completion_ids for c in before.completions] == _generate_ids(model, tok, prompt, sp)
        _perturb(model, 1)
        after = kept.generate([prompt], 1, sp)
        assert after.engine_config["allow_block_sharing"], "the test needs the prefix cache on"
    finally:
        kept.close()
    expected = _generate_ids(model, tok, prompt, sp)
    assert [c.completion_ids for c in before.completions] != expected, "the weight change must change the tokens"
    assert [c.completion_ids for c in after.completions] == expected


def test_a_new_backend_never_runs_on_another_backends_kept_engine():
    model, tok = load_policy("tiny", seed=0)
    prompt, sp = _long_prompt(tok), _greedy(tok)
    kept = ContinuousBackend(model, cb_config={"page_size": 16}, persistent=True)
    try:
        kept.generate([prompt], 1, sp)
        engine = model._cached_continuous_batching_manager
        _perturb(model, 2)
        # A plain backend with another config: it must build its own engine, with its own settings.
        other = ContinuousBackend(model, cb_config={"page_size": 32}).generate([prompt], 1, sp)
        assert other.engine_config["page_size"] == 32
        assert [c.completion_ids for c in other.completions] == _generate_ids(model, tok, prompt, sp)
        # ...and leave the persistent backend's engine where it was, alive and still its owner's.
        assert model._cached_continuous_batching_manager is engine and kept.engine.manager is engine
        again = kept.generate([prompt], 1, sp)
        assert model._cached_continuous_batching_manager is engine
        assert [c.completion_ids for c in again.completions] == [c.completion_ids for c in other.completions]
    finally:
        kept.close()
    assert getattr(model, "_cached_continuous_batching_manager", None) is None


# --- seeds: call by call, whether the engine is kept or not -------------------------------------------------


def _sampled(tok, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=12, temperature=1.5, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, seed=seed)


def test_a_kept_engine_draws_what_a_fresh_one_draws_for_each_calls_seed(tiny):
    """A kept engine used to be seeded once, when it was built: its second call (seed 2) drew on from seed 1's
    stream, so a run resumed at that step drew something else. Now each call draws what a fresh engine would."""
    tok, model = tiny.tokenizer, tiny.model
    prompts = _prompts(tok)
    fresh = {s: ContinuousBackend(model).generate(prompts, 4, _sampled(tok, s)) for s in (1, 2)}
    ids = {s: [c.completion_ids for c in r.completions] for s, r in fresh.items()}
    assert ids[1] != ids[2]
    kept = ContinuousBackend(model, persistent=True)
    try:
        got = [kept.generate(prompts, 4, _sampled(tok, s)) for s in (1, 2, 1)]
    finally:
        kept.close()
    assert [[c.completion_ids for c in r.completions] for r in got] == [ids[1], ids[2], ids[1]]
    assert [r.engine_config["seed"] for r in got] == [1, 2, 1]
