"""Rollout backends behind one protocol: `generate` (static padded batch) and `continuous` (transformers CB)."""

from __future__ import annotations

from cbkit.rollout.base import Completion, Rollout, RolloutBackend, SamplingParams
from cbkit.rollout.continuous import ContinuousBackend
from cbkit.rollout.generate import GenerateBackend

BACKENDS = {GenerateBackend.name: GenerateBackend, ContinuousBackend.name: ContinuousBackend}


def make_backend(
    name: str,
    model,
    *,
    cb_config: dict | None = None,
    pad_token_id: int | None = None,
    record_timestamps: bool = False,
    persistent: bool = False,
    cpu_attention: str = "batched",
    engine_loop: str = "auto",
) -> RolloutBackend:
    """Build a backend by name; the one place that maps names to classes. `engine_loop` ("auto", "caller" or
    "thread") says who runs the CB engine's loop (`cbkit.rollout.engine`)."""
    if name == GenerateBackend.name:
        return GenerateBackend(model, pad_token_id=pad_token_id)
    if name == ContinuousBackend.name:
        return ContinuousBackend(model, cb_config, record_timestamps=record_timestamps, persistent=persistent,
                                 cpu_attention=cpu_attention, engine_loop=engine_loop)
    raise ValueError(f"Unknown backend {name!r}; choose from {sorted(BACKENDS)}.")


__all__ = [
    "BACKENDS",
    "Completion",
    "ContinuousBackend",
    "GenerateBackend",
    "Rollout",
    "RolloutBackend",
    "SamplingParams",
    "make_backend",
]
