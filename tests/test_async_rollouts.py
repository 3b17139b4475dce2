"""Async rollouts on the CB engine (`cbkit.rollout.async_cb`, `cbkit.train.offpolicy.AsyncRollouts`).

What is checked, each against something computed apart from the engine: the versions recorded per token against
where the update was pinned; every forward's weights against fingerprints of each published version (no forward
sees a half-applied update); the engine's logprobs of a straddling completion against a teacher-forced replay
under the versions that produced each token, and against the single-version forward an after-the-fact "old
logprobs" pass would use; a resumed async run against the uninterrupted one.
"""

from __future__ import annotations

import time

import pytest
import torch

from cbkit.models.load import load_policy
from cbkit.rollout import SamplingParams
from cbkit.rollout.async_cb import AsyncEngine
from cbkit.train.objective import policy_logprobs
from cbkit.train.offpolicy import input_versions, versioned_logprobs
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
        replay = versioned_logprobs(model, weights, c.prompt_ids, c.completion_ids, input_versions(c))
        assert (replay - engine).abs().max().item() < 1e-4
        for version in (0, 1):
            single = versioned_logprobs(model, weights, c.prompt_ids, c.completion_ids, [version] * (
                len(c.prompt_ids) + len(c.completion_ids) - 1))
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
    assert tr.offpolicy.engine.snapshot.config._attn_implementation == tr.model.config._attn_implementation


def test_an_async_run_that_writes_no_checkpoint_keeps_no_second_copy_of_the_engine_weights(tmp_path):
    """The weights a queued rollout started on are kept for a checkpoint only: a copy of the model each step. Without
    an output_dir (no checkpoint can be written) none is taken; with one, it is the snapshot the rollout started on."""
    quiet = trainer(async_config(max_steps=2))
    try:
        quiet.step()
        assert getattr(quiet.offpolicy, "previous", None) is None
    finally:
        quiet.close()
    saving = trainer(async_config(max_steps=2, output_dir=str(tmp_path)))
    start = {k: v.clone() for k, v in saving.model.state_dict().items()}
    try:
        saving.step()  # step 2's rollout was queued on the weights step 1 started from
        assert same_weights(saving.offpolicy.previous, start)
        assert not same_weights(saving.offpolicy.engine.snapshot_state(), start)  # since published: the update
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
