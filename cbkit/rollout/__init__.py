"""Rollout backends behind one protocol: `generate` (static padded batch) and `continuous` (transformers CB)."""

from __future__ import annotations

from cbkit.rollout.base import Completion, Rollout, RolloutBackend, SamplingParams
from cbkit.rollout.continuous import ContinuousBackend
from cbkit.rollout.generate import GenerateBackend

BACKENDS = {GenerateBackend.name: GenerateBackend, ContinuousBackend.name: ContinuousBackend}


def make_backend(name: str, model, *, cb_config: dict | None = None, pad_token_id: int | None = None,
                 record_timestamps: bool = False, persistent: bool = False) -> RolloutBackend:
    """Build a backend by name; the one place that maps names to classes."""
    if name == GenerateBackend.name:
        return GenerateBackend(model, pad_token_id=pad_token_id)
    if name == ContinuousBackend.name:
        return ContinuousBackend(model, cb_config, record_timestamps=record_timestamps, persistent=persistent)
    raise ValueError(f"Unknown backend {name!r}; choose from {sorted(BACKENDS)}.")


__all__ = ["BACKENDS", "Completion", "ContinuousBackend", "GenerateBackend", "Rollout", "RolloutBackend",
           "SamplingParams", "make_backend"]
