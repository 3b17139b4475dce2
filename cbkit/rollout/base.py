"""The contract between rollout backends and everything downstream of them.

A backend turns P prompts into a `Rollout`: N completions per prompt (a *group*), in group order whatever order the
engine finished them in, each with its tokens, why it stopped and its *sampling logprobs*: the log-probability of
each token under the distribution it was drawn from, which the loop's importance-sampling correction needs.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """What to sample, passed explicitly to every backend (TRL #5783: without it the CB path went near-greedy)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    do_sample: bool = True
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}; use do_sample=False "
                             "for greedy.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable top-p.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}; use 0 to disable top-k.")

    @property
    def eos_ids(self) -> frozenset[int]:
        eos = self.eos_token_id
        return frozenset() if eos is None else frozenset({eos} if isinstance(eos, int) else eos)

    def generation_config(self):
        """The complete `GenerationConfig` both backends hand to the model."""
        from transformers import GenerationConfig

        eos = self.eos_token_id if isinstance(self.eos_token_id, int | None) else list(self.eos_token_id)
        first_eos = next(iter(eos), None) if isinstance(eos, list) else eos
        kwargs: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample, eos_token_id=eos,
                                      pad_token_id=self.pad_token_id if self.pad_token_id is not None else first_eos)
        if self.do_sample:  # neutral knobs too: `generate` fills a missing top_k with 50
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return GenerationConfig(**kwargs)


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    group: int  # index of the prompt this completion belongs to
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # generated tokens up to and including EOS, never padding
    sampling_logprobs: tuple[float, ...] | None  # same length as completion_ids, or None (see Rollout)
    finish_reason: FinishReason
    # Async rollouts: per token, the policy version (optimizer updates so far) that sampled it, or computed its KV.
    policy_versions: tuple[int, ...] | None = None
    prompt_versions: tuple[int, ...] | None = None


@dataclass
class Rollout:
    """N completions for each of P prompts, in group order, plus what the call cost."""

    completions: list[Completion]
    num_generations: int
    backend: str
    wall_s: float
    peak_mem_bytes: int | None = None
    peak_mem_kind: str | None = None  # which probe measured peak_mem_bytes (e.g. "cuda_allocated", "cpu_rss")
    engine_config: dict[str, Any] = field(default_factory=dict)
    logprobs_missing_reason: str | None = None  # why every sampling_logprobs is None; None when present
    timeline: dict[str, Any] | None = None  # the CB engine's clocks per request, when asked for

    @property
    def num_prompts(self) -> int:
        return len(self.completions) // self.num_generations if self.num_generations else 0

    @property
    def completion_tokens(self) -> int:  # up to and including EOS; padding never counts
        return sum(len(c.completion_ids) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def has_logprobs(self) -> bool:
        return self.logprobs_missing_reason is None

    def without_logprobs(self, reason: str) -> Rollout:
        """The same rollout without sampling logprobs, as released TRL's CB path has it."""
        dropped = [replace(c, sampling_logprobs=None) for c in self.completions]
        return replace(self, completions=dropped, logprobs_missing_reason=reason)

    def groups(self) -> list[list[Completion]]:
        n = self.num_generations
        return [self.completions[i : i + n] for i in range(0, len(self.completions), n)]

    def validate(self) -> Rollout:
        """Check the contract where a rollout enters the loop; name the first field that breaks it."""
        if self.num_generations < 1:
            raise ValueError(f"Rollout from {self.backend!r}: num_generations must be >= 1, got {self.num_generations}.")
        if not self.completions:
            raise ValueError(f"Rollout from {self.backend!r} has no completions.")
        if len(self.completions) % self.num_generations:
            raise ValueError(f"Rollout from {self.backend!r}: {len(self.completions)} completions do not split into "
                             f"groups of num_generations={self.num_generations}.")
        for i, c in enumerate(self.completions):
            where = f"Rollout from {self.backend!r}, completion {i}"
            if c.group != i // self.num_generations:
                raise ValueError(f"{where}: group is {c.group}, expected {i // self.num_generations} (group order).")
            if not c.prompt_ids:
                raise ValueError(f"{where}: prompt_ids is empty.")
            if c.finish_reason not in ("eos", "length"):
                raise ValueError(f"{where}: finish_reason must be 'eos' or 'length', got {c.finish_reason!r}.")
            if c.sampling_logprobs is None and self.logprobs_missing_reason is None:
                raise ValueError(f"{where}: sampling_logprobs is missing and logprobs_missing_reason is not set.")
            for name in ("sampling_logprobs", "policy_versions"):  # one entry per completion token
                if (per_token := getattr(c, name)) is not None and len(per_token) != len(c.completion_ids):
                    raise ValueError(f"{where}: {name} has {len(per_token)} entries for {len(c.completion_ids)} "
                                     "completion tokens.")
        return self


@runtime_checkable
class RolloutBackend(Protocol):
    """Anything that turns prompts into a `Rollout`. The loop checks this protocol where a backend enters."""

    name: str

    def generate(self, prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams, *,
                 prompt_names: Sequence[str] | None = None, target_lengths: Sequence[int] | None = None) -> Rollout:
        """N completions per prompt, in group order; with ``target_lengths`` (one per row) EOS is ignored and
        completion i has exactly ``target_lengths[i]`` tokens, as vLLM's ``ignore_eos``."""


def check_request(prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams, model: Any,
                  prompt_names: Sequence[str] | None = None, target_lengths: Sequence[int] | None = None
                  ) -> tuple[list[list[int]], list[int] | None]:
    """Refuse a request no backend can serve on `model`, before any compute is spent on it; else the rows in group
    order (each prompt N times in a row) and the targets."""
    if num_generations < 1:
        raise ValueError(f"num_generations (N) must be >= 1, got {num_generations}.")
    if not prompts:
        raise ValueError("No prompts given: the dataset or prompt list is empty.")
    context_len = getattr(model.config, "max_position_embeddings", None)
    for i, p in enumerate(prompts):
        name = prompt_names[i] if prompt_names is not None else f"#{i}"
        if len(p) == 0:
            raise ValueError(f"Prompt {name} is empty (0 tokens).")
        if context_len is not None and len(p) + sampling.max_new_tokens > context_len:
            raise ValueError(f"Prompt {name} has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} it "
                             f"needs {len(p) + sampling.max_new_tokens} positions, more than the model's context of "
                             f"{context_len}. Shorten the prompt or lower max_new_tokens.")
    rows = [list(p) for p in prompts for _ in range(num_generations)]
    if target_lengths is None:
        return rows, None
    targets, max_new_tokens = list(target_lengths), sampling.max_new_tokens
    if len(targets) != len(rows):
        raise ValueError(f"target_lengths has {len(targets)} entries for {len(rows)} completion rows (prompts x N): "
                         "give one target per completion, in group order (prompt 0's N targets first).")
    for i, t in enumerate(targets):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 1 <= t <= max_new_tokens:
            raise ValueError(f"target_lengths[{i}] is {t!r}; every target must be a whole number of tokens in "
                             f"1..max_new_tokens={max_new_tokens}. Scale the workload to the limit or raise max_new_tokens.")
    return rows, [int(t) for t in targets]


def cut_completion(tokens: Sequence[int], sampling: SamplingParams, target: int | None) -> tuple[int, FinishReason]:
    """Length to keep (EOS included) and why generation stopped: EOS, the limit, or exactly the target."""
    if target is not None:
        if len(tokens) < target:
            raise RuntimeError(f"Generation stopped after {len(tokens)} tokens, short of its target of {target}.")
        return target, "length"
    for i, t in enumerate(tokens):
        if t in sampling.eos_ids:
            return i + 1, "eos"
    if len(tokens) >= sampling.max_new_tokens:
        return len(tokens), "length"
    raise RuntimeError(f"Generation stopped after {len(tokens)} tokens without EOS and before "
                       f"max_new_tokens={sampling.max_new_tokens}.")


def stop_token_ids(tokenizer: Any, model: Any = None) -> int | tuple[int, ...] | None:
    """Every id a completion stops at: the tokenizer's EOS, then the model's `generation_config.eos_token_id` (chat
    models end a turn on e.g. `<|eot_id|>`), as TRL's `eos_token_ids`. One id comes back as an int."""
    config_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found = [getattr(tokenizer, "eos_token_id", None),
             *(config_ids if isinstance(config_ids, list | tuple) else [config_ids])]
    ids = tuple(dict.fromkeys(int(i) for i in found if i is not None))
    return None if not ids else ids[0] if len(ids) == 1 else ids
