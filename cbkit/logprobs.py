"""Teacher-forced logprobs of a rollout's completions, and the check that the sampler's logprobs match them.

The check is the foundation of the importance-sampling correction: on unchanged weights, the logprob a
backend reports for a token it sampled must equal the logprob a training forward assigns to that token
under the same processed distribution (temperature, top-k, top-p). If it does not, the correction would
"correct" for a difference that is really a bug.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cbkit.objective import processed_logprobs
from cbkit.rollout.base import Completion, Rollout, SamplingParams


@torch.no_grad()
def teacher_forced_logprobs(
    model,
    completions: Sequence[Completion],
    sampling: SamplingParams | None = None,
    batch_size: int = 16,
) -> list[torch.Tensor]:
    """Per completion, the logprob of each of its tokens: one right-padded forward per micro-batch.

    `sampling=None` gives the raw policy distribution (temperature 1, nothing truncated); otherwise the
    distribution the sampler used. Greedy sampling is scored under the raw distribution too.
    """
    out: list[torch.Tensor] = []
    for start in range(0, len(completions), batch_size):
        chunk = completions[start : start + batch_size]
        seqs = [list(c.prompt_ids) + list(c.completion_ids) for c in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float()
        for i, c in enumerate(chunk):
            p, n = len(c.prompt_ids), len(c.completion_ids)
            step_logits = logits[i, p - 1 : p - 1 + n]  # the logits at position t predict token t+1
            tokens = torch.tensor(c.completion_ids, device=step_logits.device)
            if sampling is None or not sampling.do_sample:
                lp = torch.log_softmax(step_logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
            else:
                lp = processed_logprobs(step_logits, tokens, sampling.temperature, sampling.top_k, sampling.top_p)
            out.append(lp.cpu())
    return out


def logprob_check(model, rollout: Rollout, sampling: SamplingParams) -> dict[str, float]:
    """`logprob/max_abs_diff` and `logprob/mean_abs_diff` between the rollout's sampling logprobs and a
    teacher-forced forward on the same weights; NaN when the rollout carries no logprobs."""
    if not rollout.has_logprobs:
        return {"logprob/max_abs_diff": float("nan"), "logprob/mean_abs_diff": float("nan")}
    ref = teacher_forced_logprobs(model, rollout.completions, sampling)
    diffs = torch.cat(
        [(torch.tensor(c.sampling_logprobs) - r).abs() for c, r in zip(rollout.completions, ref, strict=True)]
    )
    return {"logprob/max_abs_diff": diffs.max().item(), "logprob/mean_abs_diff": diffs.mean().item()}
