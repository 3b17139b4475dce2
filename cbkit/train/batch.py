"""A rollout as training tensors (prompts left-padded, completions right-padded: all start at column P, so one
`logits_to_keep=T+1` forward gives exactly the logits that predict them), and that teacher-forced forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cbkit.rollout.base import Completion

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
        return cls(input_ids=ids.to(device), attention_mask=attn.to(device), completion_ids=ids[:, p:].to(device),
                   completion_mask=attn[:, p:].bool().to(device),
                   sampling_logps=None if logps is None else logps.to(device),
                   truncated=torch.tensor([c.finish_reason == "length" for c in completions], device=device),
                   prompt_width=p)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    @property
    def completion_width(self) -> int:
        return self.completion_ids.size(1)

    def take(self, rows: slice | Tensor) -> Batch:
        """The rows `rows` selects (a slice or a tensor of indices), trimmed to their widest prompt and completion."""
        attn = self.attention_mask[rows]
        p_real = int(attn[:, : self.prompt_width].sum(-1).max())
        t_real = max(1, int(self.completion_mask[rows].sum(-1).max()))
        cols = slice(self.prompt_width - p_real, self.prompt_width + t_real)
        return Batch(input_ids=self.input_ids[rows, cols], attention_mask=attn[:, cols],
                     completion_ids=self.completion_ids[rows, :t_real], completion_mask=self.completion_mask[rows, :t_real],
                     sampling_logps=None if self.sampling_logps is None else self.sampling_logps[rows, :t_real],
                     truncated=self.truncated[rows], prompt_width=p_real)


def completion_logits(model, batch: Batch, autocast_dtype: torch.dtype | None = None) -> Tensor:
    """[B, T, V] fp32 logits at the positions that predict each completion token (teacher forcing)."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    t = batch.completion_width
    device_type = batch.input_ids.device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                    logits_to_keep=t + 1, use_cache=False)
    return out.logits[:, :-1].float()


def logits_bytes(rows: int, completion_len: int, vocab_size: int) -> int:
    """Peak bytes of one micro-batch's logits in the loss: 4 fp32 [rows, T, V] (logits, log-softmax, their grads)."""
    return 4 * 4 * rows * completion_len * vocab_size


def micro_batches_for(rows: int, completion_len: int, vocab_size: int, budget_bytes: int) -> int:
    """The fewest micro-batches (a divisor of `rows`) whose logits fit `budget_bytes`; an error when one does not."""
    one = logits_bytes(1, completion_len, vocab_size)
    if one > budget_bytes:
        raise ValueError(
            f"one completion of {completion_len} tokens over a {vocab_size}-token vocabulary needs "
            f"{one / 2**30:.2f} GiB of logits in the loss, over the {budget_bytes / 2**30:.2f} GiB budget; "
            "shorten max_completion_length or raise the budget.")
    return next(k for k in range(1, rows + 1) if rows % k == 0 and logits_bytes(rows // k, completion_len,
                                                                                    vocab_size) <= budget_bytes)


def check_causal_forward(model: PreTrainedModel, attn_implementation: str) -> None:
    """Refuse a training forward that could run without a causal mask (transformers #48296)."""
    from cbkit.rollout.engine import engine_is_idle

    impl = model.config._attn_implementation
    if impl != attn_implementation or not engine_is_idle(model):
        raise RuntimeError(f"The model's attention is {impl!r} (it was {attn_implementation!r} when training began) "
                           "or a continuous batching engine is still running on it, so a forward could run without a "
                           "causal mask (transformers #48296). Stop the CB manager before a training forward.")
