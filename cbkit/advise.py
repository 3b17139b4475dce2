"""Which rollout backend, and will it fit? A memory planner and the seed's decision guide, as functions.

The planner predicts the peak memory (above the weights) of one rollout of P prompts x N completions for
both backends, from nothing but the model's config:

* ``generate()`` keeps every row of the static batch until the *last* row finishes. Its cache grows step
  by step (transformers' DynamicCache appends with ``torch.cat``), so the peak is reached at the end:
  rows x (longest prompt + decode steps) tokens of KV, plus the per-step transients that scale with
  rows x vocabulary (the logits, their fp32 copy, the log-probs cbkit's recorder keeps, the sampling
  probabilities). The planner takes the decode steps to be ``max_new_tokens``: with many rows, one of them
  usually runs to the limit. That is an upper bound; a batch whose every row stops early uses less.
* the CB engine allocates one pool up front and keeps it, whatever the batch needs. The planner repeats
  the engine's own sizing, step for step, so that it predicts the number of blocks the engine resolves
  (a test builds the engine and checks this):

  - the settings are the ones cbkit's ``continuous`` backend hands the engine (``make_cb_config``): on a
    GPU ``max_memory_percent=0.5`` of the free memory; on a CPU, unless ``num_blocks`` is given (``None``
    hands the sizing back to the engine), exactly enough blocks for every request at full length;
  - transformers (``PagedAttentionCache.__init__`` and ``PagedAttentionMemoryHandler`` in
    ``generation/continuous_batching/cache.py``) turns those into *sectors*: the LCM of each attention
    type's block bytes and 128 bytes. ``num_blocks`` is rounded up to whole sectors. Without it,
    ``available = free memory x max_memory_percent`` pays first for the fixed overhead (two trash sectors,
    the LM-head rows of up to ``max_requests_per_batch`` requests) and ``max_batch_tokens`` (default 8192)
    x the per-batch-token cost (IO tensors + the larger of the attention and LM-head activation peaks);
    the rest becomes sectors, each charged its own bytes plus the cache-read buffers it implies, and
    finally enough sectors are given back to pay for the eager/SDPA attention mask
    [max_batch_tokens, cache tokens + max_batch_tokens];
  - the workload hints (longest prompt, ``max_new_tokens``, number of requests) do **not** cap the pool in
    transformers 5.24 (``resolve_using_hints`` in ``initialization.py``): they only set
    ``max_blocks_per_request`` (the decode fast path's block table, kept only with flash attention on
    CUDA) and ``max_requests_per_batch = min(requests, 1024)``, whose LM-head rows are reserved before the
    pool is sized. On a GPU the pool is therefore about the same size at N=8 and at N=64 (1-2% smaller
    with more requests), which is why ``generate()`` is the lighter of the two at small N and the heavier
    at large N.

``crossover_n`` is the smallest N at which CB's predicted peak is below ``generate()``'s, and
``recommend`` turns N, the spread of completion lengths, the modality, the need for throughput, the GPU
count and (optionally) a plan into a backend with its reasons.

Accuracy. The CB block count is exact: tests/test_advise.py builds the engine on the tiny model (workload,
``num_blocks`` and memory sizing, default and small ``max_batch_tokens``) and compares. Peak *bytes* are
an estimate. On this repo's 2-core CPU with SmolLM2-135M (2 prompts of 80 tokens, 96 new tokens, N=4
and 16), measured RSS ran 1.4-1.6x above the plan for generate() and 2-3x above it for CB. Not profiled;
likely RSS-only effects the plan does not model (allocator slack, a malloc arena for the engine's decode
thread, SDPA's CPU kernels). On CPU treat the plan as a lower bound; GPU peaks (``max_memory_allocated``)
have not been checked against it yet.

Simplifications: full and sliding-window attention only (no MLA, no linear attention); activations are
counted for inference without gradients; prefix sharing (blocks shared between a group's identical
prompts) is ignored, so CB's *use* of its pool is overestimated, never its size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cbkit.telemetry import kv_bytes_per_token

__all__ = [
    "Advice",
    "ContinuousPlan",
    "Measured",
    "GeneratePlan",
    "Plan",
    "crossover_n",
    "planned_points",
    "kv_bytes_per_token",
    "measured_from_sweep",
    "plan",
    "recommend",
]

Backend = Literal["generate", "continuous", "vllm"]

# The seed measured parity at N=8 and a ~1.25x speed-up from N=32 on an A100; below 32 the engine's
# per-step overhead is not paid back by recycling.
CB_MIN_N = 32
# Share of generate()'s decode slots wasted on rows that already finished (1 - mean/max completion
# length) above which lengths count as "variable". A judgement call: below ~20% there is little padding
# for recycling to win back.
VARIABLE_WASTE = 0.2
# Coefficient of variation of completion lengths treated the same way (0.2 ~ lengths within +-20%).
VARIABLE_CV = 0.2

# transformers' defaults the engine falls back to (initialization.py FALLBACK_DEFAULTS, cache.py).
_DEFAULT_MAX_BATCH_TOKENS = 8192
_FALLBACK_MAX_REQUESTS_PER_BATCH = 1024
_SECTOR_ALIGN_BYTES = 128


@dataclass(frozen=True)
class GeneratePlan:
    """`generate()`'s memory for one rollout, bytes above the weights."""

    rows: int
    padded_len: int  # longest prompt + decode steps: every row's KV length at the end
    kv_bytes: int
    prefill_bytes: int  # the first forward: prompt KV + activations of rows x longest prompt tokens
    decode_transient_bytes: int  # last step: logits and their copies, plus one layer's torch.cat
    peak_bytes: int
    fits: bool | None  # None without a budget


@dataclass(frozen=True)
class ContinuousPlan:
    """The CB engine's memory for one rollout, bytes above the weights."""

    sized_by: Literal["num_blocks", "workload", "memory"]
    num_blocks: int  # whole-model blocks of page_size tokens, as the engine reports them
    num_sectors: int
    page_size: int
    max_batch_tokens: int
    pool_bytes: int  # num_blocks x page_size x KV bytes/token: the capacity (as telemetry reports it)
    cache_tensor_bytes: int  # the tensor actually allocated: sectors + the two trash sectors
    buffer_bytes: int  # IO tensors and attention masks, allocated up front for max_batch_tokens
    transient_bytes: int  # activations of a full batch, cache reads, LM-head rows
    engine_reserved_bytes: int  # what the engine budgets for itself (compute_memory_footprint)
    peak_bytes: int
    full_length_sequences: int  # how many sequences the pool holds at prompt + max_new_tokens at once
    fits: bool | None


@dataclass(frozen=True)
class Plan:
    model: str
    num_prompts: int
    num_generations: int
    num_sequences: int
    prompt_len: int  # the longest prompt
    max_new_tokens: int
    dtype_bytes: int
    device: str
    budget_bytes: int | None
    kv_bytes_per_token: int
    generate: GeneratePlan
    continuous: ContinuousPlan
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """The plan as a few readable lines (what `cbkit advise` prints)."""
        g, c = self.generate, self.continuous
        budget = f"budget {_fmt(self.budget_bytes)} (free memory after weights)" if self.budget_bytes else "no budget"
        lines = [
            f"{self.model}: {self.num_prompts} prompts x N={self.num_generations} = {self.num_sequences} sequences, "
            f"prompt {self.prompt_len} + up to {self.max_new_tokens} new tokens, {self.dtype_bytes}-byte dtype, "
            f"{self.device}, {budget}",
            f"KV cache: {_fmt(self.kv_bytes_per_token)} per token",
            f"generate():  peak {_fmt(g.peak_bytes):>10}{_fit(g.fits)}  KV {_fmt(g.kv_bytes)} "
            f"({g.rows} rows x {g.padded_len} positions, held until the last row ends) + last-step transients "
            f"{_fmt(g.decode_transient_bytes)}; first forward {_fmt(g.prefill_bytes)}",
            f"continuous:  peak {_fmt(c.peak_bytes):>10}{_fit(c.fits)}  pool {_fmt(c.cache_tensor_bytes)} "
            f"({c.num_blocks} blocks x {c.page_size} tokens, sized by {c.sized_by}) + buffers "
            f"{_fmt(c.buffer_bytes)} + transients {_fmt(c.transient_bytes)}; holds {c.full_length_sequences} "
            f"sequences at full length at once",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


# Where the N and length-spread thresholds come from when no sweep of this machine is given.
SEED_BASIS = (
    "thresholds from TRL's reported A100 benchmark (Llama-3.2-1B-Instruct, GSM8K: parity with generate() at "
    "N=8, ~1.25x at N=32 and N=64), not from this machine; give --from runs/sweep.jsonl to decide from a sweep "
    "measured here"
)
# Measured speed ratios within this margin of 1.0 count as parity: repeats of one point on a shared machine
# differ by a few percent, so a 3% "win" is not one.
PARITY_MARGIN = 0.05


@dataclass(frozen=True)
class Advice:
    backend: Backend
    reasons: list[str]
    basis: str | None = None  # where the thresholds behind the decision came from

    def __str__(self) -> str:
        text = f"use {self.backend}:\n" + "\n".join(f"  - {r}" for r in self.reasons)
        return text + (f"\n  basis: {self.basis}" if self.basis else "")


@dataclass(frozen=True)
class Measured:
    """What a sweep results file measured at the N closest to the one asked about (`measured_from_sweep`)."""

    path: str
    n: int  # the measured N used
    asked_n: int
    workload: str | None
    device: str | None
    speed_vs_generate: float | None  # continuous tokens/s over generate()'s, median of repeats
    mem_vs_generate: float | None
    length_mean: float | None  # generate()'s runs: the static batch is the one that pads
    length_cv: float | None
    length_max: float | None
    static_padding_share: float | None

    def describe(self) -> str:
        where = f"N={self.n}" + (f" (nearest measured to N={self.asked_n})" if self.n != self.asked_n else "")
        spread = (f"lengths mean {self.length_mean:.1f}, CV {self.length_cv:.2f}, max {self.length_max:.0f}, "
                  f"static batch padding {self.static_padding_share:.0%}" if self.length_mean is not None
                  else "no length statistics recorded")
        return f"{self.path}: {where}, {self.workload or 'natural'} workload on {self.device or 'unknown'}; {spread}"


def measured_from_sweep(path: str, num_generations: int) -> Measured:
    """Read a `cbkit sweep` results file and take its medians at N (or the nearest measured N, larger on a tie)."""
    import json
    from pathlib import Path

    from cbkit.sweep import aggregate, load_runs

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--from: no sweep results at {p}; run `cbkit sweep --out {p}` first.")
    first = next((line for line in p.read_text().splitlines() if line.strip()), "")
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        header = {}
    if header.get("kind") != "header":
        raise ValueError(f"--from: {p} is not a cbkit sweep results file (no header line).")
    points = aggregate(load_runs(p))
    by = {(q["backend"], q["N"]): q for q in points if q["status"] == "ok"}
    ns = sorted(n for (b, n) in by if b == "continuous" and ("generate", n) in by)
    if not ns:
        raise ValueError(f"--from: {p} has no N at which both generate and continuous finished; nothing to compare.")
    n = min(ns, key=lambda x: (abs(x - num_generations), -x))
    cb, gen = by[("continuous", n)], by[("generate", n)]
    fp = header.get("fingerprint", {})
    return Measured(str(p), n, num_generations, fp.get("lengths"), fp.get("device"), cb.get("speed_vs_generate"),
                    cb.get("mem_vs_generate"), gen.get("length_mean"), gen.get("length_cv"), gen.get("length_max"),
                    gen.get("static_padding_share"))


# --- the planner --------------------------------------------------------------------------------------------


def plan(
    config: Any,
    *,
    num_prompts: int,
    num_generations: int,
    prompt_len: int | Sequence[int],
    max_new_tokens: int,
    dtype_bytes: int,
    mean_completion_len: float | None = None,
    budget_bytes: int | None = None,
    max_memory_percent: float | None = None,
    page_size: int | None = None,
    max_batch_tokens: int | None = None,
    num_blocks: int | None = None,
    cb_config: Mapping[str, Any] | None = None,
    device: Literal["cuda", "cpu"] = "cuda",
    attn_implementation: Literal["sdpa", "eager", "flash"] | None = None,
    logits_to_keep: bool = True,
    model_name: str = "model",
) -> Plan:
    """Predict the peak memory above the weights of one rollout through each backend.

    ``prompt_len`` is one length for every prompt or one per prompt. ``budget_bytes`` is the memory free
    after the weights are loaded (on a GPU what ``torch.cuda.mem_get_info`` reports then); CB on a GPU
    needs it, because the engine sizes its pool as a share of it. ``max_memory_percent``, ``page_size``,
    ``max_batch_tokens``, ``num_blocks`` and ``cb_config`` are the continuous backend's overrides, with
    cbkit's defaults where left out. ``attn_implementation`` is what the engine runs: "flash" where a
    flash-attention package is installed on CUDA (the engine switches to it), else "sdpa". None means
    what cbkit's continuous backend runs: on CPU its per-sequence varlen attention, which the engine
    treats as flash (no dense mask; cbkit/rollout/cpu_attention.py), on CUDA "sdpa".
    """
    if attn_implementation is None:
        attn_implementation = "flash" if device == "cpu" else "sdpa"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    lens = _prompt_lens(prompt_len, num_prompts)
    _check_positive(num_prompts=num_prompts, num_generations=num_generations, max_new_tokens=max_new_tokens,
                    dtype_bytes=dtype_bytes)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}.")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0 (free memory after the weights), got {budget_bytes}.")
    if mean_completion_len is not None and not 1 <= mean_completion_len <= max_new_tokens:
        raise ValueError(
            f"mean_completion_len must be between 1 and max_new_tokens={max_new_tokens}, got {mean_completion_len}."
        )
    shape = _Shape.of(text, dtype_bytes)
    rows = num_prompts * num_generations
    gen = _plan_generate(shape, rows, max(lens), max_new_tokens, budget_bytes)
    cb, notes = _plan_continuous(
        shape, lens, num_generations, max_new_tokens, mean_completion_len, budget_bytes, device,
        attn_implementation, logits_to_keep,
        overrides={**(cb_config or {}), **_given(max_memory_percent=max_memory_percent, page_size=page_size,
                                                 max_batch_tokens=max_batch_tokens, num_blocks=num_blocks)},
    )
    return Plan(model_name, num_prompts, num_generations, rows, max(lens), max_new_tokens, dtype_bytes, device,
                budget_bytes, kv_bytes_per_token(text, dtype_bytes), gen, cb, notes)


def planned_points(config: Any, ns: Sequence[int], **plan_kwargs: Any) -> list[dict[str, Any]]:
    """The planner over a range of N, as sweep-shaped points (backend, N, planned_peak_bytes, kv_bytes) that
    `cbkit.plots.memory_vs_n` draws next to, or instead of, measured ones. ``plan_kwargs`` go to `plan`
    (everything but ``num_generations``)."""
    points = []
    for n in ns:
        p = plan(config, num_generations=n, **plan_kwargs)
        points.append({"backend": "generate", "N": n, "status": "ok", "planned_peak_bytes": p.generate.peak_bytes,
                       "kv_bytes": p.generate.kv_bytes})
        points.append({"backend": "continuous", "N": n, "status": "ok",
                       "planned_peak_bytes": p.continuous.peak_bytes, "kv_bytes": p.continuous.pool_bytes})
    return points


def crossover_n(config: Any, *, max_n: int = 1024, **plan_kwargs: Any) -> int | None:
    """The smallest N at which CB's predicted peak is below generate()'s, or None up to ``max_n``.

    Takes ``plan``'s keywords except ``num_generations``. On a GPU the CB pool does not grow with N and
    generate()'s KV grows linearly, so above the crossover CB stays the lighter one.
    """
    if "num_generations" in plan_kwargs:
        raise TypeError("crossover_n scans N itself; do not pass num_generations.")
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}.")
    for n in range(1, max_n + 1):
        p = plan(config, num_generations=n, **plan_kwargs)
        if p.continuous.peak_bytes < p.generate.peak_bytes:
            return n
    return None


@dataclass(frozen=True)
class _Shape:
    """The numbers of a config the planner needs, read the way transformers' CB engine reads them."""

    layers: int
    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    a: int  # dtype bytes

    @classmethod
    def of(cls, cfg: Any, a: int) -> _Shape:
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layers = cfg.num_hidden_layers
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        # Mirrors group_layers_by_attn_type (cache.py): no layer_types + a sliding window = all sliding.
        if types is None:
            sliding = layers if window is not None else 0
        else:
            unknown = set(types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ValueError(f"The planner knows full and sliding-window attention only, not {sorted(unknown)}.")
            sliding = sum(t == "sliding_attention" for t in types)
        return cls(layers, layers - sliding, sliding, window if sliding else None, heads, kv_heads, head_dim,
                   cfg.hidden_size, getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
                   cfg.vocab_size, a)

    @property
    def kv_layer_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.a

    def forward_bytes_per_token(self) -> int:
        """Activations of one token inside one decoder layer, no gradients: the residual and its normed copy,
        plus the larger of the attention projections and the MLP's gate, up and product."""
        attn = self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim + self.hidden
        mlp = 3 * self.intermediate
        return self.a * (2 * self.hidden + max(attn, mlp))


def _plan_generate(s: _Shape, rows: int, prompt: int, max_new: int, budget: int | None) -> GeneratePlan:
    length = prompt + max_new
    # Sliding-window layers keep at most `window` tokens (DynamicSlidingWindowLayer).
    tokens_held = s.full_layers * length + s.sliding_layers * min(length, s.sliding_window or length)
    kv = rows * tokens_held * s.kv_layer_token
    # Last step: the model's logits (logits_to_keep=1), generate's fp32 copy, the log-probs cbkit's
    # recorder keeps, the softmax it samples from; and torch.cat holding one layer's old K beside the new.
    decode = rows * s.vocab * (s.a + 3 * 4) + rows * length * s.kv_layer_token // 2
    prefill = (rows * prompt * s.layers * s.kv_layer_token + rows * prompt * s.forward_bytes_per_token()
               + rows * prompt * prompt  # the 4-D boolean padding mask
               + rows * s.vocab * (s.a + 4))
    peak = max(kv + decode, prefill)
    return GeneratePlan(rows, length, kv, prefill, decode, peak, None if budget is None else peak <= budget)


def _plan_continuous(
    s: _Shape,
    lens: list[int],
    n: int,
    max_new: int,
    mean_completion: float | None,
    budget: int | None,
    device: str,
    attn: str,
    logits_to_keep: bool,
    overrides: dict[str, Any],
) -> tuple[ContinuousPlan, list[str]]:
    import torch

    from cbkit.rollout.continuous import make_cb_config

    notes: list[str] = []
    requests = len(lens) * n
    # What cbkit's continuous backend hands the engine, built by the same function.
    page = int(overrides.get("page_size", overrides.get("block_size", _default_page_size())))
    workload = n * sum(-(-(p + max_new) // page) for p in lens) + 1  # cbkit.rollout.continuous.workload_blocks
    cfg = make_cb_config(overrides, device=torch.device(device), workload_blocks=workload)

    # resolve_using_hints / resolve_without_hints / ensure_decode_fast_path_is_available (initialization.py)
    flash = attn == "flash"
    max_rpb = cfg.max_requests_per_batch or min(requests, _FALLBACK_MAX_REQUESTS_PER_BATCH)
    blocks_per_req = 0
    if device == "cuda" and flash and cfg.max_blocks_per_request != 0:
        blocks_per_req = cfg.max_blocks_per_request or _hinted_blocks_per_request(max(lens) + max_new, page)
    # decide_use_cuda_graphs / decide_use_async_batching: graphs only on CUDA; async needs graphs and no mask.
    graphs = cfg.use_cuda_graph if cfg.use_cuda_graph is not None else flash
    graphs = device == "cuda" and (any(graphs) if isinstance(graphs, tuple | list) else bool(graphs))
    use_async = cfg.use_async_batching if cfg.use_async_batching is not None else (graphs and flash)
    mmp = cfg.max_memory_percent if cfg.max_memory_percent is not None else (0.6 if device == "cpu" else 0.8)
    m = cfg.max_batch_tokens or _DEFAULT_MAX_BATCH_TOKENS

    # PagedAttentionCache.__init__: sectors are the LCM of each attention type's block bytes and 128 bytes.
    page_bytes = s.kv_layer_token * page
    group_block_bytes = [k * page_bytes for k in (s.full_layers, s.sliding_layers) if k]
    sector = math.lcm(*group_block_bytes, _SECTOR_ALIGN_BYTES)
    tokens_per_sector = max((sector // b) * page for b in group_block_bytes)
    block = s.layers * page_bytes

    # PagedAttentionMemoryHandler (cache.py)
    i32, i64, groups = 4, 8, len(group_block_bytes)
    io_mult = 2 if use_async else 1
    kv_heads_at_peak = 2 * s.kv_heads if flash else 2 * s.heads + s.kv_heads
    masks = 0 if flash else (2 if s.sliding_layers else 1)
    lm_row = s.hidden * s.a + s.vocab * 4
    attention_peak = s.a * (s.hidden + s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim
                            + kv_heads_at_peak * s.head_dim)
    io_per_token = io_mult * (7 * i32 + 2 * i32 + groups * blocks_per_req * i32 + 2 * groups * i64)
    per_batch_token = max(0 if logits_to_keep else lm_row, attention_peak) + io_per_token
    per_cache_token = kv_heads_at_peak * s.head_dim * s.a + io_mult * groups * i64
    per_cache_sector = sector + tokens_per_sector * per_cache_token
    fixed = 2 * sector + (max_rpb * lm_row if logits_to_keep else 0)

    def mask_bytes(sectors: int) -> int:
        return io_mult * masks * s.a * m * (sectors * tokens_per_sector + m)

    if cfg.num_blocks is not None:
        sectors = max(1, math.ceil(cfg.num_blocks * block / sector))
        sized_by = "workload" if cfg.num_blocks == workload and "num_blocks" not in overrides else "num_blocks"
    else:
        if budget is None:
            raise ValueError(
                "The CB engine sizes its pool as a share of free memory: give budget_bytes (free memory after "
                "the weights), or num_blocks to fix the pool."
            )
        available = int(budget * mmp)
        sectors = (available - fixed - m * per_batch_token) // per_cache_sector
        masked = mask_bytes(sectors)
        sectors -= math.ceil(masked / (per_cache_sector + mask_bytes(sectors + 1) - masked))
        sized_by = "memory"
        if sectors <= 0:
            notes.append(f"CB: {mmp:.0%} of the budget does not cover the engine's buffers for "
                         f"max_batch_tokens={m}; the engine would refuse to start.")
            sectors = 0
    engine_reserved = fixed + m * per_batch_token + sectors * per_cache_sector + mask_bytes(sectors)

    resolved_blocks = sectors * sector // block
    pool_tokens = resolved_blocks * page
    full_len = max(lens) + max_new
    completion = mean_completion if mean_completion is not None else max_new
    # Tokens alive at once: every request at its (mean) full length if the pool holds them, else the pool.
    alive = min(pool_tokens, int(sum(n * (p + completion) for p in lens)))
    batch_tokens = min(m, sum(lens) * n)  # a prefill batch is packed up to max_batch_tokens
    transient = (batch_tokens * s.forward_bytes_per_token() + alive * kv_heads_at_peak * s.head_dim * s.a
                 + min(requests, max_rpb) * lm_row)
    cache_tensor = (sectors + 2) * sector
    buffers = m * io_per_token + mask_bytes(sectors)
    if device == "cpu":
        # The mask is torch.empty: host pages become resident only where a batch writes its
        # [batch tokens, batch tokens + cache tokens read] corner, so RSS sees that corner, not the tensor.
        buffers = m * io_per_token + io_mult * masks * s.a * batch_tokens * (batch_tokens + alive)
        if mask_bytes(sectors):  # no mask at all with a varlen (flash-style) attention
            notes.append(f"CPU: the engine reserves {_fmt(mask_bytes(sectors))} of attention mask "
                         f"(max_batch_tokens={m} x cache tokens) but only the part a batch writes becomes resident.")
    peak = cache_tensor + buffers + transient
    if pool_tokens and pool_tokens < requests * full_len:
        notes.append(f"CB: the pool holds {pool_tokens // full_len} of {requests} sequences at full length; "
                     "the rest wait for recycled blocks (that is the point, not an error).")
    fits = None if budget is None else (sectors > 0 and peak <= budget)
    return ContinuousPlan(sized_by, resolved_blocks, sectors, page, m, resolved_blocks * block, cache_tensor,
                          buffers, transient, engine_reserved, peak, pool_tokens // full_len, fits), notes


def _hinted_blocks_per_request(max_len: int, page: int) -> int:
    blocks = math.ceil(max_len / page) + 1
    return blocks + blocks % 2


def _default_page_size() -> int:
    from transformers import ContinuousBatchingConfig

    default = ContinuousBatchingConfig()
    return int(getattr(default, "page_size", getattr(default, "block_size", 256)))


def _prompt_lens(prompt_len: int | Sequence[int], num_prompts: int) -> list[int]:
    if isinstance(prompt_len, int):
        lens = [prompt_len] * max(num_prompts, 0)
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}.")
    else:
        lens = [int(p) for p in prompt_len]
        if len(lens) != num_prompts:
            raise ValueError(f"prompt_len gives {len(lens)} lengths for num_prompts={num_prompts}.")
        if any(p < 1 for p in lens):
            raise ValueError(f"every prompt length must be >= 1, got {min(lens)}.")
    return lens


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


# --- the decision guide -------------------------------------------------------------------------------------


def recommend(
    num_generations: int,
    *,
    completion_cv: float | None = None,
    mean_completion_len: float | None = None,
    max_new_tokens: int | None = None,
    multimodal: bool = False,
    need_max_throughput: bool = False,
    num_gpus: int = 1,
    tensor_parallel: bool = False,
    memory: Plan | None = None,
    measured: Measured | None = None,
) -> Advice:
    """The seed's guide: generate() for N < 32; CB for N >= 32 with variable completion lengths, text only,
    in-process (no weight sync); vLLM for maximum throughput or tensor parallel / multi-node. A plan with a
    budget adds the memory rule: when generate() won't fit and CB will, CB.

    Completion-length spread is ``completion_cv`` (std / mean) or ``mean_completion_len`` over
    ``max_new_tokens`` (generate()'s wasted decode slots are about 1 - mean/max); unknown counts as
    variable, as GRPO completions usually are, and the reasons say it was assumed.

    Those N and spread thresholds are the seed's GPU measurements (``Advice.basis`` says so). ``measured``, a
    sweep of this machine (`measured_from_sweep`), replaces them: its speed and memory ratios at the nearest
    N, under the length workload it ran, decide instead.
    """
    _check_positive(num_generations=num_generations, num_gpus=num_gpus)
    n = num_generations
    if tensor_parallel:
        return Advice("vllm", [
            "tensor parallel (a model split over GPUs): cbkit's backends run one model copy on one device; "
            "vLLM serves a tensor-parallel model, driven from TRL's GRPOTrainer (cbkit.trl_bridge)",
        ])
    reasons: list[str] = []
    if num_gpus > 1:
        reasons.append(f"{num_gpus} GPUs: run data parallel through TRL's GRPOTrainer under accelerate "
                       "(cbkit.trl_bridge); each GPU's rollout follows the rest of this advice")
    if need_max_throughput:
        return Advice("vllm", reasons + [
            "maximum rollout throughput: vLLM's kernels and scheduler beat transformers' CB engine; the price "
            "is a weight sync into vLLM after every optimizer step (server or colocate mode in TRL)",
        ])
    gen_fits = memory.generate.fits if memory is not None else None
    cb_fits = memory.continuous.fits if memory is not None else None
    if multimodal:
        reasons.append("multimodal inputs: transformers' CB engine takes token ids only (text only), so not "
                       "continuous; vLLM is the fast path for multimodal rollouts")
        if gen_fits is False:
            reasons.append(f"generate() is predicted to need {_fmt(memory.generate.peak_bytes)} of a "
                           f"{_fmt(memory.budget_bytes)} budget: lower N or the prompts per step")
        return Advice("generate", reasons)
    if gen_fits is False and cb_fits:
        return Advice("continuous", reasons + [
            f"memory: generate() is predicted to need {_fmt(memory.generate.peak_bytes)} (KV for every row at "
            f"full length) and the budget is {_fmt(memory.budget_bytes)}; CB's fixed pool fits "
            f"({_fmt(memory.continuous.peak_bytes)}) and recycles blocks as sequences finish",
        ])
    if gen_fits is False and cb_fits is False:
        lighter: Backend = "continuous" if memory.continuous.peak_bytes < memory.generate.peak_bytes else "generate"
        return Advice(lighter, reasons + [
            f"memory: neither backend is predicted to fit the {_fmt(memory.budget_bytes)} budget "
            f"(generate {_fmt(memory.generate.peak_bytes)}, CB {_fmt(memory.continuous.peak_bytes)}); "
            f"{lighter} is the lighter. Lower N, the prompts per step or max_new_tokens",
        ])
    if measured is not None:  # this machine's sweep replaces the seed's N and spread thresholds
        return _from_measured(measured, reasons)
    if n < CB_MIN_N:
        return Advice("generate", reasons + [
            f"N={n} < {CB_MIN_N}: the seed measured parity at N=8; with few sequences per prompt the padded "
            "static batch wastes little and CB's per-step scheduling overhead is not paid back",
        ], SEED_BASIS)
    variable, spread = _spread(completion_cv, mean_completion_len, max_new_tokens)
    if not variable:
        return Advice("generate", reasons + [
            f"N={n} >= {CB_MIN_N} but completion lengths are uniform ({spread}): generate() wastes few decode "
            "slots, so there is little for recycling to win back",
        ], SEED_BASIS)
    return Advice("continuous", reasons + [
        f"N={n} >= {CB_MIN_N} with variable completion lengths ({spread}): generate() keeps finished rows "
        "in the batch until the longest ends, CB recycles their blocks and slots (~1.25x at N=32/64 in the seed)",
        "text only, and the engine runs in the training process on the same weights: no weight sync",
    ], SEED_BASIS)


def _from_measured(m: Measured, reasons: list[str]) -> Advice:
    """The speed rule from a sweep of this machine instead of the seed's thresholds: CB when it measured
    faster than generate() by more than the parity margin, generate() when slower; at parity the lighter."""
    basis = f"measured: {m.describe()}"
    speed, mem = m.speed_vs_generate, m.mem_vs_generate
    if speed is None:
        raise ValueError(f"--from: {m.path} has no speed ratio at N={m.n}.")
    mem_text = f", {mem:.2f}x its peak memory" if mem is not None else ""
    said = f"CB measured {speed:.2f}x generate()'s completion tokens/s at N={m.n}{mem_text}"
    if speed > 1 + PARITY_MARGIN:
        return Advice("continuous", reasons + [
            f"{said}: recycling finished rows' slots pays for the engine's overhead at this length spread",
            "text only, and the engine runs in the training process on the same weights: no weight sync",
        ], basis)
    if speed < 1 - PARITY_MARGIN:
        return Advice("generate", reasons + [
            f"{said}: at this length spread the engine's per-step overhead costs more than the padding it saves",
        ], basis)
    lighter: Backend = "continuous" if mem is not None and mem < 1 - PARITY_MARGIN else "generate"
    return Advice(lighter, reasons + [
        f"{said}: parity within {PARITY_MARGIN:.0%}, so memory decides"
        + (": CB's pool is the lighter" if lighter == "continuous" else ": generate() is no heavier"),
    ], basis)


def _spread(cv: float | None, mean: float | None, max_new: int | None) -> tuple[bool, str]:
    if cv is not None:
        if cv < 0:
            raise ValueError(f"completion_cv must be >= 0, got {cv}.")
        return cv >= VARIABLE_CV, f"coefficient of variation {cv:.2f}"
    if mean is not None and max_new is not None:
        if not 0 < mean <= max_new:
            raise ValueError(f"mean_completion_len must be in (0, max_new_tokens={max_new}], got {mean}.")
        waste = 1 - mean / max_new
        return waste >= VARIABLE_WASTE, f"mean {mean:.1f} of max {max_new}: ~{waste:.0%} of generate()'s decode slots wasted"
    return True, "assumed: no completion-length statistics given"


# --- formatting ---------------------------------------------------------------------------------------------


def _fmt(n: int | float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _fit(fits: bool | None) -> str:
    return "" if fits is None else (" (fits)" if fits else " (DOES NOT FIT)")


# --- reading a model's config without its weights -----------------------------------------------------------


def load_config(name: str) -> Any:
    """The transformers config of a name ``cbkit.models.load_policy`` accepts, without loading weights
    where that can be avoided."""
    from pathlib import Path

    from transformers import AutoConfig

    from cbkit import models

    if name == models.TINY_NAME:
        return models.tiny_model().config  # a 2-layer model builds in milliseconds; its config is the point
    if name in models.RANDOM_SHAPES:
        return models.random_config(name)
    if name in (models.OFFLINE_NAME, "offline"):
        # Any dequantised copy load_policy cached has the packaged model's config; otherwise read the GGUF
        # header (slow: transformers parses the whole file).
        cached = sorted(models.cache_root().glob("smollm2-135m-instruct-*/config.json"))
        if cached:
            return AutoConfig.from_pretrained(cached[-1].parent)
        gguf = models.offline_gguf_path()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    local = Path(name).expanduser()
    if not local.is_dir() and name.count("/") != 1:  # not a directory, not owner/name: fail before the network
        raise ValueError(f"Unknown model {name!r}. Accepted forms: {models.ACCEPTED_FORMS}.")
    try:
        return AutoConfig.from_pretrained(str(local) if local.is_dir() else name)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not read a model config from {name!r} ({str(e).splitlines()[0]}). Accepted "
                         f"forms: {models.ACCEPTED_FORMS}. Offline, a hub id needs its files in the local cache."
                         ) from None


DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
