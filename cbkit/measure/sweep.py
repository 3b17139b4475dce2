"""The N-sweep: both backends side by side at growing N, resumable, honest about what it measured.

One process, one model load, one warm-up per backend; for every N, `repeats` runs of each backend in an order that
alternates between repeats and Ns, so neither always runs on a warmer machine. Each run is appended to the results
JSONL at once (a rerun resumes, a different configuration is refused, an OOM is a record). Both backends get the same
length targets at a point (`workload`). Beside each number, its limit: both roofs of the machine are probed before
every N, and each run records its MFU, its share of its shape's roof and the planner's peak with its error.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cbkit.measure.presets import trainer_state_bytes
from cbkit.measure.probe import machine_probe, matmul_params, mfu
from cbkit.measure.results import ResultsFile, aggregate
from cbkit.measure.step_timing import lengths_record, measure_step, oom_record, roof_record
from cbkit.measure.sweep_config import SweepConfig


def run_sweep(cfg: SweepConfig, out: str | Path, *, on_point: Callable[[dict[str, Any]], None] | None = None,
              policy=None) -> list[dict[str, Any]]:
    """Run (or resume) the sweep; returns the aggregated points. `on_point` sees each run as it lands."""
    from cbkit.telemetry import cuda_peaks
    from cbkit.train.setup import set_up_run

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
        if probed_at != n:  # at the start, then before every N
            probe = _probe_line(results, model, cfg.workload.describe(cfg.max_new_tokens), n if probed_at else None)
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
    del held
    return aggregate(results.runs)


def _probe_line(results: ResultsFile, model, lengths: str, point: int | None) -> dict[str, Any]:
    probe = machine_probe(model)
    results.add_line({"kind": "probe", "time": time.time(), "lengths": lengths, "before_N": point, **probe})
    for name, why in probe["probe_missing"].items():
        print(f"probe: no {name} ({why}); the columns that need it stay empty", flush=True)
    return probe


def measure_run(backend, prompts, n: int, sampling, config, dtype_bytes: int,
                target_lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """One timed rollout and what it cost; an OOM becomes a record, not a crash. ``target_lengths`` (one per
    completion row) replays a length workload; None lets EOS decide."""
    from cbkit.telemetry import kv_accounting, nvml_process_bytes

    try:
        kw = {} if target_lengths is None else {"target_lengths": target_lengths}
        rollout = backend.generate(prompts, n, sampling, **kw)
    except Exception as e:
        cuda = torch.cuda.is_available()
        record = oom_record(e, torch.cuda.max_memory_allocated() if cuda else None, "cuda_allocated" if cuda else None)
        if cuda:
            torch.cuda.empty_cache()
        return {**record, "nvml_bytes": nvml_process_bytes()}
    return {"status": "ok", "rollout_s": rollout.wall_s, "completion_tokens": rollout.completion_tokens,
            "tokens_per_s": rollout.tokens_per_s, "peak_mem_bytes": rollout.peak_mem_bytes,
            "peak_mem_kind": rollout.peak_mem_kind, "nvml_bytes": nvml_process_bytes(),
            **lengths_record(rollout.completions), "engine_config": rollout.engine_config,
            **kv_accounting(rollout, config, dtype_bytes)}


def plan_record(cfg, model, prompts, n, backend, dtype_bytes, budget, run, targets=None) -> dict[str, Any]:
    """The planner's rollout peak for this point (`planner.plan`, with the attention the engine ran) and its error
    against the measured peak. With replayed targets the static batch runs to the longest one; the CB pool is sized
    from the generation limit, as the engine cannot know them. A full step's peak is not planned."""
    from cbkit.measure.planner import plan
    from cbkit.rollout.engine_config import make_cb_config
    from cbkit.rollout.varlen_attention import NAME as VARLEN

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
