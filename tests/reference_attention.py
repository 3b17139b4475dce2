"""References for the CB engine's CPU attention, written the plain way: what the tests (and the lab's A/B,
lab/cpu_attention_ab.py) compare cbkit's batched varlen attention with. Not part of cbkit: the product offers one
CPU attention, the batched one, and falls back to the engine's own only where a model needs it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F


def per_sequence_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """`varlen_attention`'s result, one SDPA call per packed sequence (cbkit's CPU attention before decode batching).

    query [1, H, sum q, D], key/value [1, Hkv, sum k, D] -> ([1, sum q, H, D], None). A sequence with several query
    tokens is causal, aligned to the end of its keys: query j sees the cached prefix and the queries up to j."""
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    if isinstance(cu_q, dict):  # one entry per layer type; the tests' models have full attention only
        cu_q, cu_k = next(iter(cu_q.values())), next(iter(cu_k.values()))
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    out = torch.empty_like(query)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        q_len, k_len = qe - qs, ke - ks
        if q_len == 0:
            continue
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len) if q_len > 1 else None
        out[:, :, qs:qe] = F.scaled_dot_product_attention(
            query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke], attn_mask=mask, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def per_sequence_engine_attention() -> Iterator[None]:
    """CB rollouts inside the block attend with `per_sequence_attention` instead of the batched kernel
    (`varlen_attention.register` looks `varlen_attention` up through its module at every call)."""
    with mock.patch("cbkit.rollout.varlen_attention.varlen_attention", per_sequence_attention):
        yield


@contextlib.contextmanager
def engine_own_attention() -> Iterator[None]:
    """CB rollouts inside the block run on the engine's own attention (its dense block-diagonal mask on CPU), the
    path cbkit takes for a model its varlen attention cannot serve (`varlen_unsupported_reason`)."""
    with (mock.patch("cbkit.rollout.varlen_attention.varlen_unsupported_reason", lambda model: "a test's request"),
          warnings.catch_warnings()):
        warnings.filterwarnings("ignore", message="cbkit's varlen attention has no a test's request")
        yield
