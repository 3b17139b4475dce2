"""The objective: advantages, the clipped policy loss, KL and the importance-sampling (IS) correction, as TRL 1.16
(`tests/test_objective.py` runs TRL's code as the oracle). With top-p/top-k the IS reference is taken under the
sampler's own distribution (`replayed_logprobs`), so a ratio measures engine-vs-trainer mismatch, not truncated mass.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]

STD_EPS = 1e-4  # TRL adds this to every std it divides by
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group",
                     estimator: str = "grpo") -> Tensor:
    """Advantages for rewards laid out group after group (prompt 0's N completions first). Shape [B]."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}; "
                         f"pass N completions for every prompt (a batch of {num_generations} x number of prompts)")
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"rewards[{i}] is {rewards[i].item()} (prompt {i // num_generations}, completion "
                         f"{i % num_generations}); reward functions must return a finite number for every completion")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    groups = r.view(-1, num_generations)
    if estimator == "grpo":
        adv = groups - groups.mean(dim=1, keepdim=True)
        if scale_rewards == "group":
            adv = adv / (groups.std(dim=1, keepdim=True) + STD_EPS)
        elif scale_rewards == "batch":  # centred per group, scaled by the batch (PPO-Lite)
            adv = adv / (r.std() + STD_EPS)
        return adv.flatten()
    # rloo: the baseline is the mean of the other N - 1 (no per-group scaling: CBGRPOConfig refuses it)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (num_generations - 1)
    adv = (groups - others_mean).flatten()
    if scale_rewards == "batch":
        adv = (adv - adv.mean()) / (adv.std() + STD_EPS)
    return adv


def processed_logprobs(logits: Tensor, tokens: Tensor, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> Tensor:
    """log p(token) [...] under the distribution a sampler draws from (transformers' temperature -> top-k -> top-p),
    in fp32; filtered-out tokens get -inf."""
    scores = _sampler_scores(logits, temperature, top_k, top_p)
    return scores.log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def replayed_logprobs(logits: Tensor, tokens: Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> tuple[Tensor, Tensor]:
    """`processed_logprobs` of tokens the sampler drew, each kept in its support (an edge token would get -inf and
    zero its completion's loss); returns (logprobs, where the trainer's nucleus had left the token out)."""
    scores = _sampler_scores(logits, temperature, top_k, top_p)
    index = tokens.unsqueeze(-1)
    outside = scores.gather(-1, index).squeeze(-1) == -math.inf
    scores = scores.scatter(-1, index, (logits.float() / temperature).gather(-1, index))
    return scores.log_softmax(dim=-1).gather(-1, index).squeeze(-1), outside


def _sampler_scores(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """logits / temperature with what top-k, then top-p, filter out set to -inf: the sampler's scores, [..., V]."""
    scores = logits.float() / temperature
    if top_k > 0:
        kth = scores.topk(min(top_k, scores.size(-1)), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)  # ties with the k-th survive, as in transformers
    if top_p < 1.0:
        # Drop from the least likely up while the dropped mass stays <= 1 - top_p; the most likely always stays.
        ascending, order = scores.sort(dim=-1)
        dropped_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = dropped_mass <= 1 - top_p
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return scores


def policy_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """TRL's training forward: log_softmax(logits / temperature) at the token in fp32, without a [..., V] copy."""
    scores = logits.float() if temperature == 1 else logits.float() / temperature
    return scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - scores.logsumexp(dim=-1)


def importance_weights(policy_logps_old: Tensor, sampling_logps: Tensor | None, mask: Tensor, mode: str,
                       clip_max: float | None = 3.0, clip_min: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """Per-token IS weights [B, T] of the engine's `sampling_logps` (NaN: no correction there) against the trainer's,
    and TRL's `sampling/*` metrics as `is/*` (after the clip) and `logprob/*`."""
    if sampling_logps is None:  # no sampling logprobs (generate()): no correction
        nan = float("nan")
        metrics = {"is/skipped": 1.0, "is/ratio_mean": 1.0, "is/ratio_min": 1.0, "is/ratio_max": 1.0,
                   "is/clipped_frac": 0.0, "logprob/mean_abs_diff": nan, "logprob/max_abs_diff": nan}
        return torch.ones_like(policy_logps_old, dtype=torch.float32), metrics
    old, sampled, m = policy_logps_old.detach().float(), sampling_logps.detach().float(), mask.bool()

    log_ratio = torch.nan_to_num((old - sampled) * m, nan=0.0)  # padding and unscored tokens: ratio 1
    sequence_level = mode.startswith("sequence")
    if sequence_level:
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]: the whole completion's likelihood ratio
    ratio = log_ratio.exp()
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    outside = (ratio < lo) | (ratio > hi)
    weights = ratio.clamp(lo, hi) if mode.endswith("truncate") else ratio.masked_fill(outside, 0.0)

    counted = weights.flatten() if sequence_level else weights[m]
    diff = (sampled - old).abs()[m]
    diff = diff[~diff.isnan()]
    metrics = {
        "is/skipped": 0.0,
        "is/ratio_mean": counted.mean().item() if counted.numel() else 0.0,
        "is/ratio_min": counted.min().item() if counted.numel() else 0.0,
        "is/ratio_max": counted.max().item() if counted.numel() else 0.0,
        "is/clipped_frac": (outside.flatten() if sequence_level else outside[m]).float().mean().nan_to_num().item(),
        "logprob/mean_abs_diff": diff.mean().item() if diff.numel() else 0.0,
        "logprob/max_abs_diff": diff.max().item() if diff.numel() else 0.0,
    }
    return weights.expand_as(old).contiguous(), metrics


def chunk_share(loss_type: LossType, chunk_mask: Tensor, micro_batch_mask: Tensor) -> tuple[float, float]:
    """(loss share, token share) that make a chunk's `grpo_loss` and metrics add up to the micro-batch's."""
    tokens = float(chunk_mask.sum())
    all_tokens = max(float(micro_batch_mask.sum()), 1.0)
    if loss_type in ("grpo", "dr_grpo"):
        loss_share = chunk_mask.size(0) / micro_batch_mask.size(0)
    elif loss_type == "bnpo":  # grpo_loss divides the chunk by max(its tokens, 1); a chunk of no tokens adds 0
        loss_share = max(tokens, 1.0) / all_tokens
    else:  # dapo
        loss_share = 1.0
    return loss_share, tokens / all_tokens


def grpo_loss(policy_logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, *, loss_type: LossType,
              epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
              ref_logps: Tensor | None = None, is_weights: Tensor | None = None,
              max_completion_length: int | None = None, num_items_in_batch: int | Tensor | None = None,
              gradient_accumulation_steps: int = 1, kl_bias_correction: bool = True) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss of one micro-batch, as TRL 1.16's `GRPOTrainer._compute_loss` returns it, and metrics. Per token:
    -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A), rho = exp(policy - old), times the IS weight, plus beta times the
    k3 KL (times rho: `kl_bias_correction`). The sum is divided by each sequence's tokens then averaged (grpo: favours
    short wins), by the micro-batch's tokens (bnpo), by B * max_completion_length (dr_grpo), or by the step's tokens
    `num_items_in_batch` (dapo); all but dapo also by `gradient_accumulation_steps`, so micro-batch losses add up."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # one advantage for every token
    ratio = torch.exp(policy_logps - old_logps.detach())
    loss_tok = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + eps_high) * adv)  # the clip only removes
    if is_weights is not None:
        loss_tok = loss_tok * is_weights.detach()  # TRL weighs the policy term only, not the KL added below
    kl = None
    if beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference model's logprobs"
        ref_minus_pol = ref_logps.detach() - policy_logps
        kl = torch.exp(ref_minus_pol) - ref_minus_pol - 1  # k3: unbiased, always >= 0
        if kl_bias_correction:  # makes its gradient the unbiased reverse-KL gradient off-policy
            kl = kl * ratio
        loss_tok = loss_tok + beta * kl
    m = mask.to(loss_tok.dtype)
    total = (loss_tok * m).sum()
    if loss_type == "grpo":
        loss = ((loss_tok * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = total / m.sum().clamp(min=1.0) / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        assert max_completion_length is not None, "dr_grpo divides by B * max_completion_length"
        loss = total / (loss_tok.size(0) * max_completion_length) / gradient_accumulation_steps
    else:  # dapo
        if num_items_in_batch is None:
            if gradient_accumulation_steps != 1:
                raise ValueError("loss_type='dapo' with gradient accumulation divides by the token count of all "
                                 "micro-batches of the step; pass num_items_in_batch")
            num_items_in_batch = m.sum()
        loss = total / torch.as_tensor(num_items_in_batch, dtype=total.dtype).clamp(min=1.0)

    # TRL's clip_ratio/*: tokens where the clip bit, i.e. the gradient is cut, as a share of completion tokens
    low = (ratio < 1 - epsilon) & (adv < 0)
    high = (ratio > 1 + eps_high) & (adv > 0)
    n_tokens = m.sum().clamp(min=1.0)

    def share(x: Tensor) -> float:
        return ((x.float() * m).sum() / n_tokens).item()

    metrics = {"train/clip_ratio/low_mean": share(low), "train/clip_ratio/high_mean": share(high),
               "train/clip_ratio/region_mean": share(low | high)}
    if kl is not None:
        metrics["train/kl"] = ((kl.detach() * m).sum() / n_tokens).item()
    return loss, metrics
