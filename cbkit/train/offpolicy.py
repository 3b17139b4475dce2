"""Off-policy rollouts: sampling from an older policy on purpose, measuring how far off it is, and async GRPO.

GRPO's importance-sampling (IS) correction divides the policy by the distribution each token was *sampled* from.
In the on-policy loop the two are the same weights and the correction only absorbs kernel noise (~1e-5 nats in
fp32). This module makes the rollout genuinely off-policy, in the two ways RL stacks meet it:

* **a fixed lag** (`rollout_staleness = k`, `LaggedRollouts`): step t's rollout is sampled from an exact copy of
  the weights of k optimizer updates earlier, kept in a ring of snapshots; the loss uses the current weights.
  Exact and reproducible, so a learner can set k and watch what it does;
* **async rollouts** (`async_rollouts`, `AsyncRollouts` over `cbkit.rollout.async_cb.AsyncEngine`): step t+1's
  requests decode in the CB engine while step t trains, and the update lands mid-rollout, so a completion's
  tokens come from two policy versions. A rollout with a token more than `max_staleness` updates old is
  regenerated or its groups dropped (`stale_rollouts`).

Both report `offpolicy/*` every step (`drift_metrics`): the staleness itself, |sampling - current| logprob
(mean, max), a KL estimate, the spread of the raw IS ratios before any clip, and where the clip bit
(`is/clipped_frac`, from `cbkit.train.objective.importance_weights`).

Why IS on the engine's own logprobs stays exact when the weights change mid-sequence
-------------------------------------------------------------------------------------
The correction needs, for each token, the probability of the distribution it was drawn from. The engine reports
exactly that: the log-softmax of the logits its forward computed at that moment, whatever those logits were
made of -- new weights for the current query, and for the prefix the KV the cache holds, written by whichever
weights processed those positions. An after-the-fact "old logprobs" forward under one set of weights (TRL PR
#5781's approach to CB) recomputes the prefix's KV with *those* weights: it is right for no token whose prefix
was processed by another version, so it divides by a distribution nothing was sampled from.
`versioned_logprobs` rebuilds the engine's computation from the recorded versions -- each segment of positions
forwarded with the weights that processed it, on top of the KV of the segments before -- and
`tests/test_async_rollouts.py` checks that it reproduces the engine's logprobs while either single-version
forward does not. `docs/off_policy.md` works it through.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from cbkit.rollout import Rollout
from cbkit.rollout.async_cb import AsyncEngine
from cbkit.train.snapshots import WeightSnapshots

# The loop these sources serve: a `cbkit.train.grpo.GRPOTrainer`, named rather than imported (grpo imports this
# module, and tests/test_layers.py counts a TYPE_CHECKING import as an import).
GRPOTrainer = Any
STATE_FILE = "offpolicy.pt"  # in a checkpoint directory: the weights the next rollout must start from


# --- what the metrics say -------------------------------------------------------------------------------------


def drift_metrics(current_logps: Tensor, sampling_logps: Tensor | None, mask: Tensor, mode: str) -> dict[str, float]:
    """How far the rollout's sampling distribution is from the policy the loss uses, over completion tokens.

    `current_logps` are the trainer's logprobs of the sampled tokens before this step's update (under the sampler's
    processed distribution), `sampling_logps` the engine's. With r = exp(current - sampling) per token:
    `kl` is the k3 estimate E[r - 1 - log r] of KL(sampling || current) on samples from the sampler (>= 0, and 0
    only when the two agree on every sampled token); `ratio_*` are the raw IS ratios (per token, or per sequence
    for `sequence_*` modes) before `clip_max`/`clip_min`, so their spread shows what the clip will have to cut.
    """
    if sampling_logps is None:
        return {}
    m = mask.bool() & ~sampling_logps.isnan()
    log_r = torch.where(m, current_logps.float() - sampling_logps.float(), torch.zeros((), device=m.device))
    tokens = log_r[m]
    if tokens.numel() == 0:
        return {}
    seq = mode.startswith("sequence")
    ratios = (log_r.sum(-1) if seq else tokens).exp()
    return {
        "offpolicy/logprob_mean_abs_diff": tokens.abs().mean().item(),
        "offpolicy/logprob_max_abs_diff": tokens.abs().max().item(),
        "offpolicy/kl": (tokens.exp() - 1 - tokens).mean().item(),
        "offpolicy/ratio_mean": ratios.mean().item(),
        "offpolicy/ratio_std": ratios.std().item() if ratios.numel() > 1 else 0.0,
        "offpolicy/ratio_min": ratios.min().item(),
        "offpolicy/ratio_max": ratios.max().item(),
    }


def staleness_metrics(rollout: Rollout, current_version: int) -> dict[str, float]:
    """Updates between each token's policy version and the loss's, over every completion token."""
    versions = [v for c in rollout.completions for v in (c.policy_versions or ())]
    if not versions:
        return {}
    ages = torch.tensor([current_version - v for v in versions], dtype=torch.float64)
    straddling = sum(len(set(c.policy_versions or ())) > 1 for c in rollout.completions)
    return {"offpolicy/staleness_mean": ages.mean().item(), "offpolicy/staleness_max": ages.max().item(),
            "offpolicy/straddling_frac": straddling / len(rollout.completions)}


def fresh_groups(group_versions: Sequence[Sequence[Sequence[int]]], now: int, max_staleness: int) -> list[int]:
    """The indices of the groups to keep: those whose every token is at most `max_staleness` updates old.

    `group_versions[g][c]` is the policy version of each token of completion c of group g; `now` is the version
    the loss is computed with. A group is the unit: one too-old token drops its whole group, because GRPO's
    advantages compare a completion with its siblings and a group with a member missing has another baseline.
    """
    return [g for g, group in enumerate(group_versions)
            if all(now - v <= max_staleness for versions in group for v in versions)]


def _stamped(rollout: Rollout, version: int) -> Rollout:
    """The rollout with every token marked as sampled by `version` (a backend whose weights held still)."""
    import dataclasses

    done = [dataclasses.replace(c, policy_versions=(version,) * len(c.completion_ids),
                                prompt_versions=(version,) * len(c.prompt_ids)) for c in rollout.completions]
    return dataclasses.replace(rollout, completions=done)


# --- a fixed lag ------------------------------------------------------------------------------------------------


class LaggedRollouts:
    """`rollout_staleness = k`: the rollout samples from the weights of k updates ago, swapped into the policy.

    The last k + 1 versions wait in a ring (`rollout_snapshots`: copies on the device, in host memory or files on
    disk), the newest being the policy as it is now. For a rollout the oldest is loaded into the policy itself, the
    trainer's own backend samples, and the newest is loaded back, bitwise: no sampling copy of the model is kept."""

    def __init__(self, trainer: GRPOTrainer, staleness: int) -> None:
        self.k, self._template = staleness, trainer.model  # the policy: what a checkpoint's tensors are shaped like
        self.history = WeightSnapshots(staleness + 1, trainer.config.rollout_snapshots)
        self.history.append(0, trainer.model)

    def rollout(self, trainer: GRPOTrainer, indices: Sequence[int],
                step: int) -> tuple[Rollout, dict[str, float], list[int]]:
        """The step's rollout, its staleness metrics, and the problems it scores (all of `indices`)."""
        version = self.history.versions[0]  # k updates back, or the initial weights while fewer have happened
        if version == self.history.versions[-1]:  # nothing older kept yet (or k = 0): the policy as it is
            rollout = trainer.rollout(indices, step)
        else:
            self.history.load_into(trainer.model, 0)
            try:
                rollout = trainer.rollout(indices, step)
            finally:
                self.history.load_into(trainer.model, -1)  # the current weights, bitwise, before the loss sees them
        rollout = _stamped(rollout, version)
        return rollout, staleness_metrics(rollout, trainer.policy_version), list(indices)

    def after_update(self, trainer: GRPOTrainer) -> None:
        self.history.append(trainer.policy_version, trainer.model)

    def after_step(self, trainer: GRPOTrainer, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history.items(self._template))}

    def load_state_dict(self, state: Mapping[str, Any], trainer: GRPOTrainer) -> None:
        self.history.clear()
        for version, weights in state["history"]:
            self.history.append(version, weights, device=trainer.model.device)

    def close(self) -> None:
        self.history.close()


# --- async rollouts ---------------------------------------------------------------------------------------------


class AsyncRollouts:
    """`async_rollouts=True`: step t+1's requests decode on the engine's snapshot while step t trains."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        c = trainer.config
        self.engine = AsyncEngine(trainer.model, c.cb_overrides())
        self.engine.max_prompt_len = max(map(len, trainer.prompt_ids))
        self.pending = None
        self.resume_update: int | None = None  # a resumed run first replays the update its pending rollout met
        # One length per completion row for every rollout this source queues, EOS ignored: a replayed length workload
        # (`cbkit sweep --full-step`'s async row, so every backend decodes the same targets). None: EOS decides.
        self.target_lengths: list[int] | None = None

    def rollout(self, trainer: GRPOTrainer, indices: Sequence[int],
                step: int) -> tuple[Rollout, dict[str, float], list[int]]:
        """The rollout queued during the last step (or one now), bounded by max_staleness; the problems it scores."""
        c, metrics, scored = trainer.config, {}, list(indices)
        start = time.perf_counter()
        if self.pending is None:  # the first step, or the first after a resume
            self.pending = self._submit(trainer, indices, step, self.resume_update is not None)
            if self.resume_update is not None:
                self.engine.publish(self.resume_update)
                self.resume_update = None
        rollout = self.engine.collect(self.pending)
        self.pending = None
        metrics["offpolicy/rollout_wait_s"] = time.perf_counter() - start
        now = trainer.policy_version
        oldest = min(v for comp in rollout.completions for v in comp.policy_versions)
        metrics.update(staleness_metrics(rollout, now))
        metrics["offpolicy/regenerated"] = 0.0
        metrics["offpolicy/dropped_groups"] = 0.0
        if now - oldest > c.max_staleness:
            rollout, scored, regenerated = self._too_old(trainer, rollout, indices, step, now)
            metrics["offpolicy/dropped_groups"] = float(len(indices) - len(scored) if not regenerated else 0)
            metrics["offpolicy/regenerated"] = float(regenerated)
            metrics.update(staleness_metrics(rollout, now))
        if step < c.max_steps:  # queue the next step's requests: they decode while this step trains
            following = trainer.order.indices(trainer.data_position + len(indices), c.prompts_per_step)
            self.pending = self._submit(trainer, following, step + 1, True)
        return rollout, metrics, scored

    def after_update(self, trainer: GRPOTrainer) -> None:
        return None  # the snapshot is refreshed once per step, after its last update (`after_step`)

    def after_step(self, trainer: GRPOTrainer, step: int) -> dict[str, float]:
        if trainer.state.output_dir is not None:  # without a folder no checkpoint is written: no copy to keep
            self.previous = self.engine.snapshot_state()  # what the pending rollout started on, for a checkpoint
        return {"offpolicy/publish_wait_s": self.engine.publish(trainer.policy_version)}

    def _submit(self, trainer: GRPOTrainer, indices: Sequence[int], step: int, straddle: bool):
        return self.engine.submit([trainer.prompt_ids[i] for i in indices], trainer.config.num_generations,
                                  trainer.sampling_params(step),
                                  update_at=trainer.config.async_update_at if straddle else None,
                                  prompt_names=[trainer.problems[i].id for i in indices],
                                  target_lengths=self.target_lengths)

    def _too_old(self, trainer: GRPOTrainer, rollout: Rollout, indices: Sequence[int], step: int,
                 now: int) -> tuple[Rollout, list[int], bool]:
        """Drop the groups holding a too-old token, or sample the step again on the current weights (also when
        dropping would leave no group: a step needs one). Returns the rollout, its problems, and if it was resampled."""
        c = trainer.config
        if c.stale_rollouts == "drop":
            fresh = fresh_groups([[comp.policy_versions for comp in g] for g in rollout.groups()], now,
                                 c.max_staleness)
            if fresh:
                import dataclasses

                groups = rollout.groups()
                kept = [dataclasses.replace(comp, group=j) for j, i in enumerate(fresh) for comp in groups[i]]
                return dataclasses.replace(rollout, completions=kept).validate(), [indices[i] for i in fresh], False
        return trainer.rollout(indices, step, backend=self.engine), list(indices), True

    def state_dict(self) -> dict[str, Any]:
        return {"snapshot": getattr(self, "previous", None) or self.engine.snapshot_state()}

    def load_state_dict(self, state: Mapping[str, Any], trainer: GRPOTrainer) -> None:
        step_updates = trainer.config.num_iterations
        self.engine.load_snapshot(state["snapshot"], max(0, trainer.policy_version - step_updates))
        self.pending = None
        # The uninterrupted run's next rollout started on those weights and met this update mid-way.
        self.resume_update = trainer.policy_version if trainer.state.step > 0 else None

    def close(self) -> None:
        self.engine.close()


# --- the check: the engine's computation, replayed version by version -----------------------------------------


@torch.no_grad()
def versioned_logprobs(model: torch.nn.Module, weights: Mapping[int, Mapping[str, Tensor]], prompt_ids: Sequence[int],
                       completion_ids: Sequence[int], position_versions: Sequence[int],
                       temperature: float = 1.0) -> Tensor:
    """Logprobs of `completion_ids` as an engine computed them when its weights changed mid-sequence.

    `position_versions[i]` is the version whose forward processed input position i (prompt, then completion
    tokens but the last): it wrote that position's KV and, from the last prompt position on, sampled the next
    token. Consecutive positions of one version go through `model` loaded with `weights[version]`, on top of
    the KV cache the earlier segments left: exactly what the engine's cache held. `model`'s weights are
    overwritten.
    """
    from transformers import DynamicCache

    ids = list(prompt_ids) + list(completion_ids)
    n_in = len(ids) - 1
    if len(position_versions) != n_in:
        raise ValueError(f"position_versions has {len(position_versions)} entries for {n_in} input positions.")
    device = next(model.parameters()).device
    import inspect

    # transformers 5.x renames `past_key_values` to `cache`; the DynamicCache is filled in place either way.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, logits, start = DynamicCache(), [], 0
    while start < n_in:
        version = position_versions[start]
        end = start
        while end < n_in and position_versions[end] == version:
            end += 1
        model.load_state_dict(weights[version])
        out = model(input_ids=torch.tensor([ids[start:end]], device=device), use_cache=True,
                    position_ids=torch.arange(start, end, device=device)[None], **{name: cache})
        logits.append(out.logits[0].float())
        start = end
    p = len(prompt_ids)
    step_logits = torch.cat(logits)[p - 1 :] / temperature
    return step_logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids, device=device)[:, None]).squeeze(-1)


def input_versions(completion) -> list[int]:
    """Per input position of a completion (prompt, then its tokens but the last): the version that processed it."""
    return list(completion.prompt_versions) + list(completion.policy_versions[1:])


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).eval().requires_grad_(False)
