"""Continuous batching: the same job as `generate.py`, through transformers' CB engine.

Read this file next to `generate.py`. Instead of one padded batch decoded in lock-step, the P*N requests
go into a queue. The engine keeps a fixed pool of KV-cache blocks (sized once, as a share of free memory),
and at every step builds a batch from whatever is running: prefill chunks of new requests and one decode
token for each running one, packed without padding. When a sequence hits EOS its blocks go back to the
pool and a waiting request takes them (*recycling*), so memory follows the tokens actually alive rather
than P*N*max_len.

Two things cbkit does that TRL's CB path (1.16) does not:

* it asks the engine for sampling logprobs (`return_logprobs=True`) and keeps them, so the loop's
  importance-sampling correction has something to correct with;
* it raises when a request fails instead of logging and returning fewer completions.

Like TRL 1.16 it passes the sampling parameters explicitly as a GenerationConfig (TRL issue #5783, fixed by
1.16: without them the engine falls back to the model's defaults and sampling goes near-greedy).

The engine itself -- its config, attention, loop, reseeding, a kept engine's cache -- lives in `engine.py`, which
this backend drives. A kept engine (`persistent=True`) must not sample on KV of weights the optimizer has since
changed; docs/design.md tells why and `tests/test_persistent_engine.py` checks each guard against `generate()`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from cbkit.rollout.base import Rollout, SamplingParams, check_request
from cbkit.rollout.engine import Engine, timeline, to_completions
from cbkit.telemetry import PeakMemory

__all__ = ["ContinuousBackend"]


class ContinuousBackend:
    name = "continuous"

    def __init__(
        self,
        model,
        cb_config: Mapping[str, Any] | None = None,
        *,
        record_timestamps: bool = False,
        persistent: bool = False,
    ) -> None:
        # persistent: keep the engine's cache and buffers between calls (a GRPO step each) instead of building them
        # anew; its loop still stops after every call and the model's attention is restored, so training forwards
        # in between are plain causal forwards.
        self.engine = Engine(model, cb_config, persistent=persistent, record_timestamps=record_timestamps)
        self.model = model

    def close(self) -> None:
        """Free this backend's persistent engine (its KV pool and buffers); another backend's is left alone."""
        self.engine.close()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        num_generations: int,
        sampling: SamplingParams,
        *,
        prompt_names: Sequence[str] | None = None,
        target_lengths: Sequence[int] | None = None,
    ) -> Rollout:
        check_request(prompts, num_generations, sampling, self.model, prompt_names, target_lengths)
        # Each prompt submitted N times in a row; the engine returns results in this order, whatever order it
        # finished them in.
        rows = [list(p) for p in prompts for _ in range(num_generations)]
        targets = [int(t) for t in target_lengths] if target_lengths is not None else None
        with PeakMemory(self.model.device) as mem:
            start = time.perf_counter()
            outputs, resolved = self.engine.run(rows, sampling.generation_config(), seed=sampling.seed,
                                                max_new_tokens=sampling.max_new_tokens, targets=targets)
            mem.synchronize()
            wall = time.perf_counter() - start
        completions = to_completions(rows, outputs, num_generations, sampling, targets)
        return Rollout(
            completions=completions,
            num_generations=num_generations,
            backend=self.name,
            wall_s=wall,
            peak_mem_bytes=mem.peak_bytes,
            peak_mem_kind=mem.kind,
            engine_config=resolved,
            timeline=timeline(outputs, completions, start, resolved) if self.engine.record_timestamps else None,
        )  # checked once, where it enters the trainer (cbkit.train.rollouts.check_entry)
