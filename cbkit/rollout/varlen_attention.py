"""Varlen attention for the CB engine on any device: each packed sequence attends to its own keys.

Without flash-attn the engine's SDPA/eager path builds one dense block-diagonal mask over the packed batch (decoding B
sequences costs B squared). This splits the batch at the engine's `cu_seq_lens_q/k`, with PyTorch's SDPA alone.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F

# "flash" in the name: the engine builds no dense mask; no version digit: it never looks for flash-attn's kernel.
NAME = "cbkit_flash_varlen"


# The boundaries last read to the host, by id: (the tensor, held so its id is not reused; its version; the list).
_HOST: dict[int, tuple[torch.Tensor, int, list[int]]] = {}


def _host_list(cu: torch.Tensor) -> list[int]:
    """`cu` as a list, read once per forward, not per layer (on a GPU each read waits): every layer gets the same
    tensor, written in place between steps, so its version says whether the last read holds."""
    hit = _HOST.get(id(cu))
    if hit is None or hit[0] is not cu or hit[1] != cu._version:
        if len(_HOST) >= 4:  # the q and k boundaries of the current step; older steps' views are dropped
            _HOST.clear()
        hit = _HOST[id(cu)] = (cu, cu._version, cu.tolist())
    return hit[2]


def varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, sum q, D], key/value [1, Hkv, sum k, D] -> ([1, sum q, H, D], None)."""
    cu_k = kwargs["cu_seq_lens_k"]  # one entry per layer type: only full attention comes here (no sliding window)
    cu_k = _host_list(next(iter(cu_k.values())) if isinstance(cu_k, dict) else cu_k)
    cu_q = _host_list(kwargs["cu_seq_lens_q"])
    decode, prefill = _decode_plan(tuple(cu_q), tuple(cu_k), query.device)
    out = torch.empty_like(query)
    for group in decode:
        out[:, :, group.q_pos] = _batched_decode(query, key, value, group, scaling)
    for i in prefill:  # one SDPA call each, causal and aligned to the end: query j sees the cached prefix and j
        (qs, qe), (ks, ke) = cu_q[i : i + 2], cu_k[i : i + 2]
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=query.device).tril((ke - ks) - (qe - qs))
        out[:, :, qs:qe] = F.scaled_dot_product_attention(
            query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke], attn_mask=mask, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@dataclasses.dataclass(frozen=True)
class _DecodeGroup:
    """Decoding sequences of one batch with the same number of keys, one SDPA call for all (no padding mask): a
    prompt's N completions decode in lock-step, so a batch has a few such groups."""

    q_pos: torch.Tensor  # [rows] their query positions in the packed batch
    k_start: int | None  # where their keys start, when they sit back to back in the packed keys
    k_index: torch.Tensor | None  # [rows * k_len] key positions otherwise
    k_len: int


@functools.lru_cache(maxsize=8)
def _decode_plan(cu_q: tuple[int, ...], cu_k: tuple[int, ...], device: torch.device):
    """(decode groups, prefill sequences) of one batch; cached, so once per step, not per layer."""
    by_len: dict[int, list[int]] = {}
    prefill = []
    for i in range(len(cu_q) - 1):
        q_len = cu_q[i + 1] - cu_q[i]
        if q_len == 1:
            by_len.setdefault(cu_k[i + 1] - cu_k[i], []).append(i)
        elif q_len > 1:
            prefill.append(i)
    groups = []
    for k_len, seqs in by_len.items():
        q_pos = torch.tensor([cu_q[i] for i in seqs], device=device)
        starts = [cu_k[i] for i in seqs]
        if all(s == starts[0] + j * k_len for j, s in enumerate(starts)):
            groups.append(_DecodeGroup(q_pos, starts[0], None, k_len))
        else:
            index = (torch.tensor(starts, device=device)[:, None]
                     + torch.arange(k_len, device=device)[None, :]).flatten()
            groups.append(_DecodeGroup(q_pos, None, index, k_len))
    return tuple(groups), tuple(prefill)


def _batched_decode(query, key, value, group: _DecodeGroup, scaling) -> torch.Tensor:
    """One SDPA call for a group of decoding sequences, their keys as a [rows, Hkv, L, D] grid. A token's H query
    heads fold into its KV head's query axis, so grouped-query attention repeats no keys; one query needs no mask."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    rows, k_len = len(group.q_pos), group.k_len
    q = query[0, :, group.q_pos].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)
    if group.k_start is not None:  # back to back: the packed keys already are the grid (k_index is None)
        span = slice(group.k_start, group.k_start + rows * k_len)
        k, v = key[0, :, span], value[0, :, span]
    else:
        k, v = key[0].index_select(1, group.k_index), value[0].index_select(1, group.k_index)
    k = k.unflatten(1, (rows, k_len)).transpose(0, 1)  # [rows, Hkv, L, D]
    v = v.unflatten(1, (rows, k_len)).transpose(0, 1)
    o = F.scaled_dot_product_attention(q, k, v, scale=scaling)  # [rows, Hkv, H/Hkv, D]
    return o.reshape(rows, heads, dim).transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]


def varlen_unsupported_reason(model: Any) -> str | None:
    """Why `varlen_attention` (plain causal SDPA) would differ from the model's attention, or None. ``model`` may be
    a config alone, where sinks go unseen (gpt-oss, the model with sinks, also alternates windows)."""
    config = getattr(model, "config", model)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in layer_types if layer_types else window is not None
    if sliding:
        return f"sliding-window attention (sliding_window={window})"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})"
    modules = model.modules() if hasattr(model, "modules") else ()
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in modules):
        return "attention sinks"
    return None


def register() -> str:
    from transformers import AttentionInterface

    # Looked up at call time, so a test can swap the function in.
    AttentionInterface.register(NAME, lambda *a, **k: varlen_attention(*a, **k))
    return NAME
