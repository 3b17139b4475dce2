"""Async rollouts on transformers' CB engine, in one process: the next rollout decodes while this step trains.

`continuous.py` starts the engine for a rollout and stops it after; here it keeps running on transformers' thread.
The loop submits step t+1's requests, trains step t while the engine decodes them, and publishes the updated weights
between two engine forwards, so a completion can straddle an update; every token records the *policy version* (the
count of optimizer updates) of the weights whose forward sampled it.

The engine decodes on `snapshot`, an in-process copy of the weights (no gradients, no optimizer state), refreshed by a
device-to-device `copy_` after each update, not on the training weights, though the manager's `pause()` is made for
updating a model in place: the attention implementation is a field of the model's config, switched for the engine
until it stops, so a training forward meanwhile would run the paged attention without a causal mask (transformers
#48296); and `optimizer.step()` writes the parameters while the engine's thread reads them.

No forward sees a half-applied update: a forward pre-hook on the snapshot takes a lock its post-hook releases, and
`publish` copies under the same lock; on a GPU it also orders the two CUDA streams both ways (`_writing_weights`).
The pre-hook writes down the positions each forward computes for each request and the version it computes them with.
The update lands at a pinned forward (`update_at`), not whenever training ends, so a run is reproducible and
resumable (`state_dict` keeps the weights a pending rollout started on). Prefix sharing is off: a request admitted
after an update would read prompt KV computed before it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cbkit.rollout.base import Completion, Rollout, SamplingParams, check_request
from cbkit.rollout.engine import Engine, timeline, to_completions
from cbkit.telemetry import PeakMemory

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Pending:
    """A rollout queued in the engine: what was asked, and the results it has delivered so far."""

    prompts: list[list[int]]
    num_generations: int
    sampling: SamplingParams
    ids: list[str]
    submitted_at: float
    update_at: int | None
    targets: list[int] | None = None  # a replayed length per row (EOS ignored), or None: EOS and the limit decide
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
        # transformers' thread runs the loop: the trainer trains while it decodes. Bad keys fail now.
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
        self.snapshot.register_forward_pre_hook(self._before_forward)
        self.snapshot.register_forward_hook(self._after_forward, always_call=True)

    # --- the engine's side (its thread) ---------------------------------------------------------------------

    def _before_forward(self, module, args) -> None:
        if self._update_at is not None and self._forwards >= self._update_at:
            self._parked.set()
            self._go.wait()  # publish() copies the new weights now, then opens the gate
        self._lock.acquire()
        for r in self.engine.scheduled():  # the positions this forward computes: the token it samples, the KV
            seen = self._positions.setdefault(r.request_id, {})
            for pos in range(r.past_len, r.past_len + r.query_len):
                seen[pos] = self.version
        self._forwards += 1

    def _after_forward(self, module, args, output) -> None:
        self._lock.release()

    # --- the trainer's side ---------------------------------------------------------------------------------

    def publish(self, version: int) -> float:
        """Copy the policy's weights into the snapshot between two engine forwards; returns seconds waited.

        With a rollout queued with `update_at`, waits until the engine has run that many forwards of it (or the
        rollout finished first), so the update lands at the same token in every run."""
        start = time.perf_counter()
        pending = self._pending
        if pending is not None and pending.update_at is not None:
            while not self._parked.is_set() and not pending.done:
                self.engine.take(pending.results, 0.01, len(pending.ids))
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
        """Queue P prompts x N completions; the engine starts on them at once. Only one rollout at a time.
        ``target_lengths`` (one per completion row, in group order) replays a length workload, as
        `RolloutBackend.generate` does: EOS is ignored and completion i stops at exactly its target."""
        if self._pending is not None and not self._pending.done:
            raise RuntimeError("AsyncEngine.submit: the previous rollout is still running; collect it first.")
        check_request(prompts, num_generations, sampling, self.snapshot, prompt_names, target_lengths)
        targets = [int(t) for t in target_lengths] if target_lengths is not None else None
        rows = [list(p) for p in prompts for _ in range(num_generations)]
        self._start(sampling, rows)
        with self.engine.paused():  # all requests queued while the loop is parked: one drain, a seeded order
            self._forwards, self._positions = 0, {}
            self._go.clear()
            self._parked.clear()
            self._update_at = update_at
            ids = self.engine.queue(rows, sampling.max_new_tokens, sampling.seed, targets=targets)
        self._pending = Pending([list(p) for p in prompts], num_generations, sampling, ids,
                                time.perf_counter(), update_at, targets)
        return self._pending

    def collect(self, pending: Pending) -> Rollout:
        """Wait for every completion of `pending`; each carries the policy versions of its tokens."""
        with PeakMemory(self.snapshot.device) as mem:
            while not pending.done:
                self.engine.take(pending.results, 1.0, len(pending.ids))
            mem.synchronize()
        wall = time.perf_counter() - pending.submitted_at
        rows = [p for p in pending.prompts for _ in range(pending.num_generations)]
        outputs = [pending.results[rid] for rid in pending.ids]
        completions = [self._versioned(c, rid) for c, rid in zip(
            to_completions(rows, outputs, pending.num_generations, pending.sampling, pending.targets), pending.ids,
            strict=True)]
        self._pending = None
        resolved = self.engine.resolved()
        return Rollout(
            completions=completions, num_generations=pending.num_generations, backend=self.name, wall_s=wall,
            peak_mem_bytes=mem.peak_bytes, peak_mem_kind=mem.kind, engine_config=resolved,
            timeline=timeline(outputs, completions, pending.submitted_at, resolved,
                              swaps=[s for s in self.swaps if s[0] >= pending.submitted_at])
            if self.engine.record_timestamps else None,
        )  # checked once, where it enters the trainer (cbkit.train.rollouts.check_entry)

    def generate(self, prompts: Sequence[Sequence[int]], num_generations: int, sampling: SamplingParams, *,
                 prompt_names: Sequence[str] | None = None, target_lengths: Sequence[int] | None = None) -> Rollout:
        """The synchronous call of the `RolloutBackend` protocol: submit, then collect, on the current snapshot."""
        return self.collect(self.submit(prompts, num_generations, sampling, prompt_names=prompt_names,
                                        target_lengths=target_lengths))

    def close(self) -> None:
        """Stop the engine thread and restore the snapshot's attention; the snapshot itself is kept."""
        self._go.set()  # a forward parked at the gate must not wait forever
        self.engine.close()
        self._key, self._pending = None, None

    _pending: Pending | None = None

    # --- helpers --------------------------------------------------------------------------------------------

    def _versioned(self, c: Completion, rid: str) -> Completion:
        """`c` with the policy version of every token: the one whose forward sampled it, and for each prompt token
        the one its KV was computed with."""
        seen, n = self._positions.get(rid, {}), len(c.prompt_ids)
        missing = [p for p in range(n + len(c.completion_ids) - 1) if p not in seen]  # the last token is not fed
        if missing:
            raise RuntimeError(f"Request {rid}: no engine forward recorded positions {missing[:5]}...; "
                               "the policy versions of its tokens are unknown.")
        return dataclasses.replace(c, policy_versions=tuple(seen[n + j - 1] for j in range(len(c.completion_ids))),
                                   prompt_versions=tuple(seen[p] for p in range(n)))

    def _start(self, sampling: SamplingParams, rows: list[list[int]]) -> None:
        """A running engine for these sampling settings (a new one if they changed), started on the snapshot."""
        gen_config = sampling.generation_config()
        longest = max(self.max_prompt_len, *map(len, rows))
        key = (repr(gen_config.to_dict()), len(rows), longest)
        if self.engine.manager is not None and key == self._key:
            return
        self.close()
        # The pool: every row at the longest prompt it may get, run to the limit (`make_cb_config` on CPU), so one
        # engine serves the whole run instead of being rebuilt whenever a longer prompt comes.
        self.engine.start(gen_config, [[0] * longest] * len(rows), sampling.max_new_tokens, sampling.seed)
        self._key = key

    # --- resume ---------------------------------------------------------------------------------------------

    def snapshot_state(self) -> dict[str, torch.Tensor]:
        """The weights the engine samples with now, on CPU: what a checkpoint keeps to resume a pending rollout."""
        return {n: t.detach().to("cpu", copy=True) for n, t in self.snapshot.state_dict().items()}

    def load_snapshot(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        with self._writing_weights():
            self.snapshot.load_state_dict(state)
            self.version = version

    @contextlib.contextmanager
    def _writing_weights(self) -> Iterator[None]:
        """Write the snapshot's weights inside this block, between two engine forwards, on the device too.

        The lock keeps every forward's *enqueueing* whole; on a GPU the kernels run later, the engine's on its own
        stream and these copies on this thread's, and nothing orders two streams. Two one-way waits do, on the device:
        this stream first waits for what the engine has enqueued (no copy overwrites weights a forward still reads),
        and after the last copy the engine's stream waits for this one (the next forward reads the new weights whole).
        Before the engine has built its stream, a GPU copy is waited for on the host."""
        with self._lock, torch.no_grad():
            engine = self.engine.stream()
            copier = torch.cuda.current_stream(engine.device) if engine is not None else None
            if engine is not None and copier is not None:  # both, or neither
                copier.wait_stream(engine)
            try:
                yield
            finally:  # a failed write too: whatever it enqueued lands before the next forward
                if engine is not None and copier is not None:
                    engine.wait_stream(copier)
                elif self.snapshot.device.type == "cuda":
                    torch.cuda.current_stream(self.snapshot.device).synchronize()
