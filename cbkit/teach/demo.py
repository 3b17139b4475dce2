"""`cbkit demo`: one GRPO-shaped rollout through each backend, side by side, with the same sampling parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
    """What `cbkit demo` runs: every field a flag, those of the training run with `CBGRPOConfig`'s help."""

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


def run_demo(cfg: DemoConfig) -> list[dict[str, Any]]:
    """One row per backend; with ``cfg.out``, each appended as JSON as soon as it is measured."""
    policy = load_policy(cfg.model)
    run = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed, policy=policy)
    sampling = run.sampling(cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            seed=cfg.seed)
    rows = []
    for name in tqdm(cfg.backends, desc="backends"):
        rollout = run.backend(name, cb_config=cfg.cb_config).generate(
            run.prompts, cfg.num_generations, sampling, prompt_names=[p.id for p in run.problems])
        comps = rollout.completions
        texts = [run.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in comps]
        total, per = compute_rewards(texts, [run.problems[c.group].answer for c in comps])
        row = {"backend": name, "prompts": len(run.prompts), "num_generations": cfg.num_generations,
               "completion_tokens": rollout.completion_tokens, "wall_s": rollout.wall_s,
               "tokens_per_s": rollout.tokens_per_s, "peak_mem_bytes": rollout.peak_mem_bytes,
               "peak_mem_kind": rollout.peak_mem_kind,
               "mean_completion_len": mean(len(c.completion_ids) for c in comps),
               "truncated_share": mean(c.finish_reason == "length" for c in comps),
               "reward_mean": mean(total), "reward_correctness": mean(per["reward/correctness"]),
               "reward_format": mean(per["reward/format"]),
               "logprob_max_abs_diff": logprob_check(run.model, rollout, sampling)["logprob/max_abs_diff"],
               "engine_config": rollout.engine_config}
        rows.append(row)
        if cfg.out is not None:
            with open(cfg.out, "a") as f:
                head = {"model": cfg.model, "data": cfg.data, "load_s": policy.load_s}
                f.write(json.dumps({**head, **row}) + "\n")
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'backend':<11} {'tok/s':>8} {'peak MiB':>9} {'mean len':>9} {'trunc':>6} {'reward':>7} "
            f"{'correct':>8} {'format':>7} {'max|dlogp|':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mib = "n/a" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.0f}"
        lines.append(f"{r['backend']:<11} {r['tokens_per_s']:>8.1f} {mib:>9} "
                     f"{r['mean_completion_len']:>9.1f} {r['truncated_share']:>6.2f} "
                     f"{r['reward_mean']:>7.3f} {r['reward_correctness']:>8.3f} {r['reward_format']:>7.3f} "
                     f"{r['logprob_max_abs_diff']:>11.2e}")
    return "\n".join(lines)
