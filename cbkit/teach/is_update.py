"""Notebook 02: what the IS correction does to the update itself, the gradient with the rollout's IS weights
against the gradient with every weight 1.
"""

from __future__ import annotations

from typing import Any

import torch


def update_with_and_without_is(trainer: Any, prepared: Any) -> dict[str, float]:
    """How the IS weights change the update on one rollout: the gradient of the weighted log-likelihood of its
    completions, sum_i w_i sum_t log pi(y_it) over the loss's tokens, computed with the rollout's IS weights
    (``prepared.is_weights``, a ``Prepared`` from ``GRPOTrainer.prepare`` on a rollout with sampling logprobs)
    and with every weight 1 (the logprobs dropped). These are the terms the IS weights act on in GRPO's policy
    gradient, before the advantages scale them, so the comparison needs no reward spread: a CI-sized rollout of a
    135M model, whose rewards are often all 0, still shows it. Returns the two gradients' cosine, their norms and
    the norm ratio (without / with); forwarded in the trainer's micro-batches and chunks (`forward_chunk_rows`) as
    its own updates are, and the model's gradients are left cleared (no optimizer step)."""
    from cbkit.train.logprobs import chunked_logits
    from cbkit.train.objective import policy_logprobs

    if prepared.is_weights is None:
        raise ValueError("update_with_and_without_is needs IS weights: prepare a rollout that kept its sampling "
                         "logprobs, with importance_sampling_correction on.")
    model, batch, mask = trainer.model, prepared.batch, prepared.loss_mask
    ga, chunk = trainer.config.gradient_accumulation_steps, trainer.config.forward_chunk_rows
    size = max(1, len(batch) // ga)

    def grad(weighted: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        for start in range(0, len(batch), size):  # the trainer's micro-batches, each in its chunks
            for rows, mb, logits in chunked_logits(model, batch, chunk, start=start, stop=min(start + size, len(batch)),
                                                   autocast_dtype=trainer.autocast_dtype):
                t = mb.completion_width
                logps = policy_logprobs(logits, mb.completion_ids, trainer.config.temperature)
                w = prepared.is_weights[rows, :t] if weighted else 1.0
                (-(logps * w * mask[rows, :t]).sum() / mask.sum()).backward()
        flat = torch.cat([p.grad.detach().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    with_is, without = grad(True), grad(False)
    # Dot products in float64, a slice at a time: two float64 copies of a 135M model's gradient would be 2 GB.
    dot = n_with = n_without = 0.0
    for i in range(0, len(with_is), 1 << 22):
        a, b = with_is[i:i + (1 << 22)].double(), without[i:i + (1 << 22)].double()
        dot, n_with, n_without = dot + float(a @ b), n_with + float(a @ a), n_without + float(b @ b)
    n_with, n_without = n_with ** 0.5, n_without ** 0.5
    from cbkit.telemetry import release_memory

    del with_is, without, a, b  # free the flat gradients before release_memory
    release_memory()  # the two flat gradients (a copy of the model each) and the forwards' heap
    if n_with == 0 or n_without == 0:
        raise ValueError("a gradient is zero: every IS weight is 0 (all completions masked?), so there is nothing "
                         "to compare; widen the band (clip_max) or use a rollout closer to the policy.")
    return {"cosine": dot / (n_with * n_without), "norm_with_is": n_with, "norm_without_is": n_without,
            "norm_ratio": n_without / n_with}
