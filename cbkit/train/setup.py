"""What every rollout of a run needs (policy, problems, prompt ids, stop and pad ids), for the loop and the sweep."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbkit.tasks.data import SYSTEM_PROMPT


@dataclass
class RunSetup:
    model: Any
    tokenizer: Any
    problems: list[Any]  # cbkit.tasks.data.Problem
    prompts: list[list[int]]
    stop_ids: int | tuple[int, ...] | None
    pad_token_id: int

    def sampling(self, max_new_tokens: int, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None):
        from cbkit.rollout import SamplingParams

        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              eos_token_id=self.stop_ids, pad_token_id=self.pad_token_id, seed=seed)

    def backend(self, name: str, *, warm_up: bool = True, **kwargs):
        """A rollout backend on this run's model; `warm_up` makes one short call first (one-off costs not measured)."""
        from cbkit.rollout import make_backend

        backend = make_backend(name, self.model, pad_token_id=self.pad_token_id, **kwargs)
        if warm_up:
            backend.generate(self.prompts[:1], 1, self.sampling(4, seed=0))
        return backend


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS (padding is masked out, so any id serves)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"{type(tokenizer).__name__} has neither a pad nor an EOS token; set tokenizer.pad_token.")
    return pad


def set_up_run(model: str, data: str, num_prompts: int, *, seed: int = 0, dtype: str | None = None,
               policy: Any = None, problems: Sequence[Any] | None = None,
               system_prompt: str | None = SYSTEM_PROMPT, options: dict | None = None) -> RunSetup:
    """Load (or take: a (model, tokenizer) pair) the policy and the problems, and build what a rollout needs."""
    from cbkit.rollout.base import stop_token_ids
    from cbkit.tasks.data import chat_prompt_ids, load_problems

    if policy is None:
        from cbkit.models.load import load_policy

        policy = load_policy(model, dtype=dtype, seed=seed)
    lm, tok = policy
    problems = list(problems) if problems is not None else load_problems(data, n=num_prompts, seed=seed,
                                                                               options=options)
    prompts = [chat_prompt_ids(tok, p, system_prompt=system_prompt) for p in problems]
    return RunSetup(lm, tok, problems, prompts, stop_token_ids(tok, lm), pad_token_id(tok))


def set_up_for_config(config: Any, run: RunSetup | None = None, *, policy: Any = None,
                      problems: Sequence[Any] | None = None) -> RunSetup:
    """`run` as given, or `set_up_run` from the config (on `policy` and `problems` when given); the policy checked."""
    if run is not None and (policy is not None or problems is not None):
        raise ValueError("Pass either run= (what set_up_run returned, which holds its policy and problems) or "
                         "policy=/problems=, not both.")
    if run is None and policy is None:
        from cbkit.models.load import load_policy

        policy = load_policy(config.model, dtype="float32", seed=config.seed)  # the config's `dtype` is an autocast
    model, tokenizer = (run.model, run.tokenizer) if run is not None else policy
    check_policy(tokenizer, model)  # before any prompt is built
    return run if run is not None else set_up_run(
        config.model, config.data, config.num_problems, seed=config.seed, policy=policy, problems=problems,
        system_prompt=config.system_prompt, options=config.data_options)


def check_policy(processing_class: Any, model: Any) -> None:
    """Refuse what the loop cannot train: a multimodal policy, weights not all fp32 (AdamW rounds away small updates)."""
    import torch

    parts = [a for a in ("image_processor", "video_processor", "feature_extractor", "audio_processor")
             if getattr(processing_class, a, None) is not None]
    if parts or getattr(getattr(model, "config", None), "vision_config", None) is not None:
        what = f"{type(processing_class).__name__} (has {', '.join(parts)})" if parts else "a vision-language model"
        raise ValueError(f"Got {what}: cbkit trains text-only policies; transformers' continuous batching engine "
                         "takes token ids only. Use a text-only model, or TRL's GRPOTrainer for multimodal GRPO.")
    half = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if half:
        raise ValueError(
            f"GRPOTrainer trains fp32 weights, but this policy has {', '.join(half)} weights. Load it with "
            "load_policy(..., dtype='float32') (or call model.float()), and choose the training forwards' precision "
            "with the config's dtype ('auto': bf16 autocast where the GPU has native bf16).")
