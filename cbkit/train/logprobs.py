"""Teacher-forced logprobs of a rollout's completions, and the check that the sampler's logprobs match them.

The check is the foundation of the importance-sampling correction: on unchanged weights, the logprob a
backend reports for a token it sampled must equal the logprob a training forward assigns to that token
under the same processed distribution (temperature, top-k, top-p). If it does not, the correction would
"correct" for a difference that is really a bug.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from cbkit.rollout.base import Completion, Rollout, SamplingParams
from cbkit.train.batch import Batch, completion_logits
from cbkit.train.objective import policy_logprobs, processed_logprobs


@torch.no_grad()
def teacher_forced_logprobs(
    model,
    completions: Sequence[Completion],
    sampling: SamplingParams | None = None,
    batch_size: int = 16,
) -> list[torch.Tensor]:
    """Per completion, the logprob of each of its tokens, from the forward training runs.

    Each micro-batch goes through `cbkit.train.batch`'s layout and `completion_logits` (left-padded prompts,
    position ids that count real tokens, `logits_to_keep`), the exact forward behind the loop's old logprobs
    and loss, so every check built on this function (`logprob_check`, `logprob_pairs`, `cbkit demo`,
    notebook 02) checks the forward that training runs, not a second one beside it.

    `sampling=None` gives the raw policy distribution (temperature 1, nothing truncated); otherwise the
    distribution the sampler used. Greedy sampling is scored under the raw distribution too.
    """
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for start in range(0, len(completions), batch_size):
        chunk = completions[start : start + batch_size]
        # The pad id only fills masked positions, which no real position attends to: any id gives the same
        # logprobs. 0 exists in every vocabulary.
        batch = Batch.from_completions(chunk, pad_token_id=0, device=device, with_logprobs=False)
        logits = completion_logits(model, batch)
        for i, c in enumerate(chunk):
            n = len(c.completion_ids)
            step_logits = logits[i, :n]
            tokens = batch.completion_ids[i, :n]
            if sampling is None or not sampling.do_sample:
                lp = policy_logprobs(step_logits, tokens)  # selective: no [n, V] log-softmax beside the logits
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


@torch.no_grad()
def logprob_pairs(model, rollout: Rollout, sampling: SamplingParams, batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Every completion token's sampling logprob next to two teacher-forced references, flattened:

    * ``processed``: the policy under the distribution the sampler used (temperature, top-k, top-p), the
      reference cbkit's importance-sampling correction uses;
    * ``temperature_only``: the policy with temperature alone, what TRL's trainer compares against.
    * ``sequence``: the completion index of each token, for per-sequence sums.

    Without truncation (top_k 0, top_p 1) the two references are the same numbers.
    """
    if not rollout.has_logprobs:
        raise ValueError(f"This {rollout.backend!r} rollout carries no sampling logprobs "
                         f"({rollout.logprobs_missing_reason}); there is nothing to compare.")
    completions = rollout.completions
    processed = teacher_forced_logprobs(model, completions, sampling, batch_size)
    plain = dataclasses.replace(sampling, top_k=0, top_p=1.0)
    temperature_only = teacher_forced_logprobs(model, completions, plain, batch_size)
    return {
        "sampling": torch.cat([torch.tensor(c.sampling_logprobs, dtype=torch.float32) for c in completions]),
        "processed": torch.cat(processed),
        "temperature_only": torch.cat(temperature_only),
        "sequence": torch.cat([torch.full((len(c.completion_ids),), i) for i, c in enumerate(completions)]),
    }


def sequence_log_ratios(log_ratio: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """Per-token log ratios summed per completion: the log of a sequence-level importance ratio."""
    return torch.zeros(int(sequence.max()) + 1, dtype=log_ratio.dtype).index_add_(0, sequence, log_ratio)
