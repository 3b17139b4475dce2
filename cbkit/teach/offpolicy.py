"""Notebook 05's experiments, each one call: staleness sweep, correction on/off, an async run, the stale-KV bug.

Every function trains or rolls out for real and returns what it measured; the notebook draws it
(`cbkit.viz.training`) and prints its sentences from it. Each run starts from the same initial weights with the
same seed, so the runs differ only in the setting the experiment varies.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import string
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any
from unittest import mock

import torch

from cbkit.rollout import SamplingParams
from cbkit.rollout.continuous import ContinuousBackend
from cbkit.teach.tiers import LESSON_PAGE_SIZE
from cbkit.telemetry import release_memory
from cbkit.train.config import CBGRPOConfig
from cbkit.train.grpo import GRPOTrainer
from cbkit.train.hooks import StepHooks, StepRecord
from cbkit.train.offpolicy import LaggedRollouts, versioned_logprobs
from cbkit.train.setup import set_up_for_config
from cbkit.train.snapshots import WeightSnapshots


def lowercase_reward(completions: list[str], answers: list[str]) -> list[float]:
    """Share of lowercase ASCII letters in a completion. A random model (CI's `llama-tiny-random`) writes a share of
    0.2-0.3, with spread, so its groups have nonzero advantages from step 1 and the updates move the weights: what
    off-policy needs, and a reward such a model can move within a dozen steps (04 at CI size)."""
    return [sum(ch in string.ascii_lowercase for ch in c) / max(1, len(c)) for c in completions]


class Recorder(StepHooks):
    """Keeps each step's metrics and rollout, and the perf_counter span each step spent training."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.rollouts: list[Any] = []
        self.train_spans: list[tuple[float, float, str]] = []
        self._train_start = 0.0
        self.final: WeightSnapshots | None = None  # the weights the run ended with (`train_runs` keeps them)
        self.config: CBGRPOConfig | None = None  # the run's configuration (`train_runs` fills it)

    def on_rollout_end(self, rollout) -> None:
        self.rollouts.append(rollout)
        self._train_start = time.perf_counter()

    def on_step_end(self, record: StepRecord) -> None:
        self.records.append(record)
        self.train_spans.append((self._train_start, time.perf_counter(), f"training step {record.step}"))

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [{"step": r.step, **r.metrics} for r in self.records]


def train_runs(policy, initial: Mapping[str, torch.Tensor] | WeightSnapshots, base: CBGRPOConfig,
               variants: Mapping[str, Mapping[str, Any]], reward_funcs=None, *,
               keep_final: bool | Collection[str] = True, reuse: Mapping[str, Recorder] | None = None,
               ) -> dict[str, Recorder]:
    """One run per variant (config fields over `base`), each from `initial` weights (a state dict, or the oldest
    version a `WeightSnapshots` keeps: on disk, it costs no RAM); their recorders by name, each holding the run's
    configuration, metrics, rollouts and final weights (all runs' with ``keep_final=True``, those named in it, or
    none). A run's final weights are a `WeightSnapshots` of one version, kept where `initial` is (its place; for a
    state dict, host memory, so that they never take the GPU's). A variant whose configuration a recorder in `reuse` already ran (the same
    config from the same start and seed: the same run) is taken from there, not run again, where that recorder kept
    what this call keeps. Each run's trainer (its AdamW state, gradients, weight snapshots and engine) is released
    before the next starts, and the freed heap handed back to the system (`release_memory`), so every run starts
    from the same resident memory. The policy is put back to `initial` at the end."""
    from tqdm.auto import tqdm

    def keeps(name: str) -> bool:
        return keep_final if isinstance(keep_final, bool) else name in keep_final

    place = initial.where if isinstance(initial, WeightSnapshots) else "host"
    out, todo = {}, {}
    for name, fields in variants.items():
        config = dataclasses.replace(base, **fields)
        done = next((r for r in (reuse or {}).values() if r.config == config and (r.final or not keeps(name))), None)
        if done is not None:
            out[name] = done
        else:
            todo[name] = fields
    for name, fields in tqdm(list(todo.items()), desc="runs", unit="run"):
        _put_back(policy.model, initial)
        rec = Recorder()
        rec.config = dataclasses.replace(base, **fields)
        run, backend, rollouts = set_up_for_config(rec.config, policy=policy), None, None
        if not (rec.config.rollout_staleness or rec.config.async_rollouts):
            # Staleness 0 through the snapshot machinery, so it logs offpolicy/* like the others; the same run as
            # the plain loop to float noise (tests/test_offpolicy.py checks it).
            backend = run.backend(rec.config.backend, warm_up=False, cb_config=rec.config.cb_overrides())
            rollouts = LaggedRollouts(run.model, backend, 0, rec.config.rollout_snapshots)
        trainer = GRPOTrainer(rec.config, run, backend=backend, rollouts=rollouts, hooks=[rec],
                              reward_funcs=reward_funcs)
        trainer.train()
        if keeps(name):
            rec.final = WeightSnapshots(1, place)
            rec.final.append(0, policy.model)
        out[name] = rec
        trainer.close()
        del trainer
        release_memory(policy.model)
    _put_back(policy.model, initial)
    return {name: out[name] for name in variants}


def _put_back(model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | WeightSnapshots) -> None:
    """Load `weights` into `model`: a state dict, or the oldest version a `WeightSnapshots` keeps."""
    if isinstance(weights, WeightSnapshots):
        weights.load_into(model)
    else:
        model.load_state_dict(weights)


def weight_gap(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over all weights: how far two runs' updates took them apart."""
    num = sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in a)
    den = sum((a[k].float() ** 2).sum().item() for k in a)
    return (num / den) ** 0.5


def _rollout_gaps(a: Recorder, b: Recorder) -> list[tuple[bool, float]]:
    """Per step of two runs: whether their rollouts are the same tokens, and the largest |sampling logprob| gap."""
    out = []
    for ra, rb in zip(a.rollouts, b.rollouts, strict=False):
        same_tokens = [ca.completion_ids for ca in ra.completions] == [cb.completion_ids for cb in rb.completions]
        gap = max((abs(x - y) for ca, cb in zip(ra.completions, rb.completions, strict=True)
                   if ca.sampling_logprobs and cb.sampling_logprobs
                   for x, y in zip(ca.sampling_logprobs, cb.sampling_logprobs, strict=False)), default=0.0)
        out.append((same_tokens, gap))
    return out


def first_different_rollout(a: Recorder, b: Recorder) -> int | None:
    """The first step (1-based) whose rollouts differ between two runs, in tokens or in sampling logprobs: the
    first one sampled from different weights; None if every step's is the same."""
    return next((i + 1 for i, (same, gap) in enumerate(_rollout_gaps(a, b)) if not same or gap > 0), None)


def rollout_sources(runs: Mapping[str, Recorder]) -> str:
    """Where two runs' rollouts came from, step by step, read from the rollouts themselves: the policy versions
    their tokens carry, and whether the two runs' rollouts of a step are the same tokens with the same sampling
    logprobs (the same weights and seed) or not (different weights). Two runs that differ only in the loss (the IS
    correction on and off) sample the same rollouts until one comes from weights that their different updates made;
    until then their reward curves are one line."""
    (name_a, a), (name_b, b) = list(runs.items())[:2]

    def versions(rec: Recorder) -> list[str]:
        out = []
        for rollout in rec.rollouts:
            vs = sorted({v for c in rollout.completions for v in (c.policy_versions or ())})
            out.append("-".join(map(str, vs)) if vs else "?")
        return out

    va, vb = versions(a), versions(b)
    lines = [f"policy version each step's rollout was sampled from: {name_a} {', '.join(va)}"
             + ("; the same in the other run." if va == vb else f"; {name_b} {', '.join(vb)}.")]
    gaps = _rollout_gaps(a, b)
    first = next((i for i, (same, gap) in enumerate(gaps) if not same or gap > 0), None)
    if first is None:
        lines.append(f"Every one of the {len(gaps)} steps drew the same rollout in both runs (same tokens, sampling "
                     "logprobs equal to the bit): the same weights, so their rewards are one line. Train for more "
                     "steps than the staleness + 2 for rollouts from weights the two updates made.")
    else:
        after = ", ".join(f"step {i + 1} {gap:.1e}" + ("" if same else " (other tokens)")
                          for i, (same, gap) in enumerate(gaps) if i >= first)
        same = (f"Steps 1-{first}: the same rollout in both runs (same tokens, sampling logprobs equal to the "
                "bit). " if first else "")
        lines.append(f"{same}From step {first + 1} on the rollouts came from different weights; the largest "
                     f"|sampling logprob| gap between the runs: {after}.")
        other = [i + 1 for i, (same_tokens, _) in enumerate(gaps) if not same_tokens]
        lines.append(f"Their sampled tokens differ at step(s) {', '.join(map(str, other))}, so their rewards can too."
                     if other else "Their sampled tokens are the same at every step, so are their rewards (one line "
                     "in the figure): the weights differ by too little to change a sampled token.")
    return "\n".join(lines)


def straddler(rollout) -> int | None:
    """Index of the first completion whose tokens came from more than one policy version, or None."""
    for i, c in enumerate(rollout.completions):
        if c.policy_versions and len(set(c.policy_versions)) > 1:
            return i
    return None


def tokens_by_version(completion, tokenizer) -> str:
    """The completion as HTML, each token on the colour of the policy version that sampled it."""
    import html

    from cbkit.viz.palette import PALETTE

    spans = []
    for tok, v in zip(completion.completion_ids, completion.policy_versions, strict=True):
        text = html.escape(tokenizer.decode([tok])).replace("\n", "&#8629;")
        spans.append(f'<span style="background:{PALETTE[v % len(PALETTE)]}55;padding:1px" '
                     f'title="version {v}">{text}</span>')
    legend = " ".join(f'<span style="background:{PALETTE[v % len(PALETTE)]}55">version {v}</span>'
                      for v in sorted(set(completion.policy_versions)))
    return f'<div style="font-family:monospace;line-height:1.8">{"".join(spans)}</div><div>{legend}</div>'


def stale_prefix_kv(model, prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams,
                    update) -> dict[str, dict[str, float]]:
    """The stale-prefix-KV bug, reproduced and caught.

    A kept engine rolls `prompts` out, `update()` changes the weights, and the engine rolls them out again: once
    with its prefix cache emptied first (cbkit's `forget_cached_kv`), once with that call patched out, so full
    prompt pages computed with the old weights are read again. For each, `drift_metrics` of the engine's
    logprobs against the new weights (the policy the loss would use: the loop's `offpolicy/*` and `logprob/*`
    see this), against the old ones, and against a replay whose full prompt pages come from the old weights and
    everything else from the new ones (the closest simple mix; the engine may also reuse completed pages of
    completion tokens it sampled identically before, so the replay need not reach kernel noise). Returns {"fixed": ..., "stale KV": ...}, each {"vs new", "vs old",
    "vs replay"}: mean |logprob difference|.
    """
    old = {k: v.detach().clone() for k, v in model.state_dict().items()}
    scratch = copy.deepcopy(model).eval()  # for the replays; copied now, before an engine is attached to the model
    # Pages the prompts fill, on every device: with the engine's GPU default (256 tokens) no prompt page would be
    # complete, nothing would be cached, and "stale" would equal "fixed".
    backend = ContinuousBackend(model, {"page_size": LESSON_PAGE_SIZE}, persistent=True)
    results = {}
    try:
        backend.generate(prompts, num_generations, sampling)  # fills the prefix cache with old-weight pages
        update()
        new = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # The buggy call first, while the cache still holds the old weights' pages; the fixed one empties it.
        for name, patch in (("stale KV", mock.patch("cbkit.rollout.engine.forget_cached_kv")),
                            ("fixed", contextlib.nullcontext())):
            with patch:
                rollout = backend.generate(prompts, num_generations, sampling)
            results[name] = _gaps(scratch, rollout, old, new, sampling, int(rollout.engine_config["page_size"]))
    finally:
        backend.close()
    model.load_state_dict(new)
    return results


def _gaps(scratch, rollout, old, new, sampling, page: int) -> dict[str, float]:
    out: dict[str, list[float]] = {"vs new": [], "vs old": [], "vs replay": []}
    for c in rollout.completions:
        got = torch.tensor(c.sampling_logprobs)
        n_in = len(c.prompt_ids) + len(c.completion_ids) - 1
        cached = (len(c.prompt_ids) // page) * page  # full prompt pages: what a prefix-cache hit reuses
        for key, versions in (("vs new", [1] * n_in), ("vs old", [0] * n_in),
                              ("vs replay", [0] * cached + [1] * (n_in - cached))):
            ref = versioned_logprobs(scratch, {0: old, 1: new}, c.prompt_ids, c.completion_ids, versions,
                                     sampling.temperature)
            out[key].append((ref - got).abs().mean().item())
    return {k: sum(v) / len(v) for k, v in out.items()}
