"""The chunked teacher-forced forward: the loss's, and the reference the sampler's logprobs must match on unchanged
weights (else the IS correction would "correct" a bug)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from cbkit.rollout.base import Completion, SamplingParams
from cbkit.train.batch import Batch, completion_logits
from cbkit.train.objective import policy_logprobs, processed_logprobs


def chunked_logits(model, batch: Batch, chunk_rows: int | None, *, start: int = 0, stop: int | None = None,
                   autocast_dtype: torch.dtype | None = None) -> Iterator[tuple[Tensor, Batch, Tensor]]:
    """The teacher-forced forward of rows [start, stop), `chunk_rows` at a time (None: all), longest first (a chunk
    pads little; a stable sort: a rerun forms the same chunks): per chunk its row indices, rows and logits."""
    stop = len(batch) if stop is None else stop
    order = start + torch.argsort(batch.attention_mask[start:stop].sum(-1), descending=True, stable=True)
    size = stop - start if chunk_rows is None else chunk_rows
    for i in range(0, stop - start, size):
        mb = batch.take(order[i : i + size])
        yield order[i : i + size], mb, completion_logits(model, mb, autocast_dtype)


@torch.no_grad()
def teacher_forced_logprobs(model, completions: Sequence[Completion], sampling: SamplingParams | None = None,
                            batch_size: int | None = 16) -> list[Tensor]:
    """Per completion, each token's logprob from the forward training runs (`chunked_logits`); `sampling=None` (or
    greedy): the raw distribution, otherwise the sampler's."""
    device = next(model.parameters()).device
    # The pad id only fills masked positions: any id (0 is in every vocabulary) gives the same logprobs.
    batch = Batch.from_completions(completions, pad_token_id=0, device=device, with_logprobs=False)
    out: list[Tensor | None] = [None] * len(completions)
    for rows, mb, logits in chunked_logits(model, batch, batch_size):
        for i, row in enumerate(rows.tolist()):
            n = len(completions[row].completion_ids)
            step_logits, tokens = logits[i, :n], mb.completion_ids[i, :n]
            if sampling is None or not sampling.do_sample:
                lp = policy_logprobs(step_logits, tokens)  # selective: no [n, V] log-softmax beside the logits
            else:
                lp = processed_logprobs(step_logits, tokens, sampling.temperature, sampling.top_k, sampling.top_p)
            out[row] = lp.cpu()
    return [lp for lp in out if lp is not None]

