"""The N-sweep: both backends side by side at growing N, resumable, honest about what it measured.

The claim under test (A100-80GB, Llama-3.2-1B-Instruct, GSM8K): CB is at parity with `generate()` at N=8,
~1.25x faster at N=32 and N=64, and at N=64 uses *less* memory, because `generate()` holds KV for every
row at the padded length while CB fills a fixed pool and recycles blocks as sequences finish.

How a sweep runs, and why:
* one process, one model load; one warm-up call per backend before anything is timed;
* for every N, `repeats` runs of every backend, the backend order alternating between repeats (and
  between Ns) so neither backend always runs on a warmer machine; the point is the median of its runs;
* each finished run is appended to the results JSONL at once; a rerun reads the file and skips what is
  there, so Ctrl-C or a crash loses at most the run in flight. The file's first line records the
  configuration, and a rerun with a different one is refused rather than mixed into the same table;
* a run that runs out of memory is recorded as `oom` with the memory figures it reached, and the sweep
  goes on to the next point;
* speed and memory are reported as ratios to `generate()` at the same N, measured in the same process;
* the length workload (`cbkit.measure.workload`; default ``replay:gsm8k``) decides how long each completion runs.
  Both backends get the same targets at a point, and every run line records the workload, the
  per-completion lengths, their mean / CV / max and the share of a static batch's decode slots those
  lengths leave as padding: the spread CB has to win back, printed next to the speed it won;
* the limit beside the number: a probe of both roofs of this machine (matmul FLOP/s at the model's dtype and width,
  read bandwidth) runs at the sweep's start and again before every N, so a noisy machine shows as the spread of
  the probes; each run records the probe next to it, its model FLOP utilisation (MFU) and its share of the
  attainable tokens/s of its own shape (`measure/roofline.py`: FLOPs and bytes of every decode step, the lower
  roof binding). A probe that cannot run leaves those columns empty and the run line says why: no roof is made up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cbkit.measure.plan_records import plan_record, roof_record, step_plan_record
from cbkit.measure.probe import machine_probe, matmul_params, mfu
from cbkit.measure.results import ResultsFile, aggregate
from cbkit.measure.rollout_timing import measure_run, trainer_state_bytes
from cbkit.measure.step_timing import measure_async_steps, measure_full_step
from cbkit.measure.sweep_config import ASYNC_BACKEND, SweepConfig


def run_sweep(
    cfg: SweepConfig,
    out: str | Path,
    *,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    policy=None,
) -> list[dict[str, Any]]:
    """Run (or resume) the sweep; returns the aggregated points. `on_point` sees each run as it lands."""
    from cbkit.telemetry import cuda_peaks
    from cbkit.train.setup import set_up_run

    results = ResultsFile(out, cfg.fingerprint())
    todo = [(n, rep, b) for n_i, n in enumerate(cfg.ns) for rep in range(cfg.repeats)
            for b in _order(cfg.backends, n_i + rep) if not results.done(b, n, rep)]
    if not todo:
        return aggregate(results.runs)

    # A full step trains the weights it rolls out from, and the loop trains fp32 weights (cfg.dtype is its autocast).
    setup = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed,
                       dtype="float32" if cfg.full_step else cfg.dtype, policy=policy)
    model, prompts = setup.model, setup.prompts
    sampling = setup.sampling(cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              seed=cfg.seed)
    dtype_bytes = model.dtype.itemsize
    workload = cfg.workload
    # The limit beside the number: probed at the start and again before every N (a shared machine's roofs move),
    # each probe recorded as its own line; a run carries the probe taken next to it.
    probe = _probe_line(results, model, workload.describe(cfg.max_new_tokens), point=None)
    params = matmul_params(model)
    # Each backend is warmed up with one short call: first calls pay one-off costs, not what we compare.
    backends = {b: setup.backend(b, cb_config=cfg.cb_config) for b in cfg.backends if b != ASYNC_BACKEND}

    # A trainer's state, held for the whole sweep where asked (`trainer_state`): allocated before the free memory is
    # read, so the engine's share and the planner's budget are of what it leaves. torch.empty on a CPU commits no
    # pages: there it is a placeholder of the right size.
    held = (torch.empty(trainer_state_bytes(model), dtype=torch.uint8, device=model.device)
            if cfg.trainer_state else None)
    budget = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else None  # free after the weights
    probed_at = None
    for n, rep, b in tqdm(todo, desc="sweep runs"):
        if probed_at is not None and probed_at != n:
            probe = _probe_line(results, model, workload.describe(cfg.max_new_tokens), point=n)
        probed_at = n
        run_sampling = dataclasses.replace(sampling, seed=cfg.seed + rep)
        # Drawn from (seed, rows) only: both backends at this point get the same targets.
        targets = workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=run_sampling.seed)
        if b == ASYNC_BACKEND:
            measured = measure_async_steps(cfg, setup, n, rep, targets, probe)
        elif cfg.full_step:
            measured = measure_full_step(cfg, setup, backends[b], n, rep, targets, probe)
        else:
            measured = measure_run(backends[b], prompts, n, run_sampling, model.config, dtype_bytes, targets)
        run = {"backend": b, "N": n, "repeat": rep, "num_prompts": len(prompts), "time": time.time(),
               "lengths": cfg.lengths, **measured, **cuda_peaks(model.device)}
        if measured["status"] == "ok":
            seconds = measured.get("rollout_s")
            run.update(matmul_params=params, peak_flops=probe["peak_flops"],
                       mfu=mfu(params, measured["completion_tokens"], seconds, probe["peak_flops"])
                       if not cfg.full_step and probe["peak_flops"] else None)
            if not cfg.full_step:
                run.update(roof_record(model.config, prompts, measured, probe, dtype_bytes))
        planned = plan_record(cfg, model, prompts, n, b, dtype_bytes, budget, run, targets)
        run.update(step_plan_record(cfg, model, prompts, n, run, planned, targets, overlapped=b == ASYNC_BACKEND)
                   if cfg.full_step else planned)
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


def _order(backends: Sequence[str], k: int) -> list[str]:
    return list(backends) if k % 2 == 0 else list(reversed(backends))

