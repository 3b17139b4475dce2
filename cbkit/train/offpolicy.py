"""Off-policy rollouts: a fixed lag (`LaggedRollouts`, k updates old) and async rollouts (`AsyncRollouts`: step
t+1 decodes while step t trains, a completion's tokens from two versions), both reporting `offpolicy/*`. IS on the
engine's own logprobs stays exact when weights change mid-sequence (`docs/off_policy.md`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cbkit.rollout import Rollout, RolloutBackend
from cbkit.rollout.async_cb import AsyncEngine, Pending
from cbkit.train.config import CBGRPOConfig
from cbkit.train.rollouts import OnPolicyRollouts, RolloutRequest, RolloutSource, SourcedRollout, sample
from cbkit.train.snapshots import WeightSnapshots

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STATE_FILE = "offpolicy.pt"  # in a checkpoint directory: the weights the next rollout must start from


def drift_metrics(current_logps: Tensor, sampling_logps: Tensor | None, mask: Tensor, mode: str) -> dict[str, float]:
    """How far the sampler is from the loss's policy, r = exp(current - sampling): `kl` the k3 E[r - 1 - log r],
    `ratio_*` the raw IS ratios (per sequence for `sequence_*` modes)."""
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
    """The groups whose every token (`group_versions[g][c]`: completion c of group g) is <= max_staleness old."""
    return [g for g, group in enumerate(group_versions)
            if all(now - v <= max_staleness for versions in group for v in versions)]


def make_rollout_source(config: CBGRPOConfig, policy: PreTrainedModel, backend: RolloutBackend, *,
                        max_prompt_len: int, given: RolloutSource | None = None,
                        backend_given: bool = False) -> RolloutSource:
    """`given`, or the source the config asks for (`max_prompt_len` sizes an async KV pool)."""
    if given is not None:
        if not isinstance(given, RolloutSource):
            raise TypeError(f"rollouts must be a cbkit.train.rollouts.RolloutSource (subclass it and override "
                            f"rollout(request)); got {type(given).__name__}.")
        return given
    if not (config.rollout_staleness or config.async_rollouts):
        return OnPolicyRollouts(backend)
    if backend_given:
        raise ValueError("rollout_staleness > 0 and async_rollouts=True sample from a copy of the policy's weights "
                         "with a backend cbkit builds on that copy; pass no backend (backend=None).")
    if config.async_rollouts:
        return AsyncRollouts(policy, config, max_prompt_len=max_prompt_len, checkpoints=bool(config.output_dir))
    return LaggedRollouts(policy, backend, config.rollout_staleness, config.rollout_snapshots)


class LaggedRollouts(RolloutSource):
    """The last k + 1 versions wait in a ring; the oldest is loaded into the policy to sample, then the newest back."""

    def __init__(self, policy: PreTrainedModel, backend: RolloutBackend, staleness: int,
                 snapshots: str = "device") -> None:
        self.policy, self.backend = policy, backend
        self.history = WeightSnapshots(staleness + 1, snapshots)
        self.history.append(0, policy)

    drift = staticmethod(drift_metrics)

    def rollout(self, request: RolloutRequest) -> SourcedRollout:
        version = self.history.versions[0]  # k updates back, or the initial weights while fewer have happened
        swap = version != self.history.versions[-1]  # nothing older kept yet (or k = 0): the policy as it is
        if swap:
            self.history.load_into(self.policy, 0)
        try:
            rollout = sample(self.backend, request)
        finally:
            if swap:
                self.history.load_into(self.policy, -1)  # the current weights, bitwise, before the loss sees them
        stamped = [dataclasses.replace(c, policy_versions=(version,) * len(c.completion_ids),  # weights held still
                                       prompt_versions=(version,) * len(c.prompt_ids)) for c in rollout.completions]
        rollout = dataclasses.replace(rollout, completions=stamped)
        return SourcedRollout(rollout, list(request.indices), staleness_metrics(rollout, request.policy_version))

    def after_update(self, version: int) -> None:
        self.history.append(version, self.policy)

    def save(self, directory: Path) -> None:
        history = [(v, self.history.tensors(i)) for i, v in enumerate(self.history.versions)]
        torch.save({"history": history}, directory / STATE_FILE)

    def load(self, directory: Path, version: int) -> None:
        state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        self.history.clear()
        for v, weights in state["history"]:
            self.history.append(v, weights, device=self.policy.device)

    def close(self) -> None:
        self.history.close()


class AsyncRollouts(RolloutSource):
    """Step t+1's requests decode on the engine's copy of the policy while step t trains. `target_lengths` (one per
    row, EOS ignored) replays a length workload (`cbkit sweep --full-step`)."""

    def __init__(self, policy: PreTrainedModel, config: CBGRPOConfig, *, max_prompt_len: int,
                 checkpoints: bool = False, target_lengths: Sequence[int] | None = None) -> None:
        self.config, self.checkpoints = config, checkpoints
        self.engine = AsyncEngine(policy, config.cb_overrides())
        self.engine.max_prompt_len = max_prompt_len
        self.target_lengths = None if target_lengths is None else list(target_lengths)
        self.pending: Pending | None = None
        self.previous: dict[str, Tensor] | None = None  # the weights the pending rollout started on (checkpoints)
        self.resume_update: int | None = None  # a resumed run first replays the update its pending rollout met

    drift = staticmethod(drift_metrics)

    def rollout(self, request: RolloutRequest) -> SourcedRollout:
        """The rollout queued during the last step (or one now), bounded by max_staleness; the next one queued."""
        metrics, scored, start = {}, list(request.indices), time.perf_counter()
        if self.pending is None:  # the first step, or the first after a resume
            self.pending = self._submit(request, self.resume_update is not None)
            if self.resume_update is not None:
                self.engine.publish(self.resume_update)
                self.resume_update = None
        rollout = self.engine.collect(self.pending)
        self.pending = None
        metrics["offpolicy/rollout_wait_s"] = time.perf_counter() - start
        now, regenerated = request.policy_version, False
        if now - min(v for comp in rollout.completions for v in comp.policy_versions or ()) > self.config.max_staleness:
            rollout, scored, regenerated = self._too_old(rollout, request)
        metrics.update({**staleness_metrics(rollout, now), "offpolicy/regenerated": float(regenerated),
                        "offpolicy/dropped_groups": float(len(request.indices) - len(scored))})
        if request.following is not None:  # queue the next step's requests: they decode while this step trains
            self.pending = self._submit(request.following, True)
        return SourcedRollout(rollout, scored, metrics)

    def after_step(self, version: int) -> dict[str, float]:
        if self.checkpoints:  # without checkpoints there is no copy to keep
            self.previous = self.engine.snapshot_state()  # what the pending rollout started on, for a checkpoint
        return {"offpolicy/publish_wait_s": self.engine.publish(version)}

    def _submit(self, request: RolloutRequest, straddle: bool) -> Pending:
        return self.engine.submit(request.prompts, request.num_generations, request.sampling,
                                  update_at=self.config.async_update_at if straddle else None,
                                  prompt_names=request.prompt_names, target_lengths=self.target_lengths)

    def _too_old(self, rollout: Rollout, request: RolloutRequest) -> tuple[Rollout, list[int], bool]:
        """Drop the groups holding a too-old token, or (also when none is left) sample again."""
        c, now = self.config, request.policy_version
        groups = rollout.groups()
        fresh = fresh_groups([[comp.policy_versions or () for comp in g] for g in groups], now, c.max_staleness)
        if c.stale_rollouts == "drop" and fresh:
            kept = [dataclasses.replace(comp, group=j) for j, i in enumerate(fresh) for comp in groups[i]]
            return dataclasses.replace(rollout, completions=kept), [request.indices[i] for i in fresh], False
        return sample(self.engine, request), list(request.indices), True

    def save(self, directory: Path) -> None:
        snapshot = self.previous if self.previous is not None else self.engine.snapshot_state()
        torch.save({"snapshot": snapshot}, directory / STATE_FILE)

    def load(self, directory: Path, version: int) -> None:
        state = torch.load(directory / STATE_FILE, weights_only=True)
        self.engine.load_snapshot(state["snapshot"], max(0, version - self.config.num_iterations))
        # The uninterrupted run's next rollout started on those weights and met this update mid-way.
        self.pending, self.resume_update = None, version if version > 0 else None

    def close(self) -> None:
        self.engine.close()
