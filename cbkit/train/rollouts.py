"""Where a step's rollout comes from: one object behind one call, `RolloutSource.rollout(request)` (on-policy here,
off-policy in `cbkit.train.offpolicy`). A source never calls back into the trainer; its result is checked on entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from cbkit.rollout import Rollout, RolloutBackend, SamplingParams


@dataclass(frozen=True)
class RolloutRequest:
    indices: list[int]  # the problems' positions in the run: what the rollout is scored against
    prompts: list[list[int]]
    prompt_names: list[str]
    num_generations: int
    sampling: SamplingParams
    step: int
    policy_version: int  # optimizer updates so far: the version the loss will be computed with
    following: RolloutRequest | None = None  # the next step's request (None at the last): async queues it now


@dataclass
class SourcedRollout:
    """The rollout, the problems it is scored against (a source may drop groups), the source's `offpolicy/*`."""

    rollout: Rollout
    indices: list[int]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutSource:
    """Where a run's rollouts come from. Override `rollout`; the rest matter to a source that keeps state."""

    def rollout(self, request: RolloutRequest) -> SourcedRollout:
        raise NotImplementedError(f"{type(self).__name__} must override rollout(request) -> SourcedRollout.")

    def after_update(self, version: int) -> None: ...

    def after_step(self, version: int) -> dict[str, float]:
        return {}

    def drift(self, current_logps: Tensor, sampling_logps: Tensor | None, mask: Tensor, mode: str) -> dict[str, float]:
        """How far the sampler was from the policy the loss uses (`offpolicy/*`); nothing on-policy."""
        return {}

    def save(self, directory: Path) -> None:
        """Write into a checkpoint what the next rollouts need beyond the policy's weights."""

    def load(self, directory: Path, version: int) -> None:
        """Read back what `save` wrote; the policy already holds the checkpoint's weights, `version`."""

    def close(self) -> None: ...


class OnPolicyRollouts(RolloutSource):
    def __init__(self, backend: RolloutBackend) -> None:
        self.backend = backend

    def rollout(self, request: RolloutRequest) -> SourcedRollout:
        return SourcedRollout(sample(self.backend, request), list(request.indices))


def sample(backend: RolloutBackend, request: RolloutRequest) -> Rollout:
    return backend.generate(request.prompts, request.num_generations, request.sampling,
                            prompt_names=request.prompt_names)


def check_entry(got: SourcedRollout, request: RolloutRequest) -> SourcedRollout:
    """The one check of a rollout, where it enters the trainer: the contract, then what was asked."""
    rollout, n = got.rollout.validate(), request.num_generations
    if rollout.num_generations != n or len(rollout.completions) != n * len(got.indices):
        raise ValueError(f"Backend {rollout.backend!r} returned {len(rollout.completions)} completions in groups of "
                         f"{rollout.num_generations} for {len(got.indices)} prompts x num_generations={n}; expected "
                         f"{n * len(got.indices)} in groups of {n}.")
    return got


def check_backend(backend: object) -> RolloutBackend:
    if not isinstance(backend, RolloutBackend):
        raise TypeError(f"backend must implement cbkit.rollout.RolloutBackend (a `name` and `generate(prompts, "
                        f"num_generations, sampling, *, prompt_names=None) -> Rollout`); got {type(backend).__name__}.")
    return backend
