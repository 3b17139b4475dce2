"""The static batch: every completion of every prompt in one `model.generate` call; read it beside `continuous.py`.

All P*N rows are left-padded and decoded in lock-step until the last one finishes: a row done early keeps its slot and
its KV, the waste CB removes. Sampling logprobs are the log_softmax of the processed logits at the drawn token.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from torch.nn.utils.rnn import pad_sequence

from cbkit.rollout.base import Completion, Rollout, SamplingParams, check_request, cut_completion
from cbkit.telemetry import PeakMemory

# What a rollout keeps of the model's own `generation_config`: ids and cache settings. The rest (repetition_penalty,
# min_p, ...) is the checkpoint's chat advice, which `generate()` would apply unasked: off-policy by a knob nobody set.
GENERATION_CONFIG_KEPT = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "use_cache",
                          "cache_implementation", "cache_config", "compile_config", "disable_compile")
_WARNED: weakref.WeakSet = weakref.WeakSet()  # models whose dropped fields were named (once each)


@contextlib.contextmanager
def rollout_generation_config(model: Any):
    """While a rollout runs, `model.generation_config` holds only `GENERATION_CONFIG_KEPT`; the rest is named once."""
    original, default = model.generation_config, transformers.GenerationConfig()
    # Named: what would change a token; `output_*` / `return_*` are dropped unnamed (every checkpoint sets some).
    dropped = {k: v for k, v in original.to_diff_dict().items()
               if k not in GENERATION_CONFIG_KEPT and not k.startswith(("_", "output_", "return_"))
               and k != "transformers_version" and getattr(default, k, None) != v}
    if dropped and model not in _WARNED:
        _WARNED.add(model)
        warnings.warn(f"The model's generation_config sets {dropped}; rollouts sample from their own settings "
                      "(temperature, top_p, top_k) alone, so these are ignored while they run. To sample with one of "
                      "them, make it a rollout setting; cbkit's loss assumes the distribution it describes.",
                      UserWarning, stacklevel=3)
    kept = {k: getattr(original, k) for k in GENERATION_CONFIG_KEPT if getattr(original, k, None) is not None}
    model.generation_config = transformers.GenerationConfig(**kept)
    try:
        yield
    finally:
        model.generation_config = original


class GenerateBackend:
    name = "generate"

    def __init__(self, model, *, pad_token_id: int | None = None) -> None:
        self.model, self.pad_token_id = model, pad_token_id

    def generate(self, prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams, *,
                 prompt_names: Sequence[str] | None = None, target_lengths: Sequence[int] | None = None) -> Rollout:
        rows, targets = check_request(prompts, num_generations, sampling, self.model, prompt_names, target_lengths)
        gen_config = sampling.generation_config()
        pad_id = self.pad_token_id if self.pad_token_id is not None else gen_config.pad_token_id
        if pad_id is None:
            raise ValueError("The static batch needs a pad token: set sampling.pad_token_id or the tokenizer's pad.")
        gen_config.pad_token_id = pad_id
        if targets is not None:
            # An empty list, not None: None would be filled in from the model's own generation config.
            gen_config.eos_token_id = []
            gen_config.max_new_tokens = max(targets)
        warpers, gen_config = _explicit_warpers(sampling, gen_config)
        recorder = _LogprobRecorder()
        input_ids = pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=pad_id,
                                 padding_side="left").to(self.model.device)
        attention_mask = pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True,
                                      padding_side="left").to(self.model.device)  # by length: pad may be a real id

        with PeakMemory(self.model.device) as mem:
            start = time.perf_counter()
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            with torch.no_grad(), rollout_generation_config(self.model):
                out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                          generation_config=gen_config,
                                          logits_processor=transformers.LogitsProcessorList([*warpers, recorder]))
            mem.synchronize()
            wall = time.perf_counter() - start

        new_tokens = out[:, input_ids.shape[1] :]  # [rows, steps], padded after EOS
        logprobs = recorder.finish(new_tokens)  # [rows, steps]

        completions = []
        token_rows, logprob_rows = new_tokens.tolist(), logprobs.tolist()
        for i, row in enumerate(rows):
            keep, reason = cut_completion(token_rows[i], sampling, targets[i] if targets else None)
            completions.append(Completion(i // num_generations, tuple(row), tuple(token_rows[i][:keep]),
                                          tuple(logprob_rows[i][:keep]), reason))
        return Rollout(completions, num_generations, self.name, wall, mem.peak_bytes, mem.kind,
                       engine_config={"batch_rows": len(rows), "padded_prompt_len": int(input_ids.shape[1]),
                                      "steps": len(token_rows[0]) if token_rows else 0})


class _LogprobRecorder(transformers.LogitsProcessor):
    """Last in the chain: sees the processed scores of step t, and on step t+1 the token drawn from them."""

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None  # log_softmax of the previous step's processed scores
        self.steps: list[torch.Tensor] = []  # [rows] logprob of each step's drawn token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        if self.prev is not None and len(self.steps) < new_tokens.shape[1]:
            self.steps.append(self.prev.gather(-1, new_tokens[:, len(self.steps), None]).squeeze(-1))
        self.prev = None
        return torch.stack(self.steps, dim=1)[:, : new_tokens.shape[1]]


def _explicit_warpers(sampling: SamplingParams, gen_config):
    """transformers puts user processors *before* its warpers, so the recorder brings the same warpers along, in
    `generate`'s order, and the config gets neutral values so nothing is applied twice."""
    warpers: list[transformers.LogitsProcessor] = []
    if sampling.do_sample:
        if sampling.temperature != 1.0:
            warpers.append(transformers.TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            warpers.append(transformers.TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
        if sampling.top_p < 1.0:
            warpers.append(transformers.TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
        gen_config.temperature, gen_config.top_k, gen_config.top_p = 1.0, 0, 1.0
    return warpers, gen_config
