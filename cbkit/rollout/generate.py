"""The static batch: every completion of every prompt goes through one `model.generate` call.

Read this file next to `continuous.py`; they do the same job. Here all P*N sequences are left-padded to
the longest prompt and decoded in lock-step until the *last* one finishes: a sequence that hit EOS after
20 tokens still occupies its row (and its KV cache, allocated for the full length up front) while the
longest one runs to max_new_tokens. That padding is the waste continuous batching removes.

Sampling logprobs come from the scores `generate` returns with `output_scores=True`: those are the
*processed* logits (after temperature / top-k / top-p), so log_softmax of them is the distribution each
token was really drawn from.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from cbkit.rollout.base import Completion, Rollout, SamplingParams, check_request, cut_at_eos
from cbkit.telemetry import PeakMemory


class GenerateBackend:
    name = "generate"

    def __init__(self, model, *, pad_token_id: int | None = None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        num_generations: int,
        sampling: SamplingParams,
        *,
        prompt_names: Sequence[str] | None = None,
    ) -> Rollout:
        check_request(prompts, num_generations, sampling, _context_len(self.model), prompt_names)
        gen_config = sampling.generation_config()
        pad_id = self.pad_token_id if self.pad_token_id is not None else gen_config.pad_token_id
        if pad_id is None:
            raise ValueError("The static batch needs a pad token: set sampling.pad_token_id or the tokenizer's pad.")
        gen_config.pad_token_id = pad_id
        gen_config.return_dict_in_generate = True
        gen_config.output_scores = True  # the processed scores: what each token was sampled from

        # Each prompt repeated N times in a row: rows are already in group order.
        rows = [list(p) for p in prompts for _ in range(num_generations)]
        input_ids, attention_mask = _left_pad(rows, pad_id, self.model.device)

        with PeakMemory(self.model.device) as mem:
            start = time.perf_counter()
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=gen_config,
                )
            mem.synchronize()
            wall = time.perf_counter() - start

        new_tokens = out.sequences[:, input_ids.shape[1] :]  # [rows, steps], padded after EOS
        # scores: one [rows, vocab] tensor per step, processed by the same warpers that sampled the token.
        scores = torch.stack(out.scores, dim=1).float()  # [rows, steps, vocab]
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)

        completions = []
        new_tokens, logprobs = new_tokens.tolist(), logprobs.tolist()
        for i, row in enumerate(rows):
            keep, reason = cut_at_eos(new_tokens[i], sampling.eos_ids, sampling.max_new_tokens)
            completions.append(
                Completion(
                    group=i // num_generations,
                    prompt_ids=tuple(row),
                    completion_ids=tuple(new_tokens[i][:keep]),
                    sampling_logprobs=tuple(logprobs[i][:keep]),
                    finish_reason=reason,
                )
            )
        return Rollout(
            completions=completions,
            num_generations=num_generations,
            backend=self.name,
            wall_s=wall,
            peak_mem_bytes=mem.peak_bytes,
            peak_mem_kind=mem.kind,
            engine_config={"batch_rows": len(rows), "padded_prompt_len": int(input_ids.shape[1]),
                           "steps": int(new_tokens and len(new_tokens[0]))},
        ).validate()


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def _context_len(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)
