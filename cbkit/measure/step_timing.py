"""What a sweep's run line records beside its clock: its completion lengths and their spread, its share of the
roofline of its shape, an OOM as a record; and `cbkit sweep --full-step`: one whole GRPO step through cbkit's loop,
timed phase by phase (rollout, old-logprob forward, update, the rest), and the `continuous-async` row's steps with the
next rollout decoding while this one trains. The weights are put back after every point, so the next starts where
this one did.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cbkit.measure.workload import decode_padding_share, length_stats

# The async row's update lands after every forward of the rollout it meets: the step takes max(training, rollout)
# and every token is one update old, as on a GPU where the update lands at the end of training.
AFTER_THE_ROLLOUT = 2**31 - 1


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def oom_record(e: BaseException, mem) -> dict[str, Any]:
    """A run that ran out of memory: its first error line and the peak its PeakMemory saw before."""
    return {"status": "oom", "error": str(e).splitlines()[0][:300], "peak_mem_bytes": mem.peak_bytes,
            "peak_mem_kind": mem.kind}


def lengths_record(completions) -> dict[str, Any]:
    """A run's completion lengths (each, so a later sweep can replay them), their mean / CV / max, the share of a
    static batch's decode slots they leave as padding, and the share cut at the limit."""
    lengths = [len(c.completion_ids) for c in completions]
    stats = length_stats(lengths)
    return {"completion_lengths": lengths, "length_mean": stats["mean"], "length_cv": stats["cv"],
            "length_max": stats["max"], "decode_padding_share": decode_padding_share(lengths),
            "truncated_share": statistics.mean(c.finish_reason == "length" for c in completions)}


def roof_record(config, prompts, measured: dict[str, Any], probe: dict[str, Any], dtype_bytes: int) -> dict[str, Any]:
    """A run's roofline fields: the attainable tokens/s of its shape on the probed machine, the share of it the run
    reached, and which roof bound most decode steps. Without both peaks they are None and ``roof_missing`` says why."""
    from cbkit.measure.roofline import rollout_roofline

    empty = {"roof_tokens_per_s": None, "roof_share": None, "roof_bound": None, "bytes_per_s": probe.get("bytes_per_s")}
    missing = dict(probe.get("probe_missing") or {})
    missing.update({k: "not probed" for k in ("peak_flops", "bytes_per_s") if not probe.get(k) and k not in missing})
    if missing:
        return {**empty, "roof_missing": "; ".join(f"{k}: {v}" for k, v in sorted(missing.items()))}
    roof = rollout_roofline(config, prompt_lens=[len(p) for p in prompts],
                            completion_lengths=measured["completion_lengths"], dtype_bytes=dtype_bytes,
                            peak_flops=probe["peak_flops"], bytes_per_s=probe["bytes_per_s"])
    attainable = roof["attainable_tokens_per_s"]
    return {**empty, "roof_tokens_per_s": attainable,
            "roof_share": measured["tokens_per_s"] / attainable if attainable and measured.get("tokens_per_s") else None,
            "roof_bound": "compute" if roof["compute_bound_steps"] * 2 > roof["decode_steps"] else "bandwidth",
            "roof_seconds": roof["roof_seconds"], "peak_flops_spread": probe.get("peak_flops_spread"),
            "bytes_per_s_spread": probe.get("bytes_per_s_spread")}


def step_roof_record(model, rollout, measured: dict[str, Any], probe: dict[str, Any], config) -> dict[str, Any]:
    """Each phase of a full step against its roof: the rollout's (`roof_record`), the old-logprob forward's and the
    update's (`roofline.training_roofline`). A share is roof seconds over measured seconds."""
    from cbkit.measure.roofline import training_roofline

    comps, n = rollout.completions, rollout.num_generations
    prompts = [comps[g * n].prompt_ids for g in range(len(comps) // n)]  # completions come in group order
    roll = roof_record(model.config, prompts, {"completion_lengths": measured["completion_lengths"],
                                               "tokens_per_s": measured["rollout_tokens_per_s"]}, probe,
                       model.dtype.itemsize)
    out = {"rollout_roof_s": roll.get("roof_seconds"), "rollout_roof_share": roll["roof_share"],
           "rollout_roof_bound": roll["roof_bound"], "bytes_per_s": probe.get("bytes_per_s"),
           "old_logprob_roof_s": None, "old_logprob_roof_share": None, "update_roof_s": None, "update_roof_share": None}
    if "roof_missing" in roll:
        return {**out, "roof_missing": roll["roof_missing"]}
    micro = len(comps) // config.gradient_accumulation_steps
    chunk = micro if config.forward_chunk_rows is None else min(config.forward_chunk_rows, micro)
    roofs = training_roofline(model.config, rows=[(len(c.prompt_ids), len(c.completion_ids)) for c in comps],
                              forwards=config.gradient_accumulation_steps * -(-micro // chunk),
                              params=sum(p.numel() for p in model.parameters()), dtype_bytes=model.dtype.itemsize,
                              peak_flops=probe["peak_flops"], bytes_per_s=probe["bytes_per_s"],
                              num_iterations=config.num_iterations)
    old_s, update_s = measured["old_logprob_s"], measured["update_s"]
    return {**out, "old_logprob_roof_s": roofs["old_logprob_roof_s"], "update_roof_s": roofs["update_roof_s"],
            "old_logprob_roof_share": roofs["old_logprob_roof_s"] / old_s if old_s else None,
            "update_roof_share": roofs["update_roof_s"] / update_s if update_s else None}


class _Replayed:
    """A backend whose every rollout stops each completion at its drawn target: the length workload replayed inside
    the GRPO loop, which asks for rollouts without targets."""

    def __init__(self, backend, targets: Sequence[int]) -> None:
        self.backend, self.targets, self.name = backend, list(targets), backend.name

    def generate(self, prompts, num_generations, sampling, *, prompt_names=None, target_lengths=None):
        return self.backend.generate(prompts, num_generations, sampling, prompt_names=prompt_names,
                                     target_lengths=self.targets if target_lengths is None else target_lengths)


def _keep_weights(model):
    """The weights a measured step puts back afterwards, kept in a file on every device: a copy in memory would sit
    beside the step's own peak (on a GPU beside the async row's engine snapshot)."""
    from cbkit.train.snapshots import WeightSnapshots

    kept = WeightSnapshots(1, "disk")
    kept.append(0, model)
    return kept


def measure_steps(cfg, setup, n: int, rep: int, targets: Sequence[int] | None = None,
                  probe: dict[str, Any] | None = None, *, backend=None) -> dict[str, Any]:
    """GRPO steps through cbkit's loop, split by phase: the rollout, the old-logprob forward, the update, and the rest
    (rewards, batching, bookkeeping). With a `backend`, one step of it. Without, the `continuous-async` row:
    ``cfg.async_steps`` steps with async rollouts (`AsyncRollouts`), each later step's rollout decoding in
    transformers' thread while the step before trains; step 1 has nothing to overlap, so the point is the mean of the
    steps after it, and the rollout's part of such a step is what the trainer waited for it (at the step's start and
    at the publish), its own wall clock ``rollout_wall_s``. Peak memory covers every step. ``targets`` replays a
    length workload; with a ``probe`` each phase gets its share of its roof. The weights are put back afterwards."""
    from cbkit.telemetry import PeakMemory, release_memory
    from cbkit.train.config import CBGRPOConfig
    from cbkit.train.grpo import GRPOTrainer
    from cbkit.train.hooks import StepHooks
    from cbkit.train.offpolicy import AsyncRollouts

    class Seen(StepHooks):
        rollout: Any = None

        def on_rollout_end(self, rollout) -> None:
            self.rollout = rollout

    model, seen = setup.model, Seen()
    saved = _keep_weights(model)
    synchronous = backend is not None
    extra: dict[str, Any] = (dict(max_steps=1, use_transformers_continuous_batching=backend.name == "continuous")
                             if synchronous else
                             dict(use_transformers_continuous_batching=True, async_rollouts=True,
                                  async_update_at=AFTER_THE_ROLLOUT, max_steps=cfg.async_steps + 1,
                                  transformers_continuous_batching_config=dict(cfg.cb_config)))
    config = CBGRPOConfig(model=cfg.model, data=cfg.data, num_generations=n, prompts_per_step=len(setup.problems),
                          max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          top_k=cfg.top_k, seed=cfg.seed + rep, output_dir=None, disable_tqdm=True,
                          forward_chunk_rows=cfg.forward_chunk_rows, dtype=cfg.dtype or "auto", **extra)
    if synchronous:
        trainer = GRPOTrainer(config, setup, backend=backend if targets is None else _Replayed(backend, targets),
                              hooks=[seen])
    else:
        rollouts = AsyncRollouts(model, config, max_prompt_len=max(map(len, setup.prompts)), target_lengths=targets)
        trainer = GRPOTrainer(config, setup, rollouts=rollouts, hooks=[seen])
    # A trainer is a reference cycle holding its AdamW moments: collected now, not inside the next point's step.
    gc.collect()
    steps: list[dict[str, float]] = []
    mem = PeakMemory(model.device)
    try:
        with mem:
            for _ in range(1 if synchronous else cfg.async_steps):
                metrics: Mapping[str, Any] = trainer.step().metrics
                steps.append({k: v for k, v in metrics.items() if not isinstance(v, str)})
            mem.synchronize()
    except Exception as e:
        if not is_oom(e):
            raise
        return oom_record(e, mem)
    finally:
        if not synchronous:
            trainer.close()  # stops the engine thread; the rollout of the step never run is dropped
        del trainer
        saved.load_into(model)
        saved.close()
        release_memory(model)
    steady = steps if synchronous else steps[1:]

    def mean(key: str, default: float = 0.0) -> float:
        return statistics.mean(float(s.get(key, default)) for s in steady)

    step_s, old_s, update_s, wall_s = (mean(k) for k in ("step/seconds", "train/prepare_seconds",
                                                         "train/update_seconds", "rollout/seconds"))
    rollout_s = wall_s if synchronous else mean("offpolicy/rollout_wait_s") + mean("offpolicy/publish_wait_s", 0.0)
    rollout = seen.rollout
    assert rollout is not None, "the loop ran a step without a rollout"
    tokens = sum(len(c.completion_ids) for c in rollout.completions)
    measured = {"status": "ok", "step_s": step_s, "rollout_s": rollout_s, "train_s": mean("train/seconds"),
                "old_logprob_s": old_s, "update_s": update_s, "other_s": step_s - rollout_s - old_s - update_s,
                "rollout_share": rollout_s / step_s, "completion_tokens": tokens, "tokens_per_s": tokens / step_s,
                "rollout_tokens_per_s": tokens / wall_s if wall_s else None, "peak_mem_bytes": mem.peak_bytes,
                "peak_mem_kind": mem.kind, **lengths_record(rollout.completions),
                "reward_mean": mean("reward/mean") if all("reward/mean" in s for s in steady) else None,
                "forward_chunk_rows": cfg.forward_chunk_rows, "engine_config": rollout.engine_config,
                "prompt_lens": [len(c.prompt_ids) for c in rollout.completions[::n]]}  # one per prompt
    if not synchronous:
        measured.update(rollout_wait_s=mean("offpolicy/rollout_wait_s"),
                        publish_wait_s=mean("offpolicy/publish_wait_s", 0.0), rollout_wall_s=wall_s,
                        steady_steps=len(steady), first_step_s=steps[0]["step/seconds"],
                        step_s_each=[s["step/seconds"] for s in steps],
                        staleness_max=max(s.get("offpolicy/staleness_max", 0.0) for s in steady),
                        regenerated=sum(s.get("offpolicy/regenerated", 0.0) for s in steady),
                        async_update_at="after the rollout")
    if probe is not None:
        roofs = step_roof_record(model, rollout, measured, probe, config)
        if not synchronous:  # of the rollout's own wall clock (beside the training), not of the wait
            roofs["rollout_wall_roof_share"], roofs["rollout_roof_share"] = roofs["rollout_roof_share"], None
        measured.update(roofs)
    return measured
