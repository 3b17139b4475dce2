"""Continuous batching: the same job as `generate.py`, through transformers' CB engine; read the two side by side.

The P*N requests go into a queue; each step the engine packs what runs (prefill chunks, one decode token each) without
padding into a fixed pool of KV blocks, and a finished request's blocks go to a waiting one (*recycling*). Unlike
TRL's CB path, cbkit keeps the engine's sampling logprobs and raises on a failed request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from cbkit.rollout.base import Rollout, SamplingParams, check_request
from cbkit.rollout.engine import Engine, timeline, to_completions
from cbkit.telemetry import PeakMemory


class ContinuousBackend:
    name = "continuous"

    def __init__(self, model, cb_config: Mapping[str, Any] | None = None, *, record_timestamps: bool = False,
                 persistent: bool = False) -> None:
        # persistent: keep the engine's pool between calls; its loop still stops after each, attention restored.
        self.engine = Engine(model, cb_config, persistent=persistent, record_timestamps=record_timestamps)
        self.model = model

    def close(self) -> None:
        self.engine.close()

    def generate(self, prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams, *,
                 prompt_names: Sequence[str] | None = None, target_lengths: Sequence[int] | None = None) -> Rollout:
        # Results come back in row order, whatever order they finished in.
        rows, targets = check_request(prompts, num_generations, sampling, self.model, prompt_names, target_lengths)
        with PeakMemory(self.model.device) as mem:
            start = time.perf_counter()
            outputs, resolved = self.engine.run(rows, sampling.generation_config(), seed=sampling.seed,
                                                max_new_tokens=sampling.max_new_tokens, targets=targets)
            mem.synchronize()
            wall = time.perf_counter() - start
        completions = to_completions(rows, outputs, num_generations, sampling, targets)
        clocks = timeline(outputs, completions, start, resolved) if self.engine.record_timestamps else None
        return Rollout(completions, num_generations, self.name, wall, mem.peak_bytes, mem.kind, resolved,
                       timeline=clocks)
