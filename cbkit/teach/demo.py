"""One GRPO-shaped rollout through each backend, side by side: the kit's first result.

A few prompts x N completions each, the same sampling parameters for every backend, one warm-up call per
backend (the first call pays one-off costs that are not the backend's steady state), then per backend:
completion tokens/s, peak memory, mean completion length, reward means and the logprob check.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from tqdm.auto import tqdm

from cbkit.models.load import DEFAULT_MODEL, load_policy
from cbkit.tasks.rewards import compute_rewards
from cbkit.train.config import same_as
from cbkit.train.logprobs import logprob_check
from cbkit.train.setup import set_up_run


@dataclass
class DemoConfig:
    """What `cbkit demo` runs: every field is a flag (`cbkit.cli.flags.dataclass_flags`), the ones the training run also has
    with `CBGRPOConfig`'s help."""

    model: str = same_as("model", default=DEFAULT_MODEL)
    data: str = same_as("data", default="synthetic")
    num_prompts: int = field(default=2, metadata={"help": "prompts in the rollout", "aliases": ["--prompts"]})
    num_generations: int = same_as("num_generations", default=8, aliases=("-N",))
    max_new_tokens: int = same_as("max_completion_length", default=128)
    temperature: float = same_as("temperature", default=1.0)
    top_p: float = same_as("top_p", default=1.0)
    top_k: int = same_as("top_k", default=0)
    backends: tuple[str, ...] = field(default=("generate", "continuous"),
                                      metadata={"help": "the backends to run, side by side"})
    cb_config: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "JSON overrides for the CB engine, e.g. '{\"max_memory_percent\": 0.4}'"})
    seed: int = same_as("seed", default=0)
    out: str | None = field(default=None, metadata={"help": "append one JSON line per backend to this file"})

    def __post_init__(self) -> None:
        self.backends = tuple(self.backends)  # a flag's words arrive as a list


@dataclass
class DemoResult:
    backend: str
    prompts: int
    num_generations: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    peak_mem_bytes: int | None
    peak_mem_kind: str | None
    mean_completion_len: float
    truncated_share: float
    reward_mean: float
    reward_correctness: float
    reward_format: float
    logprob_max_abs_diff: float
    engine_config: dict


def run_demo(
    model: str = DEFAULT_MODEL,
    data: str = "synthetic",
    num_prompts: int = 2,
    num_generations: int = 8,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    backends: tuple[str, ...] = ("generate", "continuous"),
    cb_config: dict | None = None,
    seed: int = 0,
    out: str | Path | None = None,
) -> list[DemoResult]:
    policy = load_policy(model)
    run = set_up_run(model, data, num_prompts, seed=seed, policy=policy)
    tok, problems, prompts = run.tokenizer, run.problems, run.prompts
    sampling = run.sampling(max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    results = []
    for name in tqdm(backends, desc="backends"):
        backend = run.backend(name, cb_config=cb_config)
        rollout = backend.generate(prompts, num_generations, sampling, prompt_names=[p.id for p in problems])
        texts = [tok.decode(c.completion_ids, skip_special_tokens=True) for c in rollout.completions]
        answers = [problems[c.group].answer for c in rollout.completions]
        total, per = compute_rewards(texts, answers)
        check = logprob_check(run.model, rollout, sampling)
        lengths = [len(c.completion_ids) for c in rollout.completions]
        result = DemoResult(
            backend=name,
            prompts=len(prompts),
            num_generations=num_generations,
            completion_tokens=rollout.completion_tokens,
            wall_s=rollout.wall_s,
            tokens_per_s=rollout.tokens_per_s,
            peak_mem_bytes=rollout.peak_mem_bytes,
            peak_mem_kind=rollout.peak_mem_kind,
            mean_completion_len=mean(lengths),
            truncated_share=mean(c.finish_reason == "length" for c in rollout.completions),
            reward_mean=mean(total),
            reward_correctness=mean(per["reward/correctness"]),
            reward_format=mean(per["reward/format"]),
            logprob_max_abs_diff=check["logprob/max_abs_diff"],
            engine_config=rollout.engine_config,
        )
        results.append(result)
        if out is not None:  # appended as each backend finishes: a crash later loses nothing
            with open(out, "a") as f:
                f.write(json.dumps({"model": model, "data": data, "load_s": policy.load_s, **asdict(result)}) + "\n")
    return results


def format_table(results: list[DemoResult]) -> str:
    head = f"{'backend':<11} {'tok/s':>8} {'peak MiB':>9} {'mean len':>9} {'trunc':>6} {'reward':>7} " \
           f"{'correct':>8} {'format':>7} {'max|dlogp|':>11}"
    rows = [head, "-" * len(head)]
    for r in results:
        mib = f"{r.peak_mem_bytes / 2**20:.0f}" if r.peak_mem_bytes is not None else "n/a"
        rows.append(
            f"{r.backend:<11} {r.tokens_per_s:>8.1f} {mib:>9} {r.mean_completion_len:>9.1f} "
            f"{r.truncated_share:>6.2f} {r.reward_mean:>7.3f} {r.reward_correctness:>8.3f} {r.reward_format:>7.3f} "
            f"{r.logprob_max_abs_diff:>11.2e}"
        )
    return "\n".join(rows)
