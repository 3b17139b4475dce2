"""cbkit's varlen attention, which the CB engine runs wherever flash-attn cannot: the batched decode path against the
per-sequence loop and a forward, on the device of its query, and no dense mask built by the engine."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from cbkit.rollout.varlen_attention import NAME, varlen_attention
from tests.reference_attention import per_sequence_attention, per_sequence_engine_attention


def _packed(q_lens, k_lens, heads=6, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, sum(q_lens), dim, generator=g)
    k = torch.randn(1, kv_heads, sum(k_lens), dim, generator=g)
    v = torch.randn(1, kv_heads, sum(k_lens), dim, generator=g)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k}


MODULE = types.SimpleNamespace(config=types.SimpleNamespace(layer_types=None), layer_idx=0)


@pytest.mark.parametrize(
    "q_lens,k_lens",
    [
        ([1] * 5, [7] * 5),  # lock-step decode: one prompt x N, equal lengths (the gather-free path)
        ([1, 1, 1, 1], [3, 9, 4, 12]),  # decode at different lengths (several prompts, recycled slots)
        ([1, 1, 1, 1, 1], [3, 9, 3, 9, 9]),  # equal lengths that are not back to back: gathered by index
        ([1, 5, 1, 0, 1], [10, 5, 2, 0, 30]),  # decode mixed with a prefill chunk and an empty slot
        ([4, 3], [4, 9]),  # prefill only, the second continuing a cached prefix
    ],
)
def test_batched_decode_equals_per_sequence_loop(q_lens, k_lens):
    q, k, v, kw = _packed(q_lens, k_lens)
    fast, _ = varlen_attention(MODULE, q, k, v, scaling=0.3, **kw)
    slow, _ = per_sequence_attention(MODULE, q, k, v, scaling=0.3, **kw)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)


def test_decode_token_equals_plain_softmax_attention():
    """Against attention written out by hand (no SDPA), for a sequence whose keys sit in the middle of the pack."""
    q, k, v, kw = _packed([1, 1, 1], [2, 6, 3], heads=4, kv_heads=2, dim=4, seed=3)
    out, _ = varlen_attention(MODULE, q, k, v, scaling=0.5, **kw)  # [1, sum q, H, D]
    keys, vals = k[0, :, 2:8], v[0, :, 2:8]  # sequence 1: keys 2..7
    for h in range(4):
        kv = h // 2  # heads 0,1 read KV head 0; heads 2,3 read KV head 1
        w = torch.softmax(q[0, h, 1] @ keys[kv].T * 0.5, dim=-1)
        torch.testing.assert_close(out[0, 1, h], w @ vals[kv], atol=1e-6, rtol=1e-5)


def _engine_runs(policy, prompts, sampling):
    """The same CB rollout with the batched decode and with the per-sequence loop (cbkit's previous default)."""
    from cbkit.rollout import ContinuousBackend

    fast = ContinuousBackend(policy.model).generate(prompts, 3, sampling)
    with per_sequence_engine_attention():
        slow = ContinuousBackend(policy.model).generate(prompts, 3, sampling)
    return fast, slow


def _compare(policy, fast, slow, sampling, tf_atol):
    """Same tokens; logprobs within 1e-4 of each other (measured: 3.8e-6 tiny, 2.1e-5 SmolLM2 -- one batched
    softmax sums in another order than 30 layers of single ones) and of a dense teacher-forced forward."""
    from tests.helpers import max_logprob_diff

    assert [c.completion_ids for c in fast.completions] == [c.completion_ids for c in slow.completions]
    diff = max(abs(a - b) for x, y in zip(fast.completions, slow.completions, strict=True)
               for a, b in zip(x.sampling_logprobs, y.sampling_logprobs, strict=True))
    teacher = max_logprob_diff(policy.model, fast, sampling)
    print(f"batched vs per-sequence: {diff:.2e}; vs teacher-forced forward: {teacher:.2e}")
    assert diff < 1e-4
    assert teacher < tf_atol


def test_engine_with_batched_decode_equals_per_sequence_on_tiny(tiny):
    from cbkit.rollout import SamplingParams

    tok = tiny.tokenizer
    # two prompts of different lengths: decode steps take the gather path, not only the lock-step one
    prompts = [tok.encode("hi there"), tok.encode("Tom has 3 apples and buys 4 more. How many now?")]
    sp = SamplingParams(max_new_tokens=20, temperature=0.9, seed=0, eos_token_id=None, pad_token_id=0)
    fast, slow = _engine_runs(tiny, prompts, sp)
    _compare(tiny, fast, slow, sp, tf_atol=1e-4)


@pytest.mark.real_model
def test_engine_with_batched_decode_equals_per_sequence_on_smollm2(smollm2, gsm8k_test_path):
    from cbkit.rollout import SamplingParams
    from cbkit.tasks.data import chat_prompt_ids, load_gsm8k_jsonl

    prompts = [chat_prompt_ids(smollm2.tokenizer, p) for p in load_gsm8k_jsonl(gsm8k_test_path, limit=2)]
    sp = SamplingParams(max_new_tokens=16, temperature=0.8, seed=0, eos_token_id=None,
                        pad_token_id=smollm2.tokenizer.pad_token_id)
    fast, slow = _engine_runs(smollm2, prompts, sp)
    # SmolLM2's larger logits make paged-vs-dense rounding ~2e-5 against a dense forward (tests/test_real_model.py)
    _compare(smollm2, fast, slow, sp, tf_atol=1e-3)


def test_every_tensor_it_builds_is_on_the_querys_device():
    """On the meta device (no data: a device that is neither the CPU nor the engine's boundaries' own), a mix of
    lock-step decode, gathered decode and a prefill chunk: the plan's index tensors and the output land on the
    query's device, so on a GPU no step copies them across."""
    from cbkit.rollout.varlen_attention import _decode_plan

    q, k, v, kw = _packed([1, 1, 1, 4, 1, 1], [5, 9, 5, 6, 5, 5])
    q, k, v = q.to("meta"), k.to("meta"), v.to("meta")
    out, _ = varlen_attention(MODULE, q, k, v, scaling=0.3, **kw)
    assert out.device.type == "meta" and out.shape == (1, 9, 6, 8)
    groups, prefill = _decode_plan(tuple(kw["cu_seq_lens_q"].tolist()), tuple(kw["cu_seq_lens_k"].tolist()),
                                   q.device)
    assert prefill == (3,) and {g.k_len for g in groups} == {5, 9}
    for g in groups:
        assert g.q_pos.device.type == "meta" and (g.k_index is None or g.k_index.device.type == "meta")
    assert any(g.k_index is not None for g in groups)  # the gather path was planned, not only the back-to-back one


def test_boundaries_rewritten_in_place_are_read_again():
    """The engine writes each step's boundaries into the same buffers; the host copy read once per forward must
    follow (a stale one would attend the new batch with the old batch's boundaries)."""
    q, k, v, kw = _packed([1, 1, 1], [4, 8, 6])
    first, _ = varlen_attention(MODULE, q, k, v, scaling=0.3, **kw)
    kw["cu_seq_lens_k"].copy_(torch.tensor([0, 8, 10, 18], dtype=torch.int32))  # same total, other lengths
    again, _ = varlen_attention(MODULE, q, k, v, scaling=0.3, **kw)
    slow, _ = per_sequence_attention(MODULE, q, k, v, scaling=0.3, **kw)
    torch.testing.assert_close(again, slow, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(first, again)


def test_a_cb_rollout_with_cbkits_attention_builds_no_dense_mask(tiny):
    """A real CB rollout on this CPU with cbkit's choice: transformers' `build_attention_mask` (the dense
    block-diagonal mask the engine fills for SDPA and eager) is never called, and its buffer is never allocated; the
    engine's own attention, run the same way, calls it at every step (the spy sees what it should)."""
    from transformers.generation.continuous_batching import input_outputs

    from cbkit.rollout import ContinuousBackend, SamplingParams
    from tests.reference_attention import engine_own_attention

    tok = tiny.tokenizer
    prompts = [tok.encode("hi there"), tok.encode("Tom has 3 apples and buys 4 more.")]
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=0, eos_token_id=None, pad_token_id=0)
    calls = []
    real = input_outputs.build_attention_mask

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    with mock.patch.object(input_outputs, "build_attention_mask", spy):
        ours = ContinuousBackend(tiny.model).generate(prompts, 3, sp)
        assert calls == [] and ours.engine_config["attn_implementation"] == NAME
        with engine_own_attention():
            ContinuousBackend(tiny.model).generate(prompts, 3, sp)
        assert len(calls) >= sp.max_new_tokens  # one per layer type and step, at least one a step
