"""What a sweep's run records beside its clock (its lengths and their spread, its share of its shape's roof, an OOM
as a record), and `cbkit sweep --full-step`: one GRPO step through cbkit's loop, split into the phases the loop
times itself. The weights are put back after every point, so the next starts where this one did."""

from __future__ import annotations

import gc
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from cbkit.measure.workload import decode_padding_share, length_stats


def oom_record(e: BaseException, peak_bytes: int | None, kind: str | None) -> dict[str, Any]:
    """A run that ran out of memory as a record (its first error line, the peak seen before); anything else raises."""
    if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()):
        raise e
    return {"status": "oom", "error": str(e).splitlines()[0][:300], "peak_mem_bytes": peak_bytes,
            "peak_mem_kind": kind}


def lengths_record(completions) -> dict[str, Any]:
    """A run's completion lengths (each, so a later sweep can replay them), their mean / CV / max, the share of a
    static batch's decode slots they leave as padding, and the share cut at the limit."""
    lengths = [len(c.completion_ids) for c in completions]
    stats = length_stats(lengths)
    return {"completion_lengths": lengths, "length_mean": stats["mean"], "length_cv": stats["cv"],
            "length_max": stats["max"], "decode_padding_share": decode_padding_share(lengths),
            "truncated_share": statistics.mean(c.finish_reason == "length" for c in completions)}


def roof_record(config, prompts, lengths: Sequence[int], tokens_per_s: float | None, probe: dict[str, Any],
                dtype_bytes: int) -> dict[str, Any]:
    """The attainable tokens/s of a rollout's shape on the probed machine, the share of it ``tokens_per_s`` reached,
    and which roof bound most decode steps. Without both peaks they are None and ``roof_missing`` says why."""
    from cbkit.measure.roofline import rollout_roofline

    empty = {"roof_tokens_per_s": None, "roof_share": None, "roof_bound": None, "bytes_per_s": probe.get("bytes_per_s")}
    missing = dict(probe.get("probe_missing") or {})
    missing.update({k: "not probed" for k in ("peak_flops", "bytes_per_s") if not probe.get(k) and k not in missing})
    if missing:
        return {**empty, "roof_missing": "; ".join(f"{k}: {v}" for k, v in sorted(missing.items()))}
    roof = rollout_roofline(config, prompt_lens=[len(p) for p in prompts], completion_lengths=lengths,
                            dtype_bytes=dtype_bytes, peak_flops=probe["peak_flops"], bytes_per_s=probe["bytes_per_s"])
    attainable = roof["attainable_tokens_per_s"]
    return {**empty, "roof_tokens_per_s": attainable,
            "roof_share": tokens_per_s / attainable if attainable and tokens_per_s else None,
            "roof_bound": "compute" if roof["compute_bound_steps"] * 2 > roof["decode_steps"] else "bandwidth",
            "roof_seconds": roof["roof_seconds"], "peak_flops_spread": probe.get("peak_flops_spread"),
            "bytes_per_s_spread": probe.get("bytes_per_s_spread")}


class _Replayed:
    """A backend whose every rollout stops each completion at its drawn target: the length workload replayed inside
    the GRPO loop, which asks for rollouts without targets."""

    def __init__(self, backend, targets: Sequence[int]) -> None:
        self.backend, self.targets, self.name = backend, list(targets), backend.name

    def generate(self, prompts, num_generations, sampling, *, prompt_names=None, target_lengths=None):
        return self.backend.generate(prompts, num_generations, sampling, prompt_names=prompt_names,
                                     target_lengths=self.targets if target_lengths is None else target_lengths)


def _keep_weights(model):
    """The weights a measured step puts back, kept in a file: a copy in memory would sit beside the step's peak."""
    from cbkit.train.snapshots import WeightSnapshots

    kept = WeightSnapshots(1, "disk")
    kept.append(0, model)
    return kept


def measure_step(cfg, setup, n: int, rep: int, backend, targets: Sequence[int] | None = None) -> dict[str, Any]:
    """One GRPO step of ``backend`` through cbkit's loop, split by the phases the loop times: the rollout, the
    old-logprob forward, the update, and the rest (rewards, batching, bookkeeping). ``targets`` replays a length
    workload. The weights are put back afterwards."""
    from cbkit.telemetry import PeakMemory, release_memory
    from cbkit.train.config import CBGRPOConfig
    from cbkit.train.grpo import GRPOTrainer
    from cbkit.train.hooks import StepHooks

    class Seen(StepHooks):
        rollout: Any = None

        def on_rollout_end(self, rollout) -> None:
            self.rollout = rollout

    model, seen = setup.model, Seen()
    saved = _keep_weights(model)
    config = CBGRPOConfig(model=cfg.model, data=cfg.data, num_generations=n, prompts_per_step=len(setup.problems),
                          max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          top_k=cfg.top_k, seed=cfg.seed + rep, output_dir=None, disable_tqdm=True, max_steps=1,
                          forward_chunk_rows=cfg.forward_chunk_rows, dtype=cfg.dtype or "auto",
                          use_transformers_continuous_batching=backend.name == "continuous")
    trainer = GRPOTrainer(config, setup, backend=backend if targets is None else _Replayed(backend, targets),
                          hooks=[seen])
    # A trainer is a reference cycle holding its AdamW moments: collected now, not inside the next point's step.
    gc.collect()
    mem = PeakMemory(model.device)
    try:
        with mem:
            metrics = trainer.step().metrics
            mem.synchronize()
    except Exception as e:
        return oom_record(e, mem.peak_bytes, mem.kind)
    finally:
        del trainer
        saved.load_into(model)
        saved.close()
        release_memory(model)
    step_s, rollout_s, old_s, update_s, train_s = (float(metrics[k]) for k in (
        "step/seconds", "rollout/seconds", "train/prepare_seconds", "train/update_seconds", "train/seconds"))
    rollout = seen.rollout
    tokens = sum(len(c.completion_ids) for c in rollout.completions)
    return {"status": "ok", "step_s": step_s, "rollout_s": rollout_s, "train_s": train_s,
            "old_logprob_s": old_s, "update_s": update_s, "other_s": step_s - rollout_s - old_s - update_s,
            "rollout_share": rollout_s / step_s, "completion_tokens": tokens, "tokens_per_s": tokens / step_s,
            "rollout_tokens_per_s": tokens / rollout_s if rollout_s else None, "peak_mem_bytes": mem.peak_bytes,
            "peak_mem_kind": mem.kind, **lengths_record(rollout.completions), "reward_mean": metrics.get("reward/mean"),
            "forward_chunk_rows": cfg.forward_chunk_rows, "engine_config": rollout.engine_config}
