"""Will it fit? The memory planner: one rollout's peak memory through each backend, from the model's config.

The planner predicts the peak memory (above the weights) of one rollout of P prompts x N completions for
both backends, from nothing but the model's config:

* ``generate()`` keeps every row of the static batch until the *last* row finishes. Its cache grows step
  by step (transformers' DynamicCache appends with ``torch.cat``), so the peak is reached at the end:
  rows x (longest prompt + decode steps) tokens of KV, plus the per-step transients that scale with
  rows x vocabulary (the logits, their fp32 copy, the log-probs cbkit's recorder keeps, the sampling
  probabilities). The planner takes the decode steps to be ``max_new_tokens``: with many rows, one of them
  usually runs to the limit. That is an upper bound; a batch whose every row stops early uses less. On a
  CPU, glibc keeps the blocks ``torch.cat`` frees resident between the new ones: the plan adds that heap slack
  there (``CPU_HEAP_SLACK``, fitted on one machine: `cbkit.measure.fitted`), never on a GPU.
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

``crossover_n`` is the smallest N at which CB's predicted peak is below ``generate()``'s. The decision guide
that turns a plan into a backend (``recommend``) is `cbkit.measure.advise`.

Accuracy. The CB block count is exact: tests/test_advise.py builds the engine on the tiny model (workload,
``num_blocks`` and memory sizing, default and small ``max_batch_tokens``) and compares. Peak *bytes* are
an estimate, and on CPU a lower bound: RSS counts what the plan does not model (allocator slack, the engine
thread's malloc arena); docs/cpu_results.md has how far apart they were. Every sweep run records its
``plan_error``.

Simplifications: full and sliding-window attention only (no MLA, no linear attention); activations are
counted for inference without gradients; prefix sharing (blocks shared between a group's identical
prompts) is ignored, so CB's *use* of its pool is overestimated, never its size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cbkit.measure.fitted import (
    CPU_CHUNK_HEAP_SLACK,
    CPU_HEAP_SLACK,
    CPU_HEAP_SLACK_MAX,
    GLIBC_MMAP_THRESHOLD_MAX,
)
from cbkit.measure.roofline import Shape
from cbkit.models.load import DTYPES
from cbkit.telemetry import fmt_bytes, kv_bytes_per_token

__all__ = [
    "DTYPE_BYTES",
    "ContinuousPlan",
    "GeneratePlan",
    "Plan",
    "activation_bytes_per_token",
    "crossover_n",
    "plan",
    "pool_blocks",
    "step_peak_bytes",
    "training_bytes",
]

DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}

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
    # CPU only: what glibc's heap keeps resident beside the growing cache (`CPU_HEAP_SLACK`); 0 on a GPU, where the
    # peak is torch's allocated bytes, and on a CPU where each layer's K is above glibc's largest mmap threshold.
    cpu_heap_slack_bytes: int = 0


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
    batch_tokens: int = 0  # the most tokens one forward runs (a prefill batch; prefix sharing shrinks it)


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
        budget = f"budget {fmt_bytes(self.budget_bytes)} (free memory after weights)" if self.budget_bytes else "no budget"
        lines = [
            f"{self.model}: {self.num_prompts} prompts x N={self.num_generations} = {self.num_sequences} sequences, "
            f"prompt {self.prompt_len} + up to {self.max_new_tokens} new tokens, {self.dtype_bytes}-byte dtype, "
            f"{self.device}, {budget}",
            f"KV cache: {fmt_bytes(self.kv_bytes_per_token)} per token",
            f"generate():  peak {fmt_bytes(g.peak_bytes):>10}{_fit(g.fits)}  KV {fmt_bytes(g.kv_bytes)} "
            f"({g.rows} rows x {g.padded_len} positions, held until the last row ends) + last-step transients "
            f"{fmt_bytes(g.decode_transient_bytes)}"
            + (f" + CPU heap slack {fmt_bytes(g.cpu_heap_slack_bytes)}" if g.cpu_heap_slack_bytes else "")
            + f"; first forward {fmt_bytes(g.prefill_bytes)}",
            f"continuous:  peak {fmt_bytes(c.peak_bytes):>10}{_fit(c.fits)}  pool {fmt_bytes(c.cache_tensor_bytes)} "
            f"({c.num_blocks} blocks x {c.page_size} tokens, sized by {c.sized_by}) + buffers "
            f"{fmt_bytes(c.buffer_bytes)} + transients {fmt_bytes(c.transient_bytes)}; holds {c.full_length_sequences} "
            f"sequences at full length at once",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


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
    check_positive(num_prompts=num_prompts, num_generations=num_generations, max_new_tokens=max_new_tokens,
                    dtype_bytes=dtype_bytes)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}.")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0 (free memory after the weights), got {budget_bytes}.")
    if mean_completion_len is not None and not 1 <= mean_completion_len <= max_new_tokens:
        raise ValueError(
            f"mean_completion_len must be between 1 and max_new_tokens={max_new_tokens}, got {mean_completion_len}."
        )
    shape = _Shape.read(text, dtype_bytes)
    rows = num_prompts * num_generations
    gen = _plan_generate(shape, rows, max(lens), max_new_tokens, budget_bytes, device)
    cb, notes = _plan_continuous(
        shape, lens, num_generations, max_new_tokens, mean_completion_len, budget_bytes, device,
        attn_implementation, logits_to_keep,
        overrides={**(cb_config or {}), **_given(max_memory_percent=max_memory_percent, page_size=page_size,
                                                 max_batch_tokens=max_batch_tokens, num_blocks=num_blocks)},
    )
    return Plan(model_name, num_prompts, num_generations, rows, max(lens), max_new_tokens, dtype_bytes, device,
                budget_bytes, kv_bytes_per_token(text, dtype_bytes), gen, cb, notes)


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
class _Shape(Shape):
    """Roofline's `Shape` plus what the planner reads the way transformers' CB engine reads it: which layers
    attend to a sliding window, and the dtype's bytes."""

    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    a: int  # dtype bytes

    @classmethod
    def read(cls, cfg: Any, a: int) -> _Shape:
        base = Shape.of(cfg)
        layers = base.layers
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
        return cls(**dataclasses.asdict(base), full_layers=layers - sliding, sliding_layers=sliding,
                   sliding_window=window if sliding else None, a=a)

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


# generate() on a CPU: transformers' DynamicCache grows with torch.cat, so every step allocates each layer's K and V
# anew and frees the old ones; glibc's heap keeps the freed blocks resident beside the new ones. The plan adds that
# heap (`fitted.CPU_HEAP_SLACK` x the cache, capped), CPU only, and none where one layer's K is above glibc's largest
# mmap threshold (mmapped, handed back when freed).


def _plan_generate(s: _Shape, rows: int, prompt: int, max_new: int, budget: int | None,
                   device: str = "cuda") -> GeneratePlan:
    length = prompt + max_new
    # Sliding-window layers keep at most `window` tokens (DynamicSlidingWindowLayer).
    tokens_held = s.full_layers * length + s.sliding_layers * min(length, s.sliding_window or length)
    kv = rows * tokens_held * s.kv_layer_token
    layer_k = rows * length * s.kv_layer_token // 2  # one layer's K (or V) at the end, one tensor
    slack = (min(int(CPU_HEAP_SLACK * kv), CPU_HEAP_SLACK_MAX)
             if device == "cpu" and layer_k < GLIBC_MMAP_THRESHOLD_MAX else 0)
    # Last step: the model's logits (logits_to_keep=1), generate's fp32 copy, the log-probs cbkit's
    # recorder keeps, the softmax it samples from; and torch.cat holding one layer's old K beside the new.
    decode = rows * s.vocab * (s.a + 3 * 4) + rows * length * s.kv_layer_token // 2
    prefill = (rows * prompt * s.layers * s.kv_layer_token + rows * prompt * s.forward_bytes_per_token()
               + rows * prompt * prompt  # the 4-D boolean padding mask
               + rows * s.vocab * (s.a + 4))
    peak = max(kv + slack + decode, prefill)
    return GeneratePlan(rows, length, kv, prefill, decode, peak, None if budget is None else peak <= budget, slack)


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

    from cbkit.rollout.engine_config import make_cb_config, page_size

    notes: list[str] = []
    requests = len(lens) * n
    # What cbkit's continuous backend hands the engine, resolved by the same function from the same rows
    # (only their lengths matter to the sizing).
    rows = [range(p) for p in lens for _ in range(n)]
    cfg = make_cb_config(overrides, device=torch.device(device), rows=rows, max_new_tokens=max_new, warn=False)
    page = page_size(cfg)

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

    # PagedAttentionMemoryHandler (cache.py), mirrored: its constructor reads *this* machine's free memory (the plan is
    # for a budget, often another GPU's) and its inputs exist only inside PagedAttentionCache on a loaded model.
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
        sized_by = "num_blocks" if "num_blocks" in overrides else "workload"
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
    # A prefill batch is packed up to max_batch_tokens. With prefix sharing (the engine's default, full attention
    # only) cbkit's engine prefills each repeated prompt alone first; its N requests then compute only the tokens
    # past its last complete page (the last page again where the prompt fills its pages exactly).
    sharing = cfg.allow_block_sharing and not s.sliding_layers and n > 1
    if sharing:
        shared = [p for p in lens if p >= page]
        tails = sum(n * ((p % page) or page) if p >= page else n * p for p in lens)
        batch_tokens = min(m, max(sum(shared), tails))
    else:
        batch_tokens = min(m, sum(lens) * n)
    transient = (batch_tokens * s.forward_bytes_per_token() + alive * kv_heads_at_peak * s.head_dim * s.a
                 + min(requests, max_rpb) * lm_row)
    cache_tensor = (sectors + 2) * sector
    buffers = m * io_per_token + mask_bytes(sectors)
    if device == "cpu":
        # The mask is torch.empty: host pages become resident only where a batch writes its
        # [batch tokens, batch tokens + cache tokens read] corner, so RSS sees that corner, not the tensor.
        buffers = m * io_per_token + io_mult * masks * s.a * batch_tokens * (batch_tokens + alive)
        if mask_bytes(sectors):  # no mask at all with a varlen (flash-style) attention
            notes.append(f"CPU: the engine reserves {fmt_bytes(mask_bytes(sectors))} of attention mask "
                         f"(max_batch_tokens={m} x cache tokens) but only the part a batch writes becomes resident.")
    peak = cache_tensor + buffers + transient
    if pool_tokens and pool_tokens < requests * full_len:
        notes.append(f"CB: the pool holds {pool_tokens // full_len} of {requests} sequences at full length; "
                     "the rest wait for recycled blocks (that is the point, not an error).")
    fits = None if budget is None else (sectors > 0 and peak <= budget)
    return ContinuousPlan(sized_by, resolved_blocks, sectors, page, m, resolved_blocks * block, cache_tensor,
                          buffers, transient, engine_reserved, peak, pool_tokens // full_len, fits,
                          batch_tokens), notes


def _hinted_blocks_per_request(max_len: int, page: int) -> int:
    blocks = math.ceil(max_len / page) + 1
    return blocks + blocks % 2


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


def check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


# --- the training step beside the rollout ----------------------------------------------------------------------

# fp32 master weights, their gradients and AdamW's two moments: 4 + 4 + 8 bytes a parameter.
TRAIN_STATE_BYTES_PER_PARAM = 16


def training_bytes(params: int, *, micro_batch_rows: int, tokens_per_row: int, completion_len: int, config: Any,
                   autocast: bool, chunk_rows: int | None = None) -> dict[str, int]:
    """What a training step holds at once, by part: the optimizer state (16 bytes a parameter), one forward's
    loss logits (`cbkit.train.batch.logits_bytes`) and its saved activations (`activation_bytes_per_token` for each
    of its rows x ``tokens_per_row`` tokens). A forward is the micro-batch, or `chunk_rows` of its rows (the loop's
    `forward_chunk_rows`: each chunk is back-propagated before the next is forwarded). An estimate: the loop's
    other buffers are not counted."""
    from cbkit.train.batch import logits_bytes

    rows = micro_batch_rows if chunk_rows is None else min(chunk_rows, micro_batch_rows)
    s = Shape.of(config)  # roofline's reading of the widths and layers (text config included)
    parts = {"optimizer_state": TRAIN_STATE_BYTES_PER_PARAM * params,
             "logits": logits_bytes(rows, completion_len, s.vocab),
             "activations": rows * tokens_per_row * activation_bytes_per_token(config, tokens_per_row, autocast)}
    return {**parts, "total": sum(parts.values())}


def activation_bytes_per_token(config: Any, tokens_per_row: int, autocast: bool) -> int:
    """What autograd keeps for the backward per token of a training forward, all decoder layers, in transformers'
    Llama-family layer with SDPA and a padding mask (the loop's teacher-forced forward). Counted tensor by tensor
    (``torch.autograd.graph.saved_tensors_hooks``; a test repeats the count on the
    tiny model), per token and layer: each of the two RMSNorms keeps its input, the normalised input and its output
    (3 x hidden each); the attention keeps q, k and v as SDPA gets them (k and v repeated to every query head: with
    a mask transformers does not take SDPA's GQA path), SDPA's output and log-sum-exp (one a head), and its float
    mask (one a key position: ``tokens_per_row``); the gated MLP keeps the gate and up projections, SiLU(gate) and
    their product (4 x intermediate). The final norm's 3 x hidden is added once. Elements of 4 bytes (fp32
    weights, no autocast) or 2 (autocast: its norms stay fp32, so this is the lower side).

    Korthikanti et al.'s 34 x hidden bytes a token and layer (GPT's layer, 16-bit; doubled for fp32) is a fifth short
    of this count on SmolLM2-135M: SwiGLU keeps four intermediate-wide tensors where GPT's GeLU MLP keeps two, and
    the attention keeps k and v at the query heads' width."""
    s = Shape.of(config)
    attention = 4 * s.heads * s.head_dim + s.heads + tokens_per_row
    per_layer = 6 * s.hidden + attention + 4 * s.intermediate
    return (2 if autocast else 4) * (s.layers * per_layer + 3 * s.hidden)


# fp32 gradients (4 bytes a parameter) and AdamW's two fp32 moments (8): what an update adds beside the weights.
GRAD_BYTES_PER_PARAM, ADAM_BYTES_PER_PARAM = 4, 8


# The backward on a CPU: every chunk's activations are freed to glibc's heap and stay resident, and the next chunk,
# of another width, fits only partly into their holes, so the floor under each backward rises over the first chunks
# and levels off: the plan adds `fitted.CPU_CHUNK_HEAP_SLACK` x one chunk's part, CPU only.


def step_peak_bytes(params: int, *, rollout_peak_bytes: int, micro_batch_rows: int, chunk_rows: int | None,
                    tokens_per_row: int, completion_len: int, config: Any, autocast: bool,
                    optimizer_state_resident: bool = False, device: str = "cuda",
                    later_tokens_per_row: int | None = None, later_completion_len: int | None = None) -> dict[str, int]:
    """The peak one GRPO step holds above its loaded weights, and the phase that sets it.

    The phases come one after another, so the peak is the largest of them, not their sum: the rollout's own peak
    (the planner's KV and logits for the backend, `plan`); the backward of one forward (the gradients, which live
    from the first backward to the update, plus one chunk's logits and activations, `training_bytes`); and the
    optimizer step (the gradients beside AdamW's two moments). From the second forward of an update on, every
    gradient already exists when a backward starts, and the LM head's weight gradient (vocabulary x hidden, fp32)
    is computed whole beside the activations before it is added to its ``.grad``: the backward holds that too. With
    `optimizer_state_resident` (every step of a run after the first) the moments are held through the whole step;
    without (a fresh trainer, as the full-step sweep builds for every run) they appear at the update. The
    old-logprob forward keeps no activations. On a CPU (``device="cpu"``) with more than one forward, the backward
    adds the heap its earlier chunks leave resident (``CPU_CHUNK_HEAP_SLACK`` x one chunk's part); never on a GPU.

    ``tokens_per_row`` and ``completion_len`` are the widest row's. The trainer forwards a micro-batch's rows longest
    first (`batch.longest_first_chunks`), so where the rows' lengths are known (a replayed workload), ``later_tokens_per_row`` and
    ``later_completion_len`` give the widest row after the first chunk: the backwards that hold every gradient are
    planned at that width, the first backward at the widest. None: every chunk as wide as the first (the plan made
    before a rollout, when any completion may run to the limit)."""
    def chunk_bytes(tokens: int, completion: int) -> int:
        train = training_bytes(params, micro_batch_rows=micro_batch_rows, tokens_per_row=tokens,
                               completion_len=completion, config=config, autocast=autocast, chunk_rows=chunk_rows)
        return train["logits"] + train["activations"]

    grads, moments = GRAD_BYTES_PER_PARAM * params, ADAM_BYTES_PER_PARAM * params
    resident = moments if optimizer_state_resident else 0
    s = Shape.of(config)
    first = chunk_bytes(tokens_per_row, completion_len)
    backward = grads + first + resident
    forwards = 1 if chunk_rows is None else -(-micro_batch_rows // chunk_rows)
    if forwards > 1:
        later = first if later_tokens_per_row is None else chunk_bytes(
            min(later_tokens_per_row, tokens_per_row), min(later_completion_len or completion_len, completion_len))
        chunk = later + GRAD_BYTES_PER_PARAM * s.vocab * s.hidden
        slack = int(CPU_CHUNK_HEAP_SLACK * chunk) if device == "cpu" else 0
        backward = max(backward, grads + chunk + slack + resident)
    parts = {"rollout": rollout_peak_bytes + resident,
             "backward": backward,
             "optimizer_step": grads + moments}
    return {**parts, "peak": max(parts.values())}


def pool_blocks(config: Any, pool_bytes: int, *, page_size: int, dtype_bytes: int) -> int:
    """The CB engine's ``num_blocks`` for a pool of ``pool_bytes`` of KV: a pool fixed in bytes, whatever the GPU's
    free memory (the engine's own sizing takes a share of whatever is free)."""
    per_block = kv_bytes_per_token(config, dtype_bytes) * page_size
    if pool_bytes < per_block:
        raise ValueError(f"a pool of {fmt_bytes(pool_bytes)} holds no block of {page_size} tokens "
                         f"({fmt_bytes(per_block)}); give it more memory.")
    return pool_bytes // per_block


# --- formatting ---------------------------------------------------------------------------------------------


def _fit(fits: bool | None) -> str:
    return "" if fits is None else (" (fits)" if fits else " (DOES NOT FIT)")
