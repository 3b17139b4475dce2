"""Shared test helpers: a teacher-forced reference for sampling logprobs."""

from __future__ import annotations

import torch

from cbkit.rollout import Completion, SamplingParams
from cbkit.train.objective import processed_logprobs


def teacher_forced_logprobs(model, c: Completion, sampling: SamplingParams) -> torch.Tensor:
    """Log-probs of a completion's tokens under the processed distribution, from one unpadded forward."""
    ids = torch.tensor([list(c.prompt_ids) + list(c.completion_ids)], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    p = len(c.prompt_ids)
    step_logits = logits[0, p - 1 : p - 1 + len(c.completion_ids)]
    tokens = torch.tensor(c.completion_ids, device=model.device)
    if not sampling.do_sample:
        return torch.log_softmax(step_logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    return processed_logprobs(step_logits, tokens, sampling.temperature, sampling.top_k, sampling.top_p)


def max_logprob_diff(model, rollout, sampling: SamplingParams) -> float:
    worst = 0.0
    for c in rollout.completions:
        ref = teacher_forced_logprobs(model, c, sampling)
        got = torch.tensor(c.sampling_logprobs, device=ref.device)
        worst = max(worst, (got - ref).abs().max().item())
    return worst
