"""Async rollouts on the CB engine (`cbkit.rollout.async_cb`, `cbkit.train.rollouts.AsyncRollouts`).

What is checked, each against something computed apart from the engine: the versions recorded per token against
where the update was pinned; every forward's weights against fingerprints of each published version (no forward
sees a half-applied update); the engine's logprobs of a straddling completion against a teacher-forced replay
under the versions that produced each token, and against the single-version forward an after-the-fact "old
logprobs" pass would use; a resumed async run against the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cbkit.models.load import load_policy
from cbkit.rollout import SamplingParams, upstream
from cbkit.rollout.async_cb import AsyncEngine
from cbkit.train.objective import policy_logprobs
from tests.helpers import TIMING, config, same_weights, trainer, untimed_metrics

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
UPDATE_AT = 4
# Offpolicy timings join the loop's: how long the trainer waited is a matter of the machine's load.
WAITS = (*TIMING, "offpolicy/rollout_wait_s", "offpolicy/publish_wait_s")


pytestmark = pytest.mark.usefixtures("one_thread")


def _sampling(max_new_tokens: int = 12, seed: int = 3) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, eos_token_id=None, pad_token_id=0, seed=seed)


def _perturb(model, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


@torch.no_grad()
def _versioned_logprobs(model, weights, c) -> torch.Tensor:
    """`c`'s logprobs as the engine computed them: each run of input positions (prompt, then its tokens but the last)
    of one recorded version goes through `model` loaded with that version, on the KV cache the earlier runs left."""
    import inspect

    from transformers import DynamicCache

    # transformers 5.x renames `past_key_values` to `cache`; the DynamicCache is filled in place either way.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    versions = list(c.prompt_versions) + list(c.policy_versions[1:])
    ids = torch.tensor([list(c.prompt_ids) + list(c.completion_ids)])
    cache, logits, start = DynamicCache(), [], 0
    while start < len(versions):
        end = start
        while end < len(versions) and versions[end] == versions[start]:
            end += 1
        model.load_state_dict(weights[versions[start]])
        out = model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end)[None], use_cache=True,
                    **{name: cache})
        logits.append(out.logits[0].float())
        start = end
    p = len(c.prompt_ids)
    return torch.cat(logits)[p - 1 :].log_softmax(-1).gather(-1, ids[0, p:, None]).squeeze(-1)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def straddled():
    """One rollout of 2 prompts x 3 whose update lands before the engine's 5th forward: its tokens 0-3 (the
    prefill's token, then three decode steps) come from version 0, the rest from version 1."""
    model, _ = load_policy("tiny", seed=0)
    engine = AsyncEngine(model)
    try:
        w0 = _weights(model)
        pending = engine.submit(PROMPTS, 3, _sampling(), update_at=UPDATE_AT)
        torch.manual_seed(1)
        _perturb(model)
        w1 = _weights(model)
        engine.publish(1)
        rollout = engine.collect(pending)
    finally:
        engine.close()
    return rollout, {0: w0, 1: w1}


def test_each_token_records_the_version_that_sampled_it(straddled):
    rollout, _ = straddled
    for c in rollout.completions:
        assert c.policy_versions == (0,) * UPDATE_AT + (1,) * (len(c.completion_ids) - UPDATE_AT)
        assert c.prompt_versions == (0,) * len(c.prompt_ids)
    times = rollout.timeline["requests"][0]["token_times"]
    landed = rollout.timeline["swaps"][0][0]
    assert times[UPDATE_AT - 1] < landed < times[UPDATE_AT]  # the engine's own clocks agree


def test_is_on_engine_logprobs_is_exact_where_an_after_the_fact_forward_is_not(straddled):
    """The engine's logprobs equal a replay in which each position is processed by the version that processed it
    (KV of the old weights under the new weights' queries). A forward under one version, as an "old logprobs"
    pass after the rollout would run, misses them: under version 1 on the tokens before the update (and after
    it, through the old KV), under version 0 on those after. Measured: replay within 2e-6; single versions
    off by more than 0.05 nats somewhere in every completion (the margin asserted is 1e-2)."""
    rollout, weights = straddled
    model, _ = load_policy("tiny", seed=0)
    for c in rollout.completions:
        engine = torch.tensor(c.sampling_logprobs)
        replay = _versioned_logprobs(model, weights, c)
        assert (replay - engine).abs().max().item() < 1e-4
        for version in (0, 1):
            n = len(c.completion_ids)
            single = _versioned_logprobs(model, weights, dataclasses.replace(
                c, prompt_versions=(version,) * len(c.prompt_ids), policy_versions=(version,) * n))
            assert (single - engine).abs().max().item() > 1e-2, version
        # The IS ratio against the current policy (version 1) is what the loss uses: with the engine's logprobs it
        # is the replay's; with the after-the-fact denominator (version 1 itself) it would be exactly 1.
        model.load_state_dict(weights[1])
        ids = torch.tensor([list(c.prompt_ids) + list(c.completion_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1]
        current = policy_logprobs(logits, torch.tensor(c.completion_ids))
        assert torch.allclose((current - engine).exp(), (current - replay).exp(), atol=1e-4)


def test_replayed_targets_stop_each_completion_at_its_own_length_across_an_update():
    """`submit(target_lengths=...)`: EOS is ignored (the tiny model's EOS id would end some rows early) and each row
    stops at exactly its target, in group order, also when the update lands mid-rollout; the versions still cover
    every token. A wrong count is refused before anything is queued."""
    model, _ = load_policy("tiny", seed=0)
    engine = AsyncEngine(model)
    targets = [1, 7, 3, 12, 5, 2]  # 2 prompts x 3, the longest at the limit
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, eos_token_id=2, pad_token_id=0, seed=3)
    try:
        with pytest.raises(ValueError, match="6 completion rows"):
            engine.submit(PROMPTS, 3, sampling, target_lengths=targets[:5])
        pending = engine.submit(PROMPTS, 3, sampling, update_at=UPDATE_AT, target_lengths=targets)
        _perturb(model)
        engine.publish(1)
        rollout = engine.collect(pending)
        again = engine.generate(PROMPTS, 3, sampling, target_lengths=targets[::-1])  # the protocol's call
    finally:
        engine.close()
    assert [len(c.completion_ids) for c in rollout.completions] == targets
    assert all(c.finish_reason == "length" for c in rollout.completions)
    assert [len(c.sampling_logprobs) for c in rollout.completions] == targets
    for c in rollout.completions:
        assert c.policy_versions == ((0,) * UPDATE_AT + (1,) * len(c.completion_ids))[: len(c.completion_ids)]
    assert [len(c.completion_ids) for c in again.completions] == targets[::-1]
    assert engine.engine.manager is None  # closed: no engine thread left


def test_no_forward_sees_a_half_applied_update():
    """Three updates published while the engine decodes, at whatever moment the main thread gets to them (no
    pinned point): a hook after the engine's lock fingerprints the weights each forward reads (the sum of every
    tensor), and each fingerprint must be one published version's, whole, and the version the engine recorded."""
    model, _ = load_policy("tiny", seed=0)
    engine = AsyncEngine(model)
    prints = {0: _fingerprint(model)}
    seen: list[tuple[tuple[float, ...], int]] = []
    engine.snapshot.register_forward_pre_hook(lambda m, a: seen.append((_fingerprint(m), engine.version)))
    try:
        pending = engine.submit(PROMPTS * 2, 4, _sampling(max_new_tokens=40))
        for version in (1, 2, 3):
            deadline = time.monotonic() + 60
            while len(seen) < 3 * version and time.monotonic() < deadline:  # a few forwards on each version
                time.sleep(0.002)
            _perturb(model, 0.01)
            prints[version] = _fingerprint(model)
            engine.publish(version)
        engine.collect(pending)
    finally:
        engine.close()
    assert len(seen) > 10
    by_print = {v: k for k, v in prints.items()}
    assert all(fp in by_print and by_print[fp] == version for fp, version in seen)


def _fingerprint(model) -> tuple[float, ...]:
    return tuple(round(p.double().sum().item(), 9) for p in model.parameters())


# --- the same on a GPU, where the lock orders only the enqueueing ----------------------------------------------


class _Streams:
    """A stand-in for CUDA's stream API that keeps, for every kernel enqueued, the kernels that must finish before it
    starts. The rules (CUDA programming guide, "Streams" and "Events"): a stream runs its kernels in order;
    an event recorded on a stream marks the work that stream has been given so far, and a stream made to wait on it
    (`wait_event`, or `wait_stream`, which records one) runs what it gets afterwards after that work;
    `synchronize()` returns once a stream's work is done, so everything enqueued later, on any stream, runs
    after it. Nothing else orders two streams: PyTorch creates its streams non-blocking."""

    def __init__(self) -> None:
        self.before: dict[tuple, frozenset] = {}  # kernel -> the kernels that finish before it starts
        self.frontier: dict[str, frozenset] = {}  # stream -> what a kernel enqueued on it now would run after
        self.host: frozenset = frozenset()  # kernels the host has waited for
        self.current: _FakeStream | None = None

    def new(self, name: str) -> _FakeStream:
        self.frontier[name] = frozenset()
        return _FakeStream(self, name)

    def enqueue(self, stream: _FakeStream, label: str) -> tuple:
        kernel = (stream.name, len(self.before), label)
        self.before[kernel] = self.frontier[stream.name] | self.host
        self.frontier[stream.name] = self.before[kernel] | {kernel}
        return kernel

    def runs_before(self, a: tuple, b: tuple) -> bool:
        return a in self.before[b]

    def patch(self, mp: pytest.MonkeyPatch) -> None:
        streams = self

        class Event:
            def __init__(self, *args, **kwargs) -> None:
                self.marks: frozenset = frozenset()

            def record(self, stream=None) -> None:
                self.marks = streams.frontier[(stream or streams.current).name]

            def wait(self, stream=None) -> None:
                (stream or streams.current).wait_event(self)

            def synchronize(self) -> None:
                streams.host |= self.marks

        @contextlib.contextmanager
        def stream(s):
            previous, streams.current = streams.current, s
            try:
                yield
            finally:
                streams.current = previous

        def synchronize(device=None) -> None:
            for marks in streams.frontier.values():
                streams.host |= marks

        mp.setattr(torch.cuda, "Event", Event)
        mp.setattr(torch.cuda, "stream", stream)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: streams.current)
        mp.setattr(torch.cuda, "synchronize", synchronize)
        self.Event = Event


class _FakeStream:
    def __init__(self, streams: _Streams, name: str) -> None:
        self.streams, self.name, self.device = streams, name, torch.device("cuda", 0)

    def record_event(self, event=None):
        event = event or self.streams.Event()
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        self.streams.frontier[self.name] |= event.marks

    def wait_stream(self, other: _FakeStream) -> None:
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        self.streams.host |= self.streams.frontier[self.name]


class _Copies(TorchFunctionMode):
    """Every `copy_` into one of `targets` (tensors, by address) becomes a kernel on the stand-in's current stream."""

    def __init__(self, streams: _Streams, targets: set[int]) -> None:
        super().__init__()
        self.streams, self.targets, self.kernels = streams, targets, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and args[0].data_ptr() in self.targets:
            self.kernels.append(self.streams.enqueue(self.streams.current, "copy"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("write", ["publish", "load_snapshot"])
def test_on_a_gpu_a_weight_update_is_ordered_against_the_engines_stream(write, monkeypatch):
    """The tiny model on the CPU, with transformers' compute stream and torch's stream API replaced by `_Streams`: the
    engine's last forward is enqueued on its stream, the trainer writes the snapshot's weights (each `copy_` a
    kernel on the trainer's current stream), then the next forward is enqueued. No copy may start before the first
    forward ends (it still reads the old weights), and the next forward must start after the last copy."""
    model, _ = load_policy("tiny", seed=0)
    engine = AsyncEngine(model)
    streams = _Streams()
    streams.current, compute = streams.new("trainer"), streams.new("engine")
    streams.patch(monkeypatch)
    monkeypatch.setattr("cbkit.rollout.upstream.forward_stream", lambda manager: compute)
    try:
        running = streams.enqueue(compute, "forward on the old weights")
        _perturb(model)
        with _Copies(streams, {p.data_ptr() for p in engine.snapshot.parameters()}) as copies:
            engine.publish(1) if write == "publish" else engine.load_snapshot(model.state_dict(), 1)
        following = streams.enqueue(compute, "the next forward")
    finally:
        engine.close()
    assert len(copies.kernels) == len(list(model.parameters()))
    assert same_weights(engine.snapshot.state_dict(), model.state_dict())
    assert all(streams.runs_before(running, c) for c in copies.kernels), \
        "a copy can start while the engine's forward still reads the weights it overwrites"
    assert all(streams.runs_before(c, following) for c in copies.kernels), \
        "the engine's next forward can read a half-copied update"


def async_config(**kw):
    return config(use_transformers_continuous_batching=True, async_rollouts=True, async_update_at=3, **kw)


def test_async_training_straddles_updates_and_reports_it(tmp_path):
    tr = trainer(async_config(max_steps=3, output_dir=str(tmp_path)))
    tr.train()
    rows = untimed_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["offpolicy/staleness_max"] == 0.0  # step 1's rollout ran before any update
    for r in rows[1:]:
        assert r["offpolicy/staleness_max"] == 1.0 and r["offpolicy/straddling_frac"] > 0
        assert r["offpolicy/logprob_max_abs_diff"] > 1e-3 > rows[0]["offpolicy/logprob_max_abs_diff"]
    assert tr.rollouts.engine.snapshot.config._attn_implementation == tr.model.config._attn_implementation


def test_an_async_run_that_writes_no_checkpoint_keeps_no_second_copy_of_the_engine_weights(tmp_path):
    """The weights a queued rollout started on are kept for a checkpoint only: a copy of the model each step. Without
    an output_dir (no checkpoint can be written) none is taken; with one, it is the snapshot the rollout started on."""
    quiet = trainer(async_config(max_steps=2))
    try:
        quiet.step()
        assert getattr(quiet.rollouts, "previous", None) is None
    finally:
        quiet.close()
    saving = trainer(async_config(max_steps=2, output_dir=str(tmp_path)))
    start = {k: v.clone() for k, v in saving.model.state_dict().items()}
    try:
        saving.step()  # step 2's rollout was queued on the weights step 1 started from
        assert same_weights(saving.rollouts.previous, start)
        assert not same_weights(saving.rollouts.engine.snapshot_state(), start)  # since published: the update
    finally:
        saving.close()


def test_a_rollout_older_than_max_staleness_is_regenerated(tmp_path):
    """Two updates per step: the first tokens of a queued rollout are 2 updates old by the time the loss runs."""
    tr = trainer(async_config(max_steps=2, num_iterations=2, max_staleness=1))
    records = [tr.step() for _ in range(2)]
    tr.close()
    assert records[1].metrics["offpolicy/regenerated"] == 1.0
    assert records[1].metrics["offpolicy/staleness_max"] == 0.0


def test_a_resumed_async_run_draws_what_the_uninterrupted_one_drew(tmp_path):
    def run(out, steps, resume=False):
        tr = trainer(async_config(max_steps=steps, save_steps=2, output_dir=str(out)))
        tr.train(resume_from=resume or None)
        return tr

    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 4, resume=True)

    def strip(path):
        return [{k: v for k, v in r.items() if k not in WAITS} for r in untimed_metrics(path / "metrics.jsonl")]

    assert strip(tmp_path / "resumed") == strip(tmp_path / "straight")
    assert same_weights(straight.model.state_dict(), resumed.model.state_dict())


@pytest.mark.gpu
def test_on_a_gpu_every_forward_reads_one_published_version_whole():
    """`test_no_forward_sees_a_half_applied_update` on a real GPU, where the lock alone would not do: five updates
    published at whatever moment while the engine decodes 32 rows. The weights are big enough that a publish's copies
    take about as long as a forward (Llama-3.2-1B's shape in fp32, 5 GB, where the GPU holds twice that and a pool).
    Each forward's weights are fingerprinted inside the lock, on the stream the forward runs on, at its start and at
    its end: a float64 sum per tensor, left on the device until the rollout is over (a host sync per forward would
    order the streams itself and hide the race). Every fingerprint must be one published version's, whole, the one
    the engine recorded, and the same at both ends (no copy ran under the forward)."""
    big = torch.cuda.get_device_properties(0).total_memory >= 40 * 2**30
    model = load_policy("llama-1b-random" if big else "llama-tiny-random", dtype=torch.float32, device="cuda").model
    params = list(model.parameters())

    def device_print(tensors) -> torch.Tensor:
        return torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors])

    engine = AsyncEngine(model, {"max_memory_percent": 0.1})
    mine = list(engine.snapshot.parameters())
    starts: list[tuple[torch.Tensor, int, bool]] = []
    ends: list[torch.Tensor] = []
    engine.snapshot.register_forward_pre_hook(lambda m, a: starts.append(
        (device_print(mine), engine.version, torch.cuda.current_stream() == upstream.forward_stream(engine.engine.manager))))
    engine.snapshot.register_forward_hook(lambda m, a, o: ends.append(device_print(mine)), prepend=True)  # in the lock
    prints = {0: device_print(params)}
    try:
        pending = engine.submit(PROMPTS * 4, 4, _sampling(max_new_tokens=48))
        for version in range(1, 6):
            deadline = time.monotonic() + 120
            while len(starts) < 4 * version and time.monotonic() < deadline:
                time.sleep(0.001)
            _perturb(model, 0.01)
            prints[version] = device_print(params)
            engine.publish(version)
        engine.collect(pending)
    finally:
        engine.close()
    torch.cuda.synchronize()
    prints = {v: p.cpu() for v, p in prints.items()}
    assert len(starts) == len(ends) > 20 and len({v for _, v, _ in starts}) >= 3
    assert all(on_engine_stream for _, _, on_engine_stream in starts), "a forward ran off the engine's compute stream"
    for i, ((start, version, _), end) in enumerate(zip(starts, ends, strict=True)):
        start, end = start.cpu(), end.cpu()
        torn = [n for n, (a, b) in enumerate(zip(start, prints[version], strict=True))
                if not torch.isclose(a, b, rtol=1e-9, atol=0)]
        assert not torn, f"forward {i} (version {version}) read tensors {torn[:5]} not as version {version} has them"
        assert torch.equal(start, end), f"forward {i}: the weights changed while it ran"
