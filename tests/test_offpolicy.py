"""Rollouts from an older policy on purpose (`rollout_staleness`): exact, measured, resumable, refused when wrong.

Runs on the tiny model with the `generate` backend (seeded per step, deterministic on a torch build) unless a
test says otherwise. The checks compare with things computed apart from the code under test: a policy rebuilt
from a checkpoint file, a case worked by hand, the plain loop.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_model

from cbkit.models.load import load_policy
from cbkit.rollout import make_backend
from cbkit.train.hooks import StepHooks
from cbkit.train.offpolicy import LaggedRollouts, drift_metrics
from cbkit.train.rollouts import OnPolicyRollouts
from cbkit.train.setup import pad_token_id
from tests.helpers import TIMING, config, same_weights, trainer, untimed_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


class Keep(StepHooks):
    def __init__(self) -> None:
        self.rollouts = []

    def on_rollout_end(self, rollout) -> None:
        self.rollouts.append(rollout)


def test_drift_metrics_on_a_case_worked_by_hand():
    # Two scored tokens: current - sampling = ln 2 and 0; a third is padding and must not count.
    current = torch.tensor([[math.log(2) - 1.0, -0.5, 9.0]])
    sampling = torch.tensor([[-1.0, -0.5, 0.0]])
    mask = torch.tensor([[True, True, False]])
    m = drift_metrics(current, sampling, mask, "token_truncate")
    assert m["offpolicy/logprob_mean_abs_diff"] == pytest.approx(math.log(2) / 2)
    assert m["offpolicy/logprob_max_abs_diff"] == pytest.approx(math.log(2))
    assert m["offpolicy/kl"] == pytest.approx((2 - 1 - math.log(2)) / 2)  # k3 = r - 1 - ln r, r = 2 and 1
    assert (m["offpolicy/ratio_min"], m["offpolicy/ratio_max"]) == pytest.approx((1.0, 2.0))
    seq = drift_metrics(current, sampling, mask, "sequence_mask")  # one sequence: ratio = 2 * 1
    assert seq["offpolicy/ratio_mean"] == pytest.approx(2.0) and seq["offpolicy/ratio_std"] == 0.0


def test_staleness_zero_builds_nothing_and_is_the_on_policy_loop():
    tr = trainer(config())
    assert type(tr.rollouts) is OnPolicyRollouts and tr.rollouts.backend is tr.backend and tr.backend.model is tr.model
    record = tr.step()
    assert not any(k.startswith("offpolicy/") for k in record.metrics)


def test_a_lag_of_zero_through_the_snapshot_machinery_changes_no_number():
    """The same loop through the snapshot machinery with k = 0 (the policy samples as it is; no weights are copied)
    is the on-policy loop to the bit: the same tokens, rewards, losses and every other metric."""
    policy = load_policy("tiny", seed=0)
    backend = make_backend("generate", policy.model, pad_token_id=pad_token_id(policy.tokenizer))
    rollouts = LaggedRollouts(policy.model, backend, 0)
    plain, lagged = trainer(config()), trainer(config(), policy=policy, rollouts=rollouts)
    loads = []
    rollouts.history.load_into = lambda *a: loads.append(a)  # type: ignore[method-assign]
    a = [plain.step().metrics for _ in range(2)]
    b = [lagged.step().metrics for _ in range(2)]
    assert loads == []  # k = 0: no weight copy in or out of the policy
    for x, y in zip(a, b, strict=True):
        assert set(x) == {k for k in y if not k.startswith("offpolicy/")}
        for k in set(x) - set(TIMING):
            assert x[k] == y[k], k
        assert y["offpolicy/staleness_max"] == 0.0 and y["offpolicy/logprob_max_abs_diff"] < 1e-4


@pytest.mark.parametrize("backend", ["generate", "continuous"])
def test_staleness_k_samples_from_the_checkpoint_of_k_updates_earlier(tmp_path, backend):
    """k = 2: step 4 (3 updates done) samples from the weights after update 1, i.e. checkpoint-1 on disk. A policy
    rebuilt from that file, rolled out with step 4's seed, draws the same tokens with the same logprobs; the
    current weights (checkpoint-3) draw others."""
    keep = Keep()
    cfg = config(max_steps=4, rollout_staleness=2, save_steps=1, save_total_limit=10, output_dir=str(tmp_path),
                 use_transformers_continuous_batching=backend == "continuous")
    tr = trainer(cfg, hooks=[keep])
    tr.train()
    rows = untimed_metrics(tmp_path / "metrics.jsonl")
    assert [r["offpolicy/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert rows[0]["offpolicy/logprob_max_abs_diff"] < 1e-4 < rows[2]["offpolicy/logprob_max_abs_diff"]
    assert all(c.policy_versions == (1,) * len(c.completion_ids) for c in keep.rollouts[3].completions)

    def replay(step_dir):
        model, _ = load_policy("tiny", seed=0)
        load_model(model, str(tmp_path / step_dir / "model.safetensors"))
        indices = tr.order.indices(6, 2)  # step 4's prompts: positions 6 and 7
        return make_backend(backend, model, pad_token_id=tr.pad_token_id).generate(
            [tr.prompt_ids[i] for i in indices], 4, tr.sampling_params(4))

    got, old = keep.rollouts[3].completions, replay("checkpoint-1").completions
    now = replay("checkpoint-3").completions
    assert [c.completion_ids for c in got] == [c.completion_ids for c in old]
    gaps = [abs(a - b) for c, d in zip(got, old, strict=True)
            for a, b in zip(c.sampling_logprobs, d.sampling_logprobs, strict=True)]
    assert max(gaps) < 1e-5
    assert [c.completion_ids for c in got] != [c.completion_ids for c in now]


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_resume_with_staleness_draws_what_the_uninterrupted_run_drew(tmp_path, where):
    """A checkpoint keeps the snapshots the next rollouts need; with them on disk too (the files are read into it)."""
    def run(out, steps, resume=False):
        tr = trainer(config(max_steps=steps, rollout_staleness=2, save_steps=2, output_dir=str(out),
                            rollout_snapshots=where))
        tr.train(resume_from=resume or None)
        return tr

    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 4, resume=True)
    assert untimed_metrics(tmp_path / "resumed" / "metrics.jsonl") == untimed_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert same_weights(straight.model.state_dict(), resumed.model.state_dict())


def test_resuming_with_a_different_staleness_is_refused(tmp_path):
    trainer(config(max_steps=1, rollout_staleness=1, save_steps=1, output_dir=str(tmp_path))).train()
    with pytest.raises(ValueError, match=r"rollout_staleness: checkpoint has 1, this run has 2"):
        trainer(config(max_steps=2, rollout_staleness=2, save_steps=1, output_dir=str(tmp_path))).train(True)


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_snapshots_are_bitwise_the_weights_wherever_they_are_kept(where):
    """A ring of two versions: the oldest kept is read back into another model bitwise (fp32, bf16 and fp16), and so
    is the newest; a "host" copy is in CPU memory and a "device" copy where the model is (a CPU model here: the
    CUDA side is in tests/test_gpu.py); on disk a dropped version's file is gone, and closing removes the folder."""
    from cbkit.train.snapshots import WeightSnapshots

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = load_policy("tiny", seed=0).model.to(dtype)
        other = load_policy("tiny", seed=1).model.to(dtype)
        ring = WeightSnapshots(2, where)
        states = []
        for version in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (version + 1))
            states.append({n: t.clone() for n, t in model.state_dict().items()})
            ring.append(version, model)
        assert ring.versions == [1, 2]
        if where == "disk":
            folder = ring._dir
            assert sorted(f.name for f in folder.iterdir()) == ["v1.bin", "v2.bin"]
        else:
            kept = ring._ring[0][1]
            assert all(t.device.type == "cpu" and t.dtype == dtype for t in kept.values())
            assert not any(t.data_ptr() == m.data_ptr() for t, m in zip(kept.values(), model.state_dict().values(),
                                                                         strict=True))  # copies, not views
        assert ring.load_into(other) == 1
        assert same_weights(other.state_dict(), states[1])
        assert ring.load_into(other, -1) == 2 and same_weights(other.state_dict(), states[2])
        ring.close()
        if where == "disk":
            assert not folder.exists()


def test_a_host_snapshot_is_pinned_where_cuda_is(monkeypatch):
    """With CUDA present (torch's answer patched in: this machine has none), each "host" copy is allocated
    page-locked, so copies to and from the GPU run at the bus's speed; without CUDA, plain memory (pinning needs it)."""
    from cbkit.train.snapshots import WeightSnapshots

    model = load_policy("tiny", seed=0).model
    calls, empty = [], torch.empty

    def recording_empty(*args, pin_memory=False, **kwargs):
        calls.append(pin_memory)
        return empty(*args, **kwargs)  # this CPU build cannot pin

    monkeypatch.setattr(torch, "empty", recording_empty)
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        calls.clear()
        WeightSnapshots(1, "host").append(0, model)
        assert calls == [cuda] * len(model.state_dict())


def test_a_snapshot_place_that_is_not_one_says_which_are():
    from cbkit.train.snapshots import WeightSnapshots

    for where in ("memory", "ssd"):  # "memory" was the name of both "device" and "host"
        with pytest.raises(ValueError, match=rf"where='{where}' is not a place .* \('device', 'host', 'disk'\)"):
            WeightSnapshots(2, where)


def test_a_run_with_its_snapshots_on_disk_is_the_run_with_them_in_memory():
    """Staleness 2 with the older weights in files instead of clones: the same rollouts, metrics and final weights,
    to the bit (the files hold the tensors' bytes)."""
    runs = {}
    for where in ("host", "disk"):
        tr = trainer(config(max_steps=4, rollout_staleness=2, rollout_snapshots=where))
        runs[where] = ([tr.step().metrics for _ in range(4)], tr.model.state_dict())
        if where == "disk":
            assert len(list(tr.rollouts.history._dir.iterdir())) == 3  # k + 1 versions, nothing in memory
            folder = tr.rollouts.history._dir
            tr.close()
            assert not folder.exists()
    (mem, w_mem), (disk, w_disk) = runs["host"], runs["disk"]
    for a, b in zip(mem, disk, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    assert same_weights(w_mem, w_disk)


@pytest.mark.parametrize(("fields", "message"), [
    ({"rollout_snapshots": "memory"}, r"rollout_snapshots='memory' is not supported; use one of 'device', 'host', "
                                      r"'disk'"),
    ({"rollout_staleness": -1}, r"rollout_staleness=-1 must be >= 0"),
    ({"max_staleness": -2}, r"max_staleness=-2 must be >= 0"),
    ({"async_rollouts": True, "use_transformers_continuous_batching": False},
     r"async_rollouts=True .*; set use_transformers_continuous_batching=True"),
    ({"async_rollouts": True, "use_transformers_continuous_batching": True, "rollout_staleness": 1},
     r"choose one \(set rollout_staleness=0 or async_rollouts=False"),
    ({"stale_rollouts": "skip"}, r"stale_rollouts='skip' is not supported; use one of 'regenerate', 'drop'"),
    ({"async_rollouts": True, "use_transformers_continuous_batching": True, "async_update_at": 0},
     r"async_update_at=0 must be >= 1"),
])
def test_bad_off_policy_settings_name_the_field_and_the_choice(fields, message):
    with pytest.raises(ValueError, match=message):
        config(**fields)


def test_a_backend_passed_with_staleness_is_refused():
    model, tok = load_policy("tiny", seed=0)
    with pytest.raises(ValueError, match=r"pass no backend"):
        trainer(config(rollout_staleness=1), policy=(model, tok), backend=make_backend("generate", model))


@pytest.mark.parametrize("where", ["device", "host", "disk"])
def test_a_tied_embedding_is_kept_once_and_comes_back_under_both_names(where, tmp_path):
    """SmolLM2 and Qwen2.5 tie their embedding to the LM head: `state_dict()` lists the one matrix under two names. A
    snapshot keeps it once, in every place: its bytes are those of the model's distinct parameters (torch's own
    `parameters()`, which yields a tied one once), not of its state dict. It comes back bitwise under both names, into
    a tied model (still tied after), also through a checkpoint of the rollout source's ring."""
    from cbkit.train.snapshots import WeightSnapshots

    tiny = load_policy("tiny", seed=0).model
    config = tiny.config.__class__(**{**tiny.config.to_dict(), "tie_word_embeddings": True})
    torch.manual_seed(0)
    model, other = type(tiny)(config), type(tiny)(config)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied, as built
    params = dict(model.named_parameters())  # a tied parameter once
    assert len(state) == len(params) + 1  # no persistent buffers here; the tied matrix's second name
    distinct = sum(p.nbytes for p in params.values())
    assert distinct < sum(t.nbytes for t in state.values())  # the embedding counted twice by the state dict
    ring = WeightSnapshots(1, where)
    ring.append(0, model)
    kept = ring._ring[0][1]
    held = sum(t.nbytes for t in (torch.load(kept, weights_only=True) if where == "disk" else kept).values())
    assert held == distinct
    ring.load_into(other)
    back = other.state_dict()
    assert same_weights(back, state)
    assert back["lm_head.weight"].data_ptr() == back["model.embed_tokens.weight"].data_ptr()
    ring.close()
    saved = LaggedRollouts(model, None, 0, where)  # a checkpoint's ring: read back tied and bitwise
    saved.save(tmp_path)
    resumed = LaggedRollouts(other, None, 0, where)
    resumed.load(tmp_path, 0)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    resumed.history.load_into(other)
    back = other.state_dict()
    assert same_weights(back, state)
    assert back["lm_head.weight"].data_ptr() == back["model.embed_tokens.weight"].data_ptr()
    saved.close()
    resumed.close()
