"""The N-sweep: both backends side by side at growing N, resumable, honest about what it measured.

One model load; at every N, `repeats` runs of each backend in alternating order, each appended to the results JSONL
as it lands, both backends given the same length targets. Both roofs are probed before every N, and each run records
its MFU, its share of its roof and the planner's peak error. With `full_step` a point is one GRPO step, split by
phase."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cbkit.jsonl import append_jsonl
from cbkit.measure.planner import plan
from cbkit.measure.results import ResultsFile, aggregate
from cbkit.measure.roofline import machine_probe, matmul_params, mfu, rollout_roofline
from cbkit.measure.sweep_config import SweepConfig, trainer_state_bytes
from cbkit.measure.workload import decode_padding_share, length_stats
from cbkit.rollout.engine_config import make_cb_config
from cbkit.rollout.varlen_attention import NAME as VARLEN
from cbkit.telemetry import PeakMemory, cuda_peaks, kv_accounting, release_memory
from cbkit.train.config import CBGRPOConfig
from cbkit.train.grpo import GRPOTrainer
from cbkit.train.setup import set_up_run
from cbkit.train.snapshots import WeightSnapshots


def run_sweep(cfg: SweepConfig, out: str | Path, *, on_point: Callable[[dict[str, Any]], None] | None = None,
              policy=None) -> list[dict[str, Any]]:
    """Run (or resume) the sweep; returns the aggregated points. `on_point` sees each run as it lands."""
    results = ResultsFile(out, cfg.fingerprint())
    todo = [(n, rep, b) for n_i, n in enumerate(cfg.ns) for rep in range(cfg.repeats)
            for b in (cfg.backends if (n_i + rep) % 2 == 0 else cfg.backends[::-1]) if not results.done(b, n, rep)]
    if not todo:
        return aggregate(results.runs)
    # A full step trains the weights it rolls out from, and the loop trains fp32 weights (cfg.dtype is its autocast).
    setup = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed,
                       dtype="float32" if cfg.full_step else cfg.dtype, policy=policy)
    model, prompts = setup.model, setup.prompts
    sampling = setup.sampling(cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              seed=cfg.seed)
    dtype_bytes, params = model.dtype.itemsize, matmul_params(model)
    backends = {b: setup.backend(b, cb_config=cfg.cb_config) for b in cfg.backends}
    # A trainer's state, allocated before the free memory is read: the engine's share and the planner's budget are
    # of what it leaves (on a CPU torch.empty commits no pages).
    held = (torch.empty(trainer_state_bytes(model), dtype=torch.uint8, device=model.device)
            if cfg.trainer_state else None)
    budget = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else None  # free after the weights
    probe: dict[str, Any] = {}
    probed_at = None
    for n, rep, b in tqdm(todo, desc="sweep runs"):
        if probed_at != n:  # both roofs, at the start, then before every N; a failed probe is recorded, not fatal
            probe = machine_probe(model)
            append_jsonl(results.path, {"kind": "probe", "time": time.time(), "before_N": n if probed_at else None,
                                        "lengths": cfg.workload.describe(cfg.max_new_tokens), **probe})
            for name, why in probe["probe_missing"].items():
                print(f"probe: no {name} ({why}); the columns that need it stay empty", flush=True)
            probed_at = n
        run_sampling = dataclasses.replace(sampling, seed=cfg.seed + rep)
        # Drawn from (seed, rows) only: both backends at this point get the same targets.
        targets = cfg.workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=run_sampling.seed)
        if cfg.full_step:
            measured = measure_step(cfg, setup, n, rep, backends[b], targets)
        else:
            measured = measure_run(backends[b], prompts, n, run_sampling, model.config, dtype_bytes, targets)
        run = {"backend": b, "N": n, "repeat": rep, "num_prompts": len(prompts), "time": time.time(),
               "lengths": cfg.lengths, **measured, **cuda_peaks(model.device)}
        if measured["status"] == "ok":
            rate = measured["rollout_tokens_per_s"] if cfg.full_step else measured["tokens_per_s"]
            run.update(matmul_params=params, peak_flops=probe["peak_flops"],
                       mfu=None if cfg.full_step else mfu(params, measured["completion_tokens"], measured["rollout_s"],
                                                          probe["peak_flops"]),
                       **roof_record(model.config, prompts, measured["completion_lengths"], rate, probe, dtype_bytes))
        run.update(plan_record(cfg, model, prompts, n, b, dtype_bytes, budget, run, targets))
        if held is not None:
            run["trainer_state_bytes"] = held.numel()
        results.add(run)
        if on_point is not None:
            on_point(run)
    return aggregate(results.runs)


def measure_run(backend, prompts, n: int, sampling, config, dtype_bytes: int,
                target_lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """One timed rollout and what it cost; an OOM becomes a record. ``target_lengths`` replays a length workload."""
    try:
        rollout = backend.generate(prompts, n, sampling, target_lengths=target_lengths)
    except Exception as e:
        cuda = torch.cuda.is_available()
        record = oom_record(e, torch.cuda.max_memory_allocated() if cuda else None, "cuda_allocated" if cuda else None)
        if cuda:
            torch.cuda.empty_cache()
        return record
    return {"status": "ok", "rollout_s": rollout.wall_s, "completion_tokens": rollout.completion_tokens,
            "tokens_per_s": rollout.tokens_per_s, "peak_mem_bytes": rollout.peak_mem_bytes,
            "peak_mem_kind": rollout.peak_mem_kind,
            **lengths_record(rollout.completions), "engine_config": rollout.engine_config,
            **kv_accounting(rollout, config, dtype_bytes)}


def plan_record(cfg, model, prompts, n, backend, dtype_bytes, budget, run, targets=None) -> dict[str, Any]:
    """The planner's rollout peak for this point, with the attention the engine ran, and its error against the
    measured peak. With replayed targets the static batch runs to the longest one. A full step is not planned."""
    if cfg.full_step:
        return {}
    impl = str((run.get("engine_config") or {}).get("attn_implementation", "sdpa"))
    device = "cuda" if model.device.type == "cuda" else "cpu"
    cb_config = dict(cfg.cb_config)
    if targets and device == "cpu" and "num_blocks" not in cb_config:
        rows = [x for x in prompts for _ in range(n)]
        cb_config["num_blocks"] = make_cb_config(cb_config, device=model.device, rows=rows,
                                                 max_new_tokens=cfg.max_new_tokens, warn=False).num_blocks
    p = plan(model.config, num_prompts=len(prompts), num_generations=n, prompt_len=[len(x) for x in prompts],
             max_new_tokens=max(targets) if targets else cfg.max_new_tokens, dtype_bytes=dtype_bytes,
             budget_bytes=budget, cb_config=cb_config, device=device,  # type: ignore[arg-type]
             attn_implementation="varlen" if impl == VARLEN else "flash" if "flash" in impl else "sdpa")
    planned = p.generate.peak_bytes if backend == "generate" else p.continuous.peak_bytes
    measured = run.get("peak_mem_bytes")
    return {"planned_peak_bytes": planned, "plan_error": measured / planned - 1 if measured and planned else None}


def oom_record(e: BaseException, peak_bytes: int | None, kind: str | None) -> dict[str, Any]:
    """A run that ran out of memory as a record (its first error line, the peak seen before); anything else raises."""
    if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()):
        raise e
    return {"status": "oom", "error": str(e).splitlines()[0][:300], "peak_mem_bytes": peak_bytes,
            "peak_mem_kind": kind}


def lengths_record(completions) -> dict[str, Any]:
    lengths = [len(c.completion_ids) for c in completions]
    return {"completion_lengths": lengths, **length_stats(lengths),
            "decode_padding_share": decode_padding_share(lengths),
            "truncated_share": statistics.mean(c.finish_reason == "length" for c in completions)}


def roof_record(config, prompts, lengths: Sequence[int], tokens_per_s: float | None, probe: dict[str, Any],
                dtype_bytes: int) -> dict[str, Any]:
    """The rollout's attainable tokens/s on the probed machine, the share reached and the roof that bound most steps."""
    empty = {"roof_tokens_per_s": None, "roof_share": None, "roof_bound": None, "bytes_per_s": probe.get("bytes_per_s")}
    if missing := probe["probe_missing"]:
        return {**empty, "roof_missing": "; ".join(f"{k}: {v}" for k, v in sorted(missing.items()))}
    roof = rollout_roofline(config, prompt_lens=[len(p) for p in prompts], completion_lengths=lengths,
                            dtype_bytes=dtype_bytes, peak_flops=probe["peak_flops"], bytes_per_s=probe["bytes_per_s"])
    attainable = roof["attainable_tokens_per_s"]
    return {**empty, "roof_tokens_per_s": attainable,
            "roof_share": tokens_per_s / attainable if attainable and tokens_per_s else None,
            "roof_bound": "compute" if roof["compute_bound_steps"] * 2 > roof["decode_steps"] else "bandwidth",
            "roof_seconds": roof["roof_seconds"]}


class _Measured:
    """The backend a measured step rolls out from: each completion stopped at its drawn target (the loop asks for
    none), its rollout kept for the record."""

    def __init__(self, backend, targets: Sequence[int] | None) -> None:
        self.backend, self.targets, self.name = backend, targets, backend.name
        self.rollout: Any = None

    def generate(self, prompts, num_generations, sampling, *, prompt_names=None, target_lengths=None):
        self.rollout = self.backend.generate(prompts, num_generations, sampling, prompt_names=prompt_names,
                                             target_lengths=self.targets if target_lengths is None else target_lengths)
        return self.rollout


def _keep_weights(model):
    """The weights a measured step puts back, in a file: a copy in memory would sit beside the step's peak."""
    kept = WeightSnapshots(1, "disk")
    kept.append(0, model)
    return kept


def measure_step(cfg, setup, n: int, rep: int, backend, targets: Sequence[int] | None = None) -> dict[str, Any]:
    """One GRPO step of ``backend`` through cbkit's loop, split by the phases it times; the weights put back after."""
    model, measured = setup.model, _Measured(backend, targets)
    saved = _keep_weights(model)
    config = CBGRPOConfig(model=cfg.model, data=cfg.data, num_generations=n, prompts_per_step=len(setup.problems),
                          max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          top_k=cfg.top_k, seed=cfg.seed + rep, output_dir=None, disable_tqdm=True, max_steps=1,
                          forward_chunk_rows=cfg.forward_chunk_rows, dtype=cfg.dtype or "auto",
                          use_transformers_continuous_batching=backend.name == "continuous")
    trainer = GRPOTrainer(config, setup, backend=measured)
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
    rollout = measured.rollout
    tokens = sum(len(c.completion_ids) for c in rollout.completions)
    return {"status": "ok", "step_s": step_s, "rollout_s": rollout_s, "train_s": train_s,
            "old_logprob_s": old_s, "update_s": update_s, "other_s": step_s - rollout_s - old_s - update_s,
            "rollout_share": rollout_s / step_s, "completion_tokens": tokens, "tokens_per_s": tokens / step_s,
            "rollout_tokens_per_s": tokens / rollout_s if rollout_s else None, "peak_mem_bytes": mem.peak_bytes,
            "peak_mem_kind": mem.kind, **lengths_record(rollout.completions), "reward_mean": metrics.get("reward/mean"),
            "forward_chunk_rows": cfg.forward_chunk_rows, "engine_config": rollout.engine_config}
