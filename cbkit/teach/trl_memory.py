"""Notebook 03's reading of TRL's own memory numbers: what a stock TRL step with vLLM needs on a GPU, explained
term by term with the planner's arithmetic.
"""

from __future__ import annotations

from typing import Any, Literal

from cbkit.measure.presets import TRL_PR_5765


def trl_vram_explained(config: Any, *, prompts: int = 8, prompt_len: int = 132, max_new_tokens: int = 2048,
                       memory_bytes: int = 80 * 10**9, pool_share: float = 0.4, dtype_bytes: int = 2,
                       attn_implementation: Literal["sdpa", "eager", "flash"] = "flash") -> str:
    """TRL PR #5765's VRAM column (CB minus generate(), GB) next to the planner's arithmetic for the same shape,
    with what had to be assumed: the PR gives neither its prompts per step nor how its pool was sized. Assumed
    here: ``prompts`` prompts per step of ``prompt_len`` tokens, and a pool of ``pool_share`` of what the training
    step (fp32 weights, gradients and AdamW: 16 bytes a parameter) leaves of ``memory_bytes``, as TRL's example
    sets ``max_memory_percent=0.4`` with the trainer resident. The planner counts generate()'s KV held at the
    padded length and its last-step logits, and the pool with the engine's buffers; not allocator slack."""
    from cbkit.measure.planner import TRAIN_STATE_BYTES_PER_PARAM, plan, pool_blocks
    from cbkit.measure.roofline import Shape

    shape = Shape.of(config)
    params = shape.matmul_params + (0 if getattr(config, "tie_word_embeddings", True) else shape.vocab * shape.hidden)
    pool = int(pool_share * (memory_bytes - TRAIN_STATE_BYTES_PER_PARAM * params))
    cb = {"page_size": 256, "num_blocks": pool_blocks(config, pool, page_size=256, dtype_bytes=dtype_bytes)}
    rows = ["| N | TRL CB - generate() VRAM, GB (measured) | planner CB - generate(), GB | planner generate() peak, GB "
            "| planner CB peak, GB |", "| --- | --- | --- | --- | --- |"]
    for n, (_, _, delta) in sorted(TRL_PR_5765.items()):
        p = plan(config, num_prompts=prompts, num_generations=n, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                 dtype_bytes=dtype_bytes, cb_config=cb, budget_bytes=memory_bytes, device="cuda",
                 attn_implementation=attn_implementation)
        g, c = p.generate.peak_bytes / 1e9, p.continuous.peak_bytes / 1e9
        rows.append(f"| {n} | {delta:+.2f} | {c - g:+.2f} | {g:.2f} | {c:.2f} |")
    rows.append(f"\nAssumed: {prompts} prompts x N per step, {prompt_len}-token prompts, up to {max_new_tokens} new "
                f"tokens, a CB pool of {pool / 1e9:.1f} GB = {pool_share:.0%} x ({memory_bytes / 1e9:.0f} GB - "
                f"{TRAIN_STATE_BYTES_PER_PARAM * params / 1e9:.1f} GB of the training step's fp32 weights, gradients "
                f"and AdamW state), {attn_implementation} attention (no dense mask; under SDPA the engine also "
                "reserves a mask that grows with the pool). Neither the prompts per step nor the pool is stated in the PR: these are the "
                "planner's reading of its numbers, not a reproduction.")
    return "\n".join(rows)
