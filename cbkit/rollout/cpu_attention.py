"""Per-sequence attention for the CB engine on CPU: why CB loses to `generate()` there, and the fix.

transformers' CB engine packs every running sequence into one row of tokens. With flash attention (CUDA
only) a varlen kernel attends each sequence to its own keys. With SDPA or eager -- all a CPU has -- the
engine instead builds one dense [all queries x all keys] mask that is block-diagonal across sequences
(`build_attention_mask` in transformers/generation/continuous_batching/input_outputs.py) and runs one
masked attention over it. Decoding B sequences of length L then costs B x (B x L) instead of B x L: the
work grows with the *square* of the batch. A py-spy profile of one rollout (SmolLM2-135M, 32 sequences
x 48 tokens, 2 CPU cores) put 55% of the engine's time in `sdpa_attention_forward` against 28% in all
the linear layers together.

This module gives the engine what it gets on a GPU: a varlen attention. It registers an attention
function that splits the packed batch at the engine's `cu_seq_lens_q` / `cu_seq_lens_k` and runs SDPA
once per sequence, causal and aligned to the end of its keys (a prefill chunk continues a cached
prefix). Its registered name contains "flash" because that is how the engine recognises a varlen
kernel: it then skips the dense mask (which also frees its memory) and passes the sequence boundaries.
The model's own attention is switched only while the engine runs and restored after it, so training
forwards are untouched.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

NAME = "cbkit_flash_varlen_cpu"


def _boundaries(cu, module) -> torch.Tensor:
    if isinstance(cu, dict):  # one entry per layer type (full / sliding attention)
        layer_types = getattr(module.config, "layer_types", None)
        key = layer_types[module.layer_idx] if layer_types else None
        cu = cu[key] if key in cu else next(iter(cu.values()))
    return cu


def varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, sum q, D], key/value [1, Hkv, sum k, D] -> ([1, sum q, H, D], None)."""
    cu_q = _boundaries(kwargs["cu_seq_lens_q"], module).tolist()
    cu_k = _boundaries(kwargs["cu_seq_lens_k"], module).tolist()
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        q_len, k_len = qe - qs, ke - ks
        if q_len == 0:
            continue
        mask = None
        if q_len > 1:
            # causal, aligned to the end: query j sees the cached prefix and queries up to j
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        out[:, :, qs:qe] = F.scaled_dot_product_attention(
            query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke], attn_mask=mask, scale=scaling,
            enable_gqa=gqa,
        )
    return out.transpose(1, 2).contiguous(), None


def varlen_unsupported_reason(model) -> str | None:
    """Why `varlen_attention` would compute something else than the model's own attention, or None if it would not.

    It runs plain causal SDPA per sequence: it has no sliding window, no logit soft-capping and no attention sinks,
    and the engine hands those in as keyword arguments (`sliding_window`, `softcap`, `s_aux`) that it would drop.
    A Mistral-style window, Gemma-2's soft-capping or gpt-oss's sinks would silently change the rollout, so for
    such models the engine keeps its own attention (slower on CPU; it has windows and sinks, but no soft-capping,
    which `ContinuousBackend` therefore refuses on CPU).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    # Where a config lists its layer types they decide (Gemma-2 alternates); else a window set means one is used.
    sliding = "sliding_attention" in layer_types if layer_types else window is not None
    if sliding:
        return f"sliding-window attention (sliding_window={window})"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})"
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return "attention sinks"
    return None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME


@contextlib.contextmanager
def varlen_attention_for_engine(model):
    """Run the CB engine with per-sequence attention; the model's own implementation is restored after."""
    original = model.config._attn_implementation
    # Set on the config directly: `set_attn_implementation` would take the "flash" in the name as a request
    # to import a flash-attn kernel. The attention layers look the function up by this name at every call.
    model.config._attn_implementation = register()
    try:
        yield
    finally:
        model.config._attn_implementation = original
