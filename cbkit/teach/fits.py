"""Before a notebook trains: will this tier hold the run (the planner's rollout peak beside what training holds),
and how far the precision rule's autocast moves the logprobs on the loaded model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cbkit.teach.notebook import GiB, NotebookEnv


def check_fits(env: NotebookEnv, model: Any, *, prompt_ids: Sequence[Sequence[int]], num_generations: int,
               max_new_tokens: int, gradient_accumulation_steps: int, backend: str = "continuous",
               cb_config: Mapping[str, Any] | None = None, forward_chunk_rows: int | None = None) -> str:
    """Before a training run: will this tier hold it, and what drift will the precision rule give? Runs the
    planner (``cbkit.measure.planner.plan``) for the rollout, with the pool ``cb_config`` fixes, and adds what
    training holds at once (``planner.training_bytes``: fp32 weights, gradients and AdamW's two moments, one
    micro-batch's logits and activations, or one chunk's: ``forward_chunk_rows``, the config's). On a GPU or a tier's dry run, raises with what to change if the rollout
    does not fit the free memory or training does not fit the device; returns the estimate as one line either way
    (on a CPU nothing is refused: RAM is the limit, not a budget). Where the training forwards run under autocast,
    it also measures on the first prompt how far autocast moves the logprobs from the fp32 weights' own: the drift
    the IS ratios will show, on this model."""
    from cbkit.measure.planner import plan, training_bytes

    rows = len(prompt_ids) * num_generations
    params = sum(p.numel() for p in model.parameters())
    micro_rows = rows // gradient_accumulation_steps
    forward_rows = micro_rows if forward_chunk_rows is None else min(forward_chunk_rows, micro_rows)
    train = training_bytes(params, micro_batch_rows=micro_rows, tokens_per_row=max(map(len, prompt_ids)) +
                           max_new_tokens, completion_len=max_new_tokens, config=model.config,
                           autocast=env.autocast_dtype is not None, chunk_rows=forward_chunk_rows)
    free = env.free_memory_bytes()
    memory = plan(model.config, num_prompts=len(prompt_ids), num_generations=num_generations,
                  prompt_len=[len(p) for p in prompt_ids], max_new_tokens=max_new_tokens,
                  dtype_bytes=next(model.parameters()).element_size(), budget_bytes=free,
                  device="cuda" if env.gpu or env.dry_run else "cpu", cb_config=cb_config)
    rollout = memory.continuous if backend == "continuous" else memory.generate
    line = (f"planned: rollout peak {rollout.peak_bytes / GiB:.2f} GiB ({backend}), training "
            f"{train['total'] / GiB:.2f} GiB (weights, gradients, AdamW: {train['optimizer_state'] / GiB:.2f}; "
            f"logits of one forward of {forward_rows} rows: {train['logits'] / GiB:.2f}, budget "
            f"{env.logits_budget_bytes / GiB:.0f}; its activations: {train['activations'] / GiB:.2f})")
    if env.gpu or env.dry_run:
        total = env.gpu_memory_bytes or torch.cuda.get_device_properties(0).total_memory
        if free is not None and rollout.fits is False:  # (fits is None without a budget)
            raise MemoryError(f"{line}: the rollout does not fit the {free / GiB:.1f} GiB free on this GPU. "
                              "Lower N, the prompts per step or max_completion_length.")
        if train["total"] + rollout.peak_bytes > total:
            raise MemoryError(f"{line}: training next to the rollout needs more than this GPU's {total / GiB:.1f} "
                              "GiB. Lower N or the prompts per step, or raise gradient_accumulation_steps.")
    if env.autocast_dtype:
        line += "\n" + autocast_drift(model, prompt_ids[0], env.autocast_dtype)
    return line


def autocast_drift(model: Any, ids: Sequence[int], dtype: str) -> str:
    """How far a forward under ``dtype`` autocast moves the next-token logprobs of ``ids`` from the fp32 weights'
    own forward: measured, the part of the sampling-vs-old-logprob drift that the precision rule adds."""
    x = torch.tensor([list(ids)], device=next(model.parameters()).device)
    with torch.no_grad():
        exact = torch.log_softmax(model(x).logits.float(), -1)
        with torch.autocast(x.device.type, dtype=getattr(torch, dtype)):
            mixed = torch.log_softmax(model(x).logits.float(), -1)
    target = x[:, 1:, None]
    diff = (exact[:, :-1].gather(-1, target) - mixed[:, :-1].gather(-1, target)).abs()
    return (f"{dtype} autocast moved the logprobs of {diff.numel()} prompt tokens by up to {diff.max():.2e} nats "
            f"(mean {diff.mean():.2e}) from the fp32 forward's")
