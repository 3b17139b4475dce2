"""Varlen attention for the CB engine on CPU: why CB lost to `generate()` there, and the two fixes.

transformers' CB engine packs every running sequence into one row of tokens. With flash attention (CUDA
only) a varlen kernel attends each sequence to its own keys. With SDPA or eager -- all a CPU has -- the
engine instead builds one dense [all queries x all keys] mask that is block-diagonal across sequences
(`build_attention_mask` in transformers/generation/continuous_batching/input_outputs.py) and runs one
masked attention over it. Decoding B sequences of length L then costs B x (B x L) instead of B x L: the
work grows with the *square* of the batch. A py-spy profile of one rollout (SmolLM2-135M, 32 sequences
x 48 tokens, 2 CPU cores) put 55% of the engine's time in `sdpa_attention_forward` against 28% in all
the linear layers together.

Fix one gives the engine what it gets on a GPU: a varlen attention. It registers an attention function
that splits the packed batch at the engine's `cu_seq_lens_q` / `cu_seq_lens_k`. Its registered name
contains "flash" because that is how the engine recognises a varlen kernel: it then skips the dense mask
(which also frees its memory) and passes the sequence boundaries. The model's own attention is switched
only while the engine runs and restored after it, so training forwards are untouched.

Fix two: the first version ran SDPA once per sequence (`per_sequence_attention`, kept beside the fast one
to read and to test against), 64 sequences x 30 layers = 1920 small calls per decode step. Nearly every
step of a rollout is decode-only -- one new query token per sequence -- so `varlen_attention` now gathers
the decoding sequences' keys into one [rows, KV heads, longest, D] batch with a padding mask and makes one
call per layer; a prefill chunk (several query tokens, causal, continuing a cached prefix) still runs on
its own. After it, a py-spy profile of the engine (SmolLM2, 32 sequences x 96 tokens, one thread) puts 59%
of the time in the linear layers, 10% in this attention, 7.5% in the engine's cache gather and 7% in its
sampling, which is where `generate()` spends its time too. `ContinuousBackend(cpu_attention=...)` and
`cbkit sweep --cpu-attention` choose between the three, so the "befores" stay measurable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

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
    """query [1, H, sum q, D], key/value [1, Hkv, sum k, D] -> ([1, sum q, H, D], None).

    Decoding sequences (one query token each) go through one batched SDPA call; sequences that prefill run one
    call each. `per_sequence_attention` below is the plain loop, kept to read and test against.
    """
    cu_q = _boundaries(kwargs["cu_seq_lens_q"], module).tolist()
    cu_k = _boundaries(kwargs["cu_seq_lens_k"], module).tolist()
    plan = _decode_plan(tuple(cu_q), tuple(cu_k), query.device)
    out = torch.empty_like(query)
    if plan.rows:
        out[:, :, plan.q_pos] = _batched_decode(query, key, value, plan, scaling)
    for i in plan.prefill:
        _one_sequence(out, query, key, value, cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1], scaling)
    return out.transpose(1, 2).contiguous(), None


def per_sequence_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """The same result as `varlen_attention`, one SDPA call per sequence: the "before" of the decode batching.

    At 64 decoding sequences and 30 layers that is 1920 small calls per generated token of every sequence,
    each paying the dispatcher and the kernel's set-up for a [9 x L] product.
    """
    cu_q = _boundaries(kwargs["cu_seq_lens_q"], module).tolist()
    cu_k = _boundaries(kwargs["cu_seq_lens_k"], module).tolist()
    out = torch.empty_like(query)
    for i in range(len(cu_q) - 1):
        _one_sequence(out, query, key, value, cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1], scaling)
    return out.transpose(1, 2).contiguous(), None


def _one_sequence(out, query, key, value, qs, qe, ks, ke, scaling) -> None:
    q_len, k_len = qe - qs, ke - ks
    if q_len == 0:
        return
    mask = None
    if q_len > 1:
        # causal, aligned to the end: query j sees the cached prefix and queries up to j
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    out[:, :, qs:qe] = F.scaled_dot_product_attention(
        query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke], attn_mask=mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


@dataclasses.dataclass(frozen=True)
class _DecodePlan:
    """Where the decoding sequences of one batch sit in the packed tensors; the same for every layer."""

    rows: int  # decoding sequences
    q_pos: torch.Tensor  # [rows] their query position in the packed batch
    k_index: torch.Tensor | None  # [rows, longest] key positions, or None when all have equal, adjacent keys
    k_start: int  # with k_index None: where the first one's keys start
    k_len: int  # their longest key length
    mask: torch.Tensor | None  # [rows, 1, 1, longest] True where a key exists
    prefill: tuple[int, ...]  # sequences with more than one query token


@functools.lru_cache(maxsize=8)
def _decode_plan(cu_q: tuple[int, ...], cu_k: tuple[int, ...], device: torch.device) -> _DecodePlan:
    # Every layer of a forward sees the same boundaries, so the plan is built once per step, not 30 times.
    decode = [i for i in range(len(cu_q) - 1) if cu_q[i + 1] - cu_q[i] == 1]
    prefill = tuple(i for i in range(len(cu_q) - 1) if cu_q[i + 1] - cu_q[i] > 1)
    if not decode:
        return _DecodePlan(0, torch.empty(0, dtype=torch.long), None, 0, 0, None, prefill)
    starts = [cu_k[i] for i in decode]
    lens = [cu_k[i + 1] - cu_k[i] for i in decode]
    longest = max(lens)
    q_pos = torch.tensor([cu_q[i] for i in decode], device=device)
    adjacent = all(n == longest for n in lens) and all(s == starts[0] + j * longest for j, s in enumerate(starts))
    if adjacent:  # one prompt x N in lock-step: the packed keys already are a [rows, L] grid
        return _DecodePlan(len(decode), q_pos, None, starts[0], longest, None, prefill)
    offsets = torch.arange(longest)
    k_index = torch.tensor(starts)[:, None] + offsets.clamp(max=longest - 1)[None, :]
    present = offsets[None, :] < torch.tensor(lens)[:, None]
    k_index = torch.where(present, k_index, torch.tensor(starts)[:, None])  # pad with any valid position
    return _DecodePlan(len(decode), q_pos, k_index.to(device), 0, longest, present[:, None, None, :].to(device),
                       prefill)


def _batched_decode(query, key, value, plan: _DecodePlan, scaling) -> torch.Tensor:
    """One SDPA call for every decoding sequence: keys gathered into [rows, Hkv, L, D] and a padding mask.

    The H query heads of a token are folded into the query-length axis of their KV head ([rows, Hkv, H/Hkv, D]),
    so grouped-query attention needs neither repeated keys nor the `enable_gqa` path; a single query token may
    see all of its keys, so no causal mask is needed either.
    """
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    q = query[0, :, plan.q_pos].transpose(0, 1).reshape(plan.rows, kv_heads, heads // kv_heads, dim)
    if plan.k_index is None:
        span = slice(plan.k_start, plan.k_start + plan.rows * plan.k_len)
        k = key[0, :, span].unflatten(1, (plan.rows, plan.k_len)).transpose(0, 1)
        v = value[0, :, span].unflatten(1, (plan.rows, plan.k_len)).transpose(0, 1)
    else:
        k = key[0][:, plan.k_index].transpose(0, 1)  # [rows, Hkv, L, D]
        v = value[0][:, plan.k_index].transpose(0, 1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scaling)  # [rows, Hkv, H/Hkv, D]
    return o.reshape(plan.rows, heads, dim).transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]


def varlen_unsupported_reason(model) -> str | None:
    """Why `varlen_attention` would compute something else than the model's own attention, or None if it would not.

    It runs plain causal SDPA: it has no sliding window, no logit soft-capping and no attention sinks,
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


# What `ContinuousBackend(cpu_attention=...)` and `cbkit sweep --cpu-attention` choose from on CPU; "engine" is
# the engine's own dense-mask SDPA (the first "before"), "per_sequence" the loop cbkit ran until the decode
# batching (the second "before").
CPU_ATTENTION = ("batched", "per_sequence", "engine")


def register(kind: str = "batched") -> str:
    from transformers import AttentionInterface

    # Looked up at call time through the module, so a test can swap the function in.
    fn = {"batched": lambda *a, **k: varlen_attention(*a, **k),
          "per_sequence": lambda *a, **k: per_sequence_attention(*a, **k)}[kind]
    AttentionInterface.register(NAME, fn)
    return NAME


@contextlib.contextmanager
def varlen_attention_for_engine(model, kind: str = "batched"):
    """Run the CB engine with cbkit's varlen attention; the model's own implementation is restored after."""
    original = model.config._attn_implementation
    # Set on the config directly: `set_attn_implementation` would take the "flash" in the name as a request
    # to import a flash-attn kernel. The attention layers look the function up by this name at every call.
    model.config._attn_implementation = register(kind)
    try:
        yield
    finally:
        model.config._attn_implementation = original
