"""A rollout as training tensors, and the teacher-forced forward that scores its completions.

Layout: prompts left-padded to a common width P, completions right-padded to a common width T, so every
row's completion starts at column P and one `logits_to_keep=T+1` forward yields exactly the logits that
predict completion tokens (column P-1 predicts the first). `position_ids` count real tokens only, so a
left-padded prompt sits at the positions the rollout engine gave it.

A micro-batch (`Batch.rows`) is re-trimmed to its own widths: with uneven completion lengths (the reason to
use continuous batching at all) most micro-batches are much narrower than the whole step's batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cbkit.rollout.base import Completion


@dataclass
class Batch:
    input_ids: Tensor  # [B, P + T]
    attention_mask: Tensor  # [B, P + T]
    completion_ids: Tensor  # [B, T]
    completion_mask: Tensor  # [B, T] bool: real completion tokens (EOS included)
    sampling_logps: Tensor | None  # [B, T] the rollout engine's logprobs, 0 at padding; None if it gave none
    truncated: Tensor  # [B] bool: hit max_completion_length without EOS
    prompt_width: int  # P

    @classmethod
    def from_completions(cls, completions: Sequence[Completion], pad_token_id: int, device: torch.device | str,
                         with_logprobs: bool = True) -> Batch:
        p = max(len(c.prompt_ids) for c in completions)
        t = max(1, max(len(c.completion_ids) for c in completions))
        b = len(completions)
        ids = torch.full((b, p + t), pad_token_id, dtype=torch.long)
        attn = torch.zeros((b, p + t), dtype=torch.long)
        logps = torch.zeros((b, t), dtype=torch.float32) if with_logprobs else None
        for i, c in enumerate(completions):
            n_p, n_c = len(c.prompt_ids), len(c.completion_ids)
            ids[i, p - n_p : p] = torch.tensor(c.prompt_ids)
            ids[i, p : p + n_c] = torch.tensor(c.completion_ids, dtype=torch.long)
            attn[i, p - n_p : p + n_c] = 1
            if logps is not None:
                logps[i, :n_c] = torch.tensor(c.sampling_logprobs, dtype=torch.float32)
        return cls(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            completion_ids=ids[:, p:].to(device),
            completion_mask=attn[:, p:].bool().to(device),
            sampling_logps=None if logps is None else logps.to(device),
            truncated=torch.tensor([c.finish_reason == "length" for c in completions], device=device),
            prompt_width=p,
        )

    def __len__(self) -> int:
        return self.input_ids.size(0)

    @property
    def completion_width(self) -> int:
        return self.completion_ids.size(1)

    def rows(self, start: int, stop: int) -> Batch:
        """Rows [start, stop), trimmed to the widest prompt and completion among them."""
        attn = self.attention_mask[start:stop]
        p_real = int(attn[:, : self.prompt_width].sum(-1).max())
        t_real = max(1, int(self.completion_mask[start:stop].sum(-1).max()))
        cols = slice(self.prompt_width - p_real, self.prompt_width + t_real)
        return Batch(
            input_ids=self.input_ids[start:stop, cols],
            attention_mask=attn[:, cols],
            completion_ids=self.completion_ids[start:stop, :t_real],
            completion_mask=self.completion_mask[start:stop, :t_real],
            sampling_logps=None if self.sampling_logps is None else self.sampling_logps[start:stop, :t_real],
            truncated=self.truncated[start:stop],
            prompt_width=p_real,
        )


def completion_logits(model, batch: Batch) -> Tensor:
    """[B, T, V] fp32 logits at the positions that predict each completion token (teacher forcing)."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    t = batch.completion_width
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        logits_to_keep=t + 1,
        use_cache=False,
    )
    return out.logits[:, :-1].float()
