"""`cbkit sweep --full-step`: one whole GRPO step through cbkit's loop, timed phase by phase (rollout, old-logprob
forward, update, the rest), and the `continuous-async` row's steps with the next rollout decoding while this one
trains. The sweep builds a `GRPOTrainer` per point and times its `prepare` and `optimize`; the weights are put back
after every point, so the next starts where this one did.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from cbkit.measure.plan_records import step_roof_record
from cbkit.measure.rollout_timing import is_oom, lengths_record, oom_record
from cbkit.measure.sweep_config import SweepConfig

# The async row's update lands after every forward of the rollout it meets (`async_update_at` past any rollout's
# forwards): the trainer publishes once the queued rollout has finished, so the step takes max(training, rollout),
# every token is exactly one update old, and the timing is what a GPU run gets when the update would land at the
# end of training. A pinned early forward (the loop's default, for reproducible runs) would park the engine for
# most of the training and hide little.
AFTER_THE_ROLLOUT = 2**31 - 1


class _Replayed:
    """A backend whose every rollout stops each completion at its drawn target: the length workload replayed inside
    the GRPO loop, which asks for rollouts without targets."""

    def __init__(self, backend, targets: Sequence[int]) -> None:
        self.backend, self.targets, self.name = backend, list(targets), backend.name

    def generate(self, prompts, num_generations, sampling, *, prompt_names=None, target_lengths=None):
        return self.backend.generate(prompts, num_generations, sampling, prompt_names=prompt_names,
                                     target_lengths=self.targets if target_lengths is None else target_lengths)


def _keep_weights(model):
    """The weights a measured step puts back afterwards, in a file on every device: a copy in memory would sit beside
    the step's own peak (in RAM on a CPU; on a GPU beside the async row's engine snapshot, which with a device copy
    outgrows a T4 at 04's size). The write and the read fall outside the step's clock and its peak."""
    from cbkit.train.snapshots import WeightSnapshots

    kept = WeightSnapshots(1, "disk")
    kept.append(0, model)
    return kept


def _put_back(model, kept) -> None:
    """Read the kept weights back into `model` and release what the step left: its gradients, the trainer
    the caller has dropped (collected, cycles included) and the heap it freed, so the next point starts where this one
    did."""
    from cbkit.telemetry import release_memory

    kept.load_into(model)
    kept.close()
    release_memory(model)


def _collect_garbage() -> None:
    """Free what the last point left in reference cycles before this one's memory baseline is read. A trainer is such
    a cycle (its hooks hold its bound methods), and with it its AdamW moments (8 bytes a
    parameter): left to the cyclic collector, they sit in the next point's baseline and are freed, and their heap
    reused, at whatever moment the collector runs inside that step, which takes up to their size off its peak."""
    import gc

    gc.collect()


def _numeric(metrics: Mapping[str, float | int | str]) -> dict[str, float]:
    """A step record's numbers (timings, counts, rewards), its labels (``rollout/backend``) left out."""
    return {k: v for k, v in metrics.items() if not isinstance(v, str)}


def measure_full_step(cfg: SweepConfig, setup, backend, n: int, rep: int, targets: Sequence[int] | None = None,
                      probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """One GRPO step through cbkit's loop with this backend, split by phase: the rollout (its own wall clock),
    the old-logprob forward, the update, and the rest (rewards, batching, bookkeeping: what none of the three
    is). Peak memory covers the whole step. ``targets`` replays a length workload (each completion stops at its
    target); None lets EOS decide. With a ``probe``, each phase gets its share of its roof. The weights are put
    back afterwards."""
    from cbkit.telemetry import PeakMemory
    from cbkit.train.grpo import GRPOTrainer

    model, problems = setup.model, setup.problems
    saved = _keep_weights(model)
    config = _step_config(cfg, n, rep, len(problems), max_steps=1,
                          use_transformers_continuous_batching=backend.name == "continuous")
    step_backend = backend if targets is None else _Replayed(backend, targets)
    seen = _rollout_seen()
    trainer = GRPOTrainer(config, setup, backend=step_backend, hooks=[seen])
    _collect_garbage()
    try:
        with PeakMemory(model.device) as mem:
            record = trainer.step()
            mem.synchronize()
    except Exception as e:
        if not is_oom(e):
            raise
        return oom_record(e, mem)
    finally:
        del trainer  # its AdamW state and gradients, before the weights are read back
        _put_back(model, saved)
    m, rollout = _numeric(record.metrics), seen.rollout
    lengths = [len(c.completion_ids) for c in rollout.completions]
    tokens = sum(lengths)
    step_s, rollout_s = m["step/seconds"], m["rollout/seconds"]
    measured = {
        "status": "ok",
        "step_s": step_s,
        "rollout_s": rollout_s,
        "train_s": m["train/seconds"],
        "old_logprob_s": m["train/prepare_seconds"],
        "update_s": m["train/update_seconds"],
        "other_s": step_s - rollout_s - m["train/prepare_seconds"] - m["train/update_seconds"],
        "rollout_share": rollout_s / step_s,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / step_s,  # completion tokens per second of whole step
        "rollout_tokens_per_s": tokens / rollout_s if rollout_s else None,
        "peak_mem_bytes": mem.peak_bytes,
        "peak_mem_kind": mem.kind,
        "truncated_share": statistics.mean(c.finish_reason == "length" for c in rollout.completions),
        **lengths_record(lengths),
        "reward_mean": m.get("reward/mean"),
        "forward_chunk_rows": cfg.forward_chunk_rows,
        "prompt_lens": [len(c.prompt_ids) for c in rollout.completions[::n]],  # one per prompt (group order)
        "engine_config": rollout.engine_config,
    }
    if probe is not None:
        measured.update(step_roof_record(model, rollout, measured, probe, config))
    return measured


def measure_async_steps(cfg: SweepConfig, setup, n: int, rep: int, targets: Sequence[int] | None = None,
                        probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """`continuous-async`: ``cfg.async_steps`` GRPO steps of cbkit's loop with async rollouts (`AsyncRollouts`), each
    later step's rollout decoding in transformers' thread while the step before it trains.

    Step 1 has nothing to overlap (its rollout is queued and waited for), so the point is the mean of the steps
    after it, each with its successor's rollout in flight (the trainer is configured one step longer than it
    runs). The rollout's part of such a step is what the trainer waited for it: at the step's start for the
    queued rollout (``offpolicy/rollout_wait_s``) and at the publish for the next one to finish
    (``offpolicy/publish_wait_s``, as the update lands after the whole rollout, `AFTER_THE_ROLLOUT`); its own wall
    clock, overlapping the training, is ``rollout_wall_s``. What the overlap bought, the synchronous CB rollout
    minus this wait, needs the continuous point beside it (`results.aggregate`). Every rollout replays
    ``targets``. The weights are put back and the engine closed (no thread left), whatever happened."""
    from cbkit.telemetry import PeakMemory
    from cbkit.train.grpo import GRPOTrainer
    from cbkit.train.offpolicy import AsyncRollouts

    model, problems = setup.model, setup.problems
    saved = _keep_weights(model)
    config = _step_config(cfg, n, rep, len(problems), use_transformers_continuous_batching=True, async_rollouts=True,
                          async_update_at=AFTER_THE_ROLLOUT, max_steps=cfg.async_steps + 1,
                          transformers_continuous_batching_config=dict(cfg.cb_config))
    seen = _rollout_seen()
    rollouts = AsyncRollouts(model, config, max_prompt_len=max(map(len, setup.prompts)), target_lengths=targets)
    trainer = GRPOTrainer(config, setup, rollouts=rollouts, hooks=[seen])
    steps: list[dict[str, float]] = []
    mem = PeakMemory(model.device)
    _collect_garbage()
    try:
        with mem:
            for _ in range(cfg.async_steps):
                steps.append(_numeric(trainer.step().metrics))
            mem.synchronize()
    except Exception as e:
        if not is_oom(e):
            raise
        return oom_record(e, mem)
    finally:
        trainer.close()  # stops the engine thread; the rollout of the step never run is dropped uncollected
        del trainer
        _put_back(model, saved)
    steady = steps[1:]

    def mean(key: str) -> float:
        return statistics.mean(s[key] for s in steady)

    waits = [s["offpolicy/rollout_wait_s"] + s.get("offpolicy/publish_wait_s", 0.0) for s in steady]
    rollout = seen.rollout
    lengths = [len(c.completion_ids) for c in rollout.completions]
    tokens = sum(lengths)
    step_s, wait_s, wall_s = mean("step/seconds"), statistics.mean(waits), mean("rollout/seconds")
    old_s, update_s = mean("train/prepare_seconds"), mean("train/update_seconds")
    measured = {
        "status": "ok",
        "step_s": step_s,
        "rollout_s": wait_s,  # the rollout's part of the step: what the trainer waited for it
        "rollout_wait_s": mean("offpolicy/rollout_wait_s"),
        "publish_wait_s": statistics.mean(s.get("offpolicy/publish_wait_s", 0.0) for s in steady),
        "rollout_wall_s": wall_s,
        "train_s": mean("train/seconds"),
        "old_logprob_s": old_s,
        "update_s": update_s,
        "other_s": step_s - wait_s - old_s - update_s,
        "rollout_share": wait_s / step_s,
        "steady_steps": len(steady),
        "first_step_s": steps[0]["step/seconds"],
        "step_s_each": [s["step/seconds"] for s in steps],
        "staleness_max": max(s.get("offpolicy/staleness_max", 0.0) for s in steady),
        "regenerated": sum(s.get("offpolicy/regenerated", 0.0) for s in steady),
        "async_update_at": "after the rollout",
        "completion_tokens": tokens,
        "tokens_per_s": tokens / step_s,  # completion tokens per second of whole step
        "rollout_tokens_per_s": tokens / wall_s if wall_s else None,
        "peak_mem_bytes": mem.peak_bytes,
        "peak_mem_kind": mem.kind,
        "truncated_share": statistics.mean(c.finish_reason == "length" for c in rollout.completions),
        **lengths_record(lengths),
        "reward_mean": mean("reward/mean") if all("reward/mean" in s for s in steady) else None,
        "forward_chunk_rows": cfg.forward_chunk_rows,
        "prompt_lens": [len(c.prompt_ids) for c in rollout.completions[::n]],
        "engine_config": rollout.engine_config,
    }
    if probe is not None:
        roofs = step_roof_record(model, rollout, measured, probe, config)
        # The rollout's roof share is of its own wall clock (while the training ran beside it), not of the wait
        # the step's rollout column holds: kept under its own name, so no cell divides one by the other.
        roofs["rollout_wall_roof_share"], roofs["rollout_roof_share"] = roofs["rollout_roof_share"], None
        measured.update(roofs)
    return measured


def _step_config(cfg: SweepConfig, n: int, rep: int, prompts: int, **kw: Any):
    """The loop's config for a full-step point: the sweep's sampling, lengths and chunking, no output, no bar."""
    from cbkit.train.config import CBGRPOConfig

    return CBGRPOConfig(
        model=cfg.model, data=cfg.data, num_generations=n, prompts_per_step=prompts,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        seed=cfg.seed + rep, output_dir=None, disable_tqdm=True, forward_chunk_rows=cfg.forward_chunk_rows,
        dtype=cfg.dtype or "auto", **kw)


def _rollout_seen():
    """A step hook keeping the last rollout the loop produced (`StepHooks` imported here, as the loop is)."""
    from cbkit.train.hooks import StepHooks

    class Seen(StepHooks):
        rollout = None

        def on_rollout_end(self, rollout) -> None:
            self.rollout = rollout

    return Seen()


