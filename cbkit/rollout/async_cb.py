"""Async rollouts on transformers' CB engine, in one process: the next rollout decodes while this step trains.

The engine runs on its thread over `snapshot`, a gradient-free copy of the weights: it switches the model's attention
while it runs (a training forward would lose its causal mask, transformers #48296) and `optimizer.step()` would write
weights its thread reads. `publish` copies new weights in between two forwards, under the forward hooks' lock, at a
pinned forward (`update_at`), so a run is reproducible; every token records the policy version that sampled it.
Prefix sharing is off: a request admitted after an update would read older KV.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from cbkit.rollout import upstream
from cbkit.rollout.base import Completion, Rollout, SamplingParams, check_request
from cbkit.rollout.engine import Engine, collect, take, timeline, to_completions
from cbkit.telemetry import PeakMemory

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Pending:  # a rollout queued in the engine: what was asked, and the results delivered so far
    rows: list[list[int]]  # each prompt N times, in group order
    num_generations: int
    sampling: SamplingParams
    ids: list[str]
    submitted_at: float
    update_at: int | None
    targets: list[int] | None = None  # a replayed length per row (EOS ignored)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.ids)


class AsyncEngine:
    """A CB engine kept running on a snapshot of `model`'s weights, refreshed by `publish` between its forwards."""

    name = "continuous-async"

    def __init__(self, model: PreTrainedModel, cb_config: Mapping[str, Any] | None = None, *,
                 record_timestamps: bool = True) -> None:
        if cb_config and cb_config.get("allow_block_sharing"):
            raise ValueError("allow_block_sharing=True with async rollouts: a request admitted after an update "
                             "would read prompt KV computed with older weights. Remove it from the continuous "
                             "batching config (async rollouts turn prefix sharing off).")
        self.policy = model
        self.snapshot = copy.deepcopy(model).eval().requires_grad_(False)
        self._pairs = [(self.snapshot.get_parameter(n), p) for n, p in model.named_parameters()]
        self.engine = Engine(self.snapshot, {**dict(cb_config or {}), "allow_block_sharing": False},
                             record_timestamps=record_timestamps)
        self.version = 0
        self.max_prompt_len = 0  # the longest prompt the run will send (the trainer sets it): sizes the KV pool
        self.swaps: list[tuple[float, int]] = []  # (perf_counter, version now in the snapshot)
        self._lock = threading.Lock()
        self._go, self._parked = threading.Event(), threading.Event()
        self._update_at: int | None = None
        self._forwards = 0
        self._positions: dict[str, dict[int, int]] = {}  # request id -> {position: version that computed it}
        self._key: tuple | None = None
        self._pending: Pending | None = None
        self.snapshot.register_forward_pre_hook(self._before_forward)
        self.snapshot.register_forward_hook(lambda *_: self._lock.release(), always_call=True)

    def _before_forward(self, module, args) -> None:
        if self._update_at is not None and self._forwards >= self._update_at:
            self._parked.set()
            self._go.wait()  # publish() copies the new weights now, then opens the gate
        self._lock.acquire()
        # The positions this forward computes: the token it samples, the KV.
        for r in upstream.scheduled(upstream.processor_of(self.engine.manager), blocks=False):
            seen = self._positions.setdefault(r.request_id, {})
            for pos in range(r.past_len, r.past_len + r.query_len):
                seen[pos] = self.version
        self._forwards += 1

    def publish(self, version: int) -> float:
        """Copy the policy's weights into the snapshot between two engine forwards (with `update_at`, once the engine
        ran that many or the rollout finished); returns seconds waited."""
        start = time.perf_counter()
        pending = self._pending
        if pending is not None and pending.update_at is not None:
            while not self._parked.is_set() and not pending.done:
                take(self.engine.manager, pending.results, 0.01, len(pending.ids))
        waited = time.perf_counter() - start
        with self._writing_weights():
            for dst, src in self._pairs:
                dst.copy_(src)
            self.version = version
            self.swaps.append((time.perf_counter(), version))
            self._update_at = None
            self._parked.clear()
        self._go.set()
        return waited

    def submit(self, prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams, *,
               update_at: int | None = None, prompt_names: Sequence[str] | None = None,
               target_lengths: Sequence[int] | None = None) -> Pending:
        """Queue P prompts x N completions (``target_lengths`` as `RolloutBackend.generate`); one rollout at a time."""
        if self._pending is not None and not self._pending.done:
            raise RuntimeError("AsyncEngine.submit: the previous rollout is still running; collect it first.")
        rows, targets = check_request(prompts, num_generations, sampling, self.snapshot, prompt_names, target_lengths)
        self._start(sampling, rows)
        with self.engine.manager.pause():  # all requests queued while the loop is parked: one drain, a seeded order
            self._forwards, self._positions = 0, {}
            self._go.clear()
            self._parked.clear()
            self._update_at = update_at
            ids = self.engine.submit(self.engine.manager, rows, sampling.max_new_tokens, sampling.seed, targets)
        self._pending = Pending(rows, num_generations, sampling, ids, time.perf_counter(), update_at, targets)
        return self._pending

    def collect(self, pending: Pending) -> Rollout:
        with PeakMemory(self.snapshot.device) as mem:
            collect(self.engine.manager, pending.ids, pending.results)
            mem.synchronize()
        wall = time.perf_counter() - pending.submitted_at
        outputs = [pending.results[rid] for rid in pending.ids]
        completions = [self._versioned(c, rid) for c, rid in zip(
            to_completions(pending.rows, outputs, pending.num_generations, pending.sampling, pending.targets), pending.ids,
            strict=True)]
        self._pending = None
        resolved = upstream.resolved_config(self.engine.manager)
        swaps = [s for s in self.swaps if s[0] >= pending.submitted_at]
        clocks = (timeline(outputs, completions, pending.submitted_at, resolved, swaps=swaps)
                  if self.engine.record_timestamps else None)
        return Rollout(completions, pending.num_generations, self.name, wall, mem.peak_bytes, mem.kind,
                       engine_config=resolved, timeline=clocks)

    def generate(self, prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams, *,
                 prompt_names: Sequence[str] | None = None, target_lengths: Sequence[int] | None = None) -> Rollout:
        return self.collect(self.submit(prompts, num_generations, sampling, prompt_names=prompt_names,
                                        target_lengths=target_lengths))

    def close(self) -> None:  # the snapshot is kept
        self._go.set()  # a forward parked at the gate must not wait forever
        self.engine.close()
        self._key, self._pending = None, None

    def _versioned(self, c: Completion, rid: str) -> Completion:
        """`c` with each token's policy version: the one that sampled it, or computed its KV (prompt tokens)."""
        seen, n = self._positions.get(rid, {}), len(c.prompt_ids)
        missing = [p for p in range(n + len(c.completion_ids) - 1) if p not in seen]  # the last token is not fed
        if missing:
            raise RuntimeError(f"Request {rid}: no engine forward recorded positions {missing[:5]}...; "
                               "the policy versions of its tokens are unknown.")
        return replace(c, policy_versions=tuple(seen[n + j - 1] for j in range(len(c.completion_ids))),
                       prompt_versions=tuple(seen[p] for p in range(n)))

    def _start(self, sampling: SamplingParams, rows: list[list[int]]) -> None:
        gen_config = sampling.generation_config()
        longest = max(self.max_prompt_len, *map(len, rows))
        key = (repr(gen_config.to_dict()), len(rows), longest)
        if self.engine.manager is not None and key == self._key:
            return
        self.close()
        # A pool for every row at the longest prompt the run may send: one engine for the whole run.
        self.engine.start(gen_config, [[0] * longest] * len(rows), sampling.max_new_tokens, sampling.seed)
        self._key = key

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        """The weights the engine samples with now, on CPU: a checkpoint keeps them to resume a pending rollout."""
        return {n: t.detach().to("cpu", copy=True) for n, t in self.snapshot.state_dict().items()}

    def load_snapshot(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        with self._writing_weights():
            self.snapshot.load_state_dict(state)
            self.version = version

    @contextlib.contextmanager
    def _writing_weights(self) -> Iterator[None]:
        """Write the snapshot's weights inside this block, between two engine forwards: the lock orders the
        enqueueing, two stream waits order the kernels on a GPU (before the engine has a stream, the host waits)."""
        with self._lock, torch.no_grad():
            engine = upstream.forward_stream(self.engine.manager)
            if engine is not None:
                torch.cuda.current_stream(engine.device).wait_stream(engine)
            try:
                yield
            finally:  # a failed write too: whatever it enqueued lands before the next forward
                if engine is not None:
                    engine.wait_stream(torch.cuda.current_stream(engine.device))
                elif self.snapshot.device.type == "cuda":
                    torch.cuda.current_stream(self.snapshot.device).synchronize()
