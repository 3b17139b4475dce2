"""Will it fit? One rollout's peak memory above the weights through each backend, from the model's config alone.

generate() keeps every row's KV, grown to the longest prompt + ``max_new_tokens``, until the last row finishes; the
CB engine allocates one pool up front (sized by `cbkit.rollout.admission`) plus its largest batch's activations.
Every sweep run records the plan's error. Full and sliding-window attention only."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from cbkit.measure.roofline import Shape
from cbkit.rollout.admission import admission, blocks_needed
from cbkit.rollout.varlen_attention import NAME as VARLEN
from cbkit.telemetry import fmt_bytes
from cbkit.train.batch import logits_bytes

# glibc's largest dynamic mmap threshold on 64-bit Linux (malloc(3)): a larger block is handed back when freed.
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20
CPU_HEAP_SLACK, CPU_HEAP_SLACK_MAX = 0.46, 6 * GLIBC_MMAP_THRESHOLD_MAX  # generate()'s cache: share, cap (fitted)
TRAIN_STATE_BYTES_PER_PARAM = 16  # fp32 master weights, their gradients and AdamW's two moments: 4 + 4 + 8
_FIT = {None: "", True: " (fits)", False: " (DOES NOT FIT)"}  # fits is None without a budget
_ATTENTION = {"flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager", "varlen": VARLEN}


@dataclass(frozen=True)
class GeneratePlan:
    rows: int
    padded_len: int  # longest prompt + decode steps: every row's KV length at the end
    kv_bytes: int
    prefill_bytes: int  # the first forward: prompt KV + activations of rows x longest prompt tokens
    decode_transient_bytes: int  # last step: logits and their copies, plus one layer's torch.cat
    peak_bytes: int
    fits: bool | None  # None without a budget
    cpu_heap_slack_bytes: int = 0  # CPU only, and none where one layer's K is mmapped


@dataclass(frozen=True)
class ContinuousPlan:
    sized_by: Literal["num_blocks", "workload", "memory"]
    num_blocks: int  # whole-model blocks of page_size tokens, as the engine reports them
    page_size: int
    max_batch_tokens: int
    pool_bytes: int  # num_blocks x page_size x KV bytes/token: the capacity (as telemetry reports it)
    cache_tensor_bytes: int  # the tensor the engine allocates
    buffer_bytes: int  # its attention mask (on a CPU the part a batch writes)
    transient_bytes: int  # activations of the largest batch, cache reads, LM-head rows
    engine_reserved_bytes: int  # what the engine budgets for itself (its memory handler's footprint)
    peak_bytes: int
    full_length_sequences: int  # sequences the pool holds at prompt + max_new_tokens at once
    fits: bool | None
    batch_tokens: int = 0  # the most tokens one forward runs


@dataclass(frozen=True)
class Plan:
    generate: GeneratePlan
    continuous: ContinuousPlan
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        g, c = self.generate, self.continuous
        return "\n".join([
            f"generate():  peak {fmt_bytes(g.peak_bytes):>10}{_FIT[g.fits]}  KV {fmt_bytes(g.kv_bytes)} ({g.rows} rows "
            f"x {g.padded_len} positions) + last step {fmt_bytes(g.decode_transient_bytes)}"
            + (f" + CPU heap slack {fmt_bytes(g.cpu_heap_slack_bytes)}" if g.cpu_heap_slack_bytes else ""),
            f"continuous:  peak {fmt_bytes(c.peak_bytes):>10}{_FIT[c.fits]}  pool {fmt_bytes(c.cache_tensor_bytes)} "
            f"({c.num_blocks} blocks x {c.page_size} tokens, sized by {c.sized_by}, {c.full_length_sequences} "
            f"sequences at full length) + mask {fmt_bytes(c.buffer_bytes)} + transients {fmt_bytes(c.transient_bytes)}",
            *[f"note: {n}" for n in self.notes]])


def plan(config: Any, *, num_prompts: int, num_generations: int, prompt_len: int | Sequence[int],
         max_new_tokens: int, dtype_bytes: int, mean_completion_len: float | None = None,
         budget_bytes: int | None = None, cb_config: Mapping[str, Any] | None = None,
         device: Literal["cuda", "cpu"] = "cuda",
         attn_implementation: Literal["sdpa", "eager", "flash", "varlen"] | None = None) -> Plan:
    """The peak memory above the weights of one rollout through each backend. ``prompt_len``: one for all prompts or
    one each; ``budget_bytes``: free after the weights (CB needs it unless ``num_blocks`` is fixed, or on a CPU)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if isinstance(prompt_len, int):
        lens = [prompt_len] * max(num_prompts, 0)
    else:
        lens = [int(p) for p in prompt_len]
        if len(lens) != num_prompts:
            raise ValueError(f"prompt_len gives {len(lens)} lengths for num_prompts={num_prompts}.")
    for name, v in dict(num_prompts=num_prompts, num_generations=num_generations, max_new_tokens=max_new_tokens,
                        dtype_bytes=dtype_bytes, prompt_len=min(lens, default=1)).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}.")
    if attn_implementation not in (None, "sdpa", "eager", "flash", "varlen"):
        raise ValueError(f"attn_implementation must be 'sdpa', 'eager', 'flash', 'varlen' or None (cbkit's choice), "
                         f"got {attn_implementation!r}.")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0 (free memory after the weights), got {budget_bytes}.")
    if mean_completion_len is not None and not 1 <= mean_completion_len <= max_new_tokens:
        raise ValueError(f"mean_completion_len must be between 1 and max_new_tokens={max_new_tokens}, "
                         f"got {mean_completion_len}.")
    overrides = dict(cb_config or {})
    s = Shape.of(text)
    layer_token = 2 * s.kv_heads * s.head_dim * dtype_bytes  # K and V of one token in one layer
    sliding, window = _sliding(text)
    rows = num_prompts * num_generations
    gen = _plan_generate(s, layer_token, sliding, window, rows, max(lens), max_new_tokens, dtype_bytes, budget_bytes, device)

    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    requests = [range(p) for p in lens for _ in range(num_generations)]
    attention = _ATTENTION.get(attn_implementation or "")
    fixed = overrides.get("num_blocks") is not None or (device == "cpu" and "num_blocks" not in overrides)
    if budget_bytes is None and not fixed:
        raise ValueError("The CB engine sizes its pool as a share of free memory: give budget_bytes (free memory "
                         "after the weights), or num_blocks to fix the pool.")
    a = admission(text, overrides, dtype=dtype, rows=requests, max_new_tokens=max_new_tokens, device=device,
                  total_bytes=budget_bytes or 2**50, attention=attention)
    notes = [] if a.fits else [f"CB: the engine would refuse to start: {a.error}"]
    blocks, page, m = a.num_blocks or 0, a.page_size, a.max_batch_tokens or 0
    flash_like = a.mask_bytes == 0
    # The largest batch: with prefix sharing (full attention only) each repeated prompt is prefilled alone first,
    # and its N requests then compute only the tokens past its last complete page.
    if not sliding and num_generations > 1 and overrides.get("allow_block_sharing", True):
        tails = sum(num_generations * ((p % page) or page) if p >= page else num_generations * p for p in lens)
        batch = min(m, max(sum(p for p in lens if p >= page), tails))
    else:
        batch = min(m, sum(lens) * num_generations)
    completion = mean_completion_len if mean_completion_len is not None else max_new_tokens
    alive = min(blocks * page, int(sum(num_generations * (p + completion) for p in lens)))
    kv_heads_at_peak = 2 * s.kv_heads if flash_like else 2 * s.heads + s.kv_heads
    lm_row = s.hidden * dtype_bytes + s.vocab * 4
    transient = (batch * _forward_bytes_per_token(s, dtype_bytes) + alive * kv_heads_at_peak * s.head_dim * dtype_bytes
                 + min(rows, 1024) * lm_row)
    # On a CPU the mask is torch.empty: only the corner a batch writes becomes resident.
    mask = a.mask_bytes if device == "cuda" or not a.mask_bytes else dtype_bytes * batch * (batch + alive)
    peak = (a.cache_bytes or a.footprint_bytes) + mask + transient  # refused: what it would have reserved
    held = blocks // blocks_needed(max(lens), max_new_tokens, page, share_prompt=False)
    if held < rows and blocks:
        notes.append(f"CB: the pool holds {held} of {rows} sequences at full length; the rest wait for recycled "
                     "blocks (that is the point, not an error).")
    sized_by: Literal["num_blocks", "workload", "memory"] = (
        "num_blocks" if overrides.get("num_blocks") is not None else "workload" if fixed else "memory")
    fits = None if budget_bytes is None else (a.fits and peak <= budget_bytes)
    cb = ContinuousPlan(sized_by, blocks, page, m, blocks * page * s.layers * layer_token, a.cache_bytes, mask,
                        transient, a.footprint_bytes, peak, held, fits, batch)
    return Plan(gen, cb, notes)


def crossover_n(config: Any, *, max_n: int = 1024, **plan_kwargs: Any) -> int | None:
    """The smallest N at which CB's planned peak is below generate()'s, or None up to ``max_n`` (``plan``'s keywords
    but ``num_generations``). generate()'s KV grows with N and CB's pool does not: a bisection finds it."""
    def lighter(n: int) -> bool:
        p = plan(config, num_generations=n, **plan_kwargs)
        return p.continuous.peak_bytes < p.generate.peak_bytes

    n = bisect.bisect_left(range(1, max_n + 1), True, key=lighter) + 1
    return n if n <= max_n else None


def _sliding(cfg: Any) -> tuple[int, int | None]:
    """Layers that attend to a sliding window, and the window, as transformers' caches group them."""
    types, window = getattr(cfg, "layer_types", None), getattr(cfg, "sliding_window", None)
    if types is None:  # no layer_types and a window: every layer slides
        return (Shape.of(cfg).layers if window is not None else 0), window
    if set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"The planner knows full and sliding-window attention only, not {sorted(set(types))}.")
    sliding = sum(t == "sliding_attention" for t in types)
    return sliding, window if sliding else None


def _forward_bytes_per_token(s: Shape, a: int) -> int:
    """Activations of one token in one decoder layer, no gradients: the residual, its normed copy, and the larger of
    the attention projections and the MLP's three."""
    return a * (2 * s.hidden + max(s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + s.hidden, 3 * s.intermediate))


def _plan_generate(s: Shape, layer_token: int, sliding: int, window: int | None, rows: int, prompt: int, max_new: int, a: int,
                   budget: int | None, device: str) -> GeneratePlan:
    """DynamicCache grows by torch.cat, so the peak is at the end: every row's KV at full length (a sliding layer keeps
    its window), the last step's logits and their copies, and one layer's old K beside the new."""
    length = prompt + max_new
    kv = rows * ((s.layers - sliding) * length + sliding * min(length, window or length)) * layer_token
    layer_k = rows * length * layer_token // 2
    slack = min(int(CPU_HEAP_SLACK * kv), CPU_HEAP_SLACK_MAX) if device == "cpu" and layer_k < GLIBC_MMAP_THRESHOLD_MAX else 0
    decode = rows * s.vocab * (a + 3 * 4) + layer_k
    prefill = (rows * prompt * (s.layers * layer_token + _forward_bytes_per_token(s, a)) + rows * prompt * prompt
               + rows * s.vocab * (a + 4))
    peak = max(kv + slack + decode, prefill)
    return GeneratePlan(rows, length, kv, prefill, decode, peak, None if budget is None else peak <= budget, slack)


def training_bytes(params: int, *, micro_batch_rows: int, tokens_per_row: int, completion_len: int, config: Any,
                   autocast: bool, chunk_rows: int | None = None) -> dict[str, int]:
    """What a training step holds at once, by part: the optimizer state, one forward's loss logits and its saved
    activations, for the micro-batch or `chunk_rows` of it (the loop's `forward_chunk_rows`)."""
    rows = micro_batch_rows if chunk_rows is None else min(chunk_rows, micro_batch_rows)
    parts = {"optimizer_state": TRAIN_STATE_BYTES_PER_PARAM * params,
             "logits": logits_bytes(rows, completion_len, Shape.of(config).vocab),
             "activations": rows * tokens_per_row * activation_bytes_per_token(config, tokens_per_row, autocast)}
    return {**parts, "total": sum(parts.values())}


def activation_bytes_per_token(config: Any, tokens_per_row: int, autocast: bool) -> int:
    """What autograd keeps per token of a Llama-family training forward (SDPA with a padding mask), as a test counts
    it with ``saved_tensors_hooks``; 4-byte elements, or 2 under autocast."""
    s = Shape.of(config)
    per_layer = 6 * s.hidden + 4 * s.heads * s.head_dim + s.heads + tokens_per_row + 4 * s.intermediate
    return (2 if autocast else 4) * (s.layers * per_layer + 3 * s.hidden)
