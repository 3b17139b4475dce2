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
    its own updates are, and the model's gradients are left cleared (no optimizer step).

    A cosine means little without one to read it against, so the same call measures a **noise baseline** from the
    same rollout: the cosine between the unweighted gradients of its first and its second half of completions (two
    minibatches of one update; with whole groups in each half where the rollout has an even number of prompts), IS
    off both times: how far apart two gradients of one update are when only the sample changes
    (``cosine_halves``). The two halves' gradients add up to the unweighted one (each is normalised by the whole
    rollout's token count), and each half forwards only its own rows, so the baseline costs no extra forward."""
    from cbkit.train.logprobs import chunked_logits
    from cbkit.train.objective import policy_logprobs

    if prepared.is_weights is None:
        raise ValueError("update_with_and_without_is needs IS weights: prepare a rollout that kept its sampling "
                         "logprobs, with importance_sampling_correction on.")
    model, batch, mask = trainer.model, prepared.batch, prepared.loss_mask
    ga, chunk = trainer.config.gradient_accumulation_steps, trainer.config.forward_chunk_rows
    size = max(1, len(batch) // ga)
    half = len(batch) // 2

    def grad(weighted: bool, lo: int = 0, hi: int = len(batch)) -> torch.Tensor:
        """The gradient of rows [lo, hi), in the trainer's micro-batches (each cut to those rows) and chunks."""
        model.zero_grad(set_to_none=True)
        for start in range(0, len(batch), size):
            first, stop = max(start, lo), min(start + size, hi)
            if first >= stop:
                continue
            for rows, mb, logits in chunked_logits(model, batch, chunk, start=first, stop=stop,
                                                   autocast_dtype=trainer.autocast_dtype):
                t = mb.completion_width
                logps = policy_logprobs(logits, mb.completion_ids, trainer.config.temperature)
                w = prepared.is_weights[rows, :t] if weighted else 1.0
                (-(logps * w * mask[rows, :t]).sum() / mask.sum()).backward()
        flat = torch.cat([p.grad.detach().flatten() if p.grad is not None else torch.zeros(p.numel())
                          for p in model.parameters() if p.requires_grad])
        model.zero_grad(set_to_none=True)
        return flat

    def dots(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
        """a.b, |a|, |b| in float64, a slice at a time: two float64 copies of a 135M model's gradient are 2 GB."""
        dot = na = nb = 0.0
        for i in range(0, len(a), 1 << 22):
            x, y = a[i:i + (1 << 22)].double(), b[i:i + (1 << 22)].double()
            dot, na, nb = dot + float(x @ y), na + float(x @ x), nb + float(y @ y)
        return dot, na ** 0.5, nb ** 0.5

    with_is = grad(True)
    half_a, half_b = grad(False, 0, half), grad(False, half, len(batch))
    dot_h, n_a, n_b = dots(half_a, half_b)
    without = half_a.add_(half_b)  # the unweighted gradient of the whole rollout, in half_a's memory
    del half_b
    dot, n_with, n_without = dots(with_is, without)
    from cbkit.telemetry import release_memory

    del with_is, without, half_a  # free the flat gradients before release_memory
    release_memory()  # the flat gradients (a copy of the model each) and the forwards' heap
    if n_with == 0 or n_without == 0:
        raise ValueError("a gradient is zero: every IS weight is 0 (all completions masked?), so there is nothing "
                         "to compare; widen the band (clip_max) or use a rollout closer to the policy.")
    halves = dot_h / (n_a * n_b) if n_a and n_b else float("nan")  # nan: a half without a token
    return {"cosine": dot / (n_with * n_without), "norm_with_is": n_with, "norm_without_is": n_without,
            "norm_ratio": n_without / n_with, "cosine_halves": halves}
