"""The CPU attention the CB engine runs: the batched decode path against the per-sequence loop and a forward."""

from __future__ import annotations

import types

import pytest
import torch

from cbkit.rollout.cpu_attention import per_sequence_attention, varlen_attention


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
