"""The N-sweep: both backends side by side at growing N, resumable, honest about what it measured.

The claim under test (TRL PR #5765, A100-80GB, Llama-3.2-1B-Instruct, GSM8K): CB is at parity with `generate()` at
N=8, ~1.25x faster at N=32 and N=64, and at N=64 uses *less* memory, because `generate()` holds KV for every row at
the padded length while CB fills a fixed pool and recycles blocks as sequences finish. How a sweep runs, and why:

* one process, one model load, one warm-up call per backend; for every N, `repeats` runs of every backend, the order
  alternating between repeats and Ns so neither always runs on a warmer machine; a point is the median of its runs;
* each run is appended to the results JSONL at once; a rerun skips what is there (a crash loses the run in flight),
  and a rerun with a different configuration is refused; an OOM is recorded as such and the sweep goes on;
* speed and memory are ratios to `generate()` at the same N, in the same process; both backends get the same length
  targets at a point (`cbkit.measure.workload`), and each run records its lengths' spread beside the speed it won;
* the limit beside the number: both roofs of this machine (matmul FLOP/s, read bandwidth) are probed at the start and
  before every N; each run records its MFU, its share of the attainable tokens/s of its shape (`roofline`) and the
  planner's peak for it with its error. A probe that cannot run leaves those columns empty and says why.
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
from cbkit.measure.step_timing import is_oom, lengths_record, measure_steps, roof_record
from cbkit.measure.sweep_config import ASYNC_BACKEND, SweepConfig


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
    described = cfg.workload.describe(cfg.max_new_tokens)
    probe = _probe_line(results, model, described, point=None)
    backends = {b: setup.backend(b, cb_config=cfg.cb_config) for b in cfg.backends if b != ASYNC_BACKEND}
    # A trainer's state, held where asked (`trainer_state`), allocated before the free memory is read, so the
    # engine's share and the planner's budget are of what it leaves (on a CPU torch.empty commits no pages).
    held = (torch.empty(trainer_state_bytes(model), dtype=torch.uint8, device=model.device)
            if cfg.trainer_state else None)
    budget = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else None  # free after the weights
    probed_at = None
    for n, rep, b in tqdm(todo, desc="sweep runs"):
        if probed_at is not None and probed_at != n:
            probe = _probe_line(results, model, described, point=n)
        probed_at = n
        run_sampling = dataclasses.replace(sampling, seed=cfg.seed + rep)
        # Drawn from (seed, rows) only: both backends at this point get the same targets.
        targets = cfg.workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=run_sampling.seed)
        if cfg.full_step:
            measured = measure_steps(cfg, setup, n, rep, targets, probe, backend=backends.get(b))
        else:
            measured = measure_run(backends[b], prompts, n, run_sampling, model.config, dtype_bytes, targets)
        run = {"backend": b, "N": n, "repeat": rep, "num_prompts": len(prompts), "time": time.time(),
               "lengths": cfg.lengths, **measured, **cuda_peaks(model.device)}
        if measured["status"] == "ok":
            run.update(matmul_params=params, peak_flops=probe["peak_flops"],
                       mfu=mfu(params, measured["completion_tokens"], measured.get("rollout_s"), probe["peak_flops"])
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


def measure_run(backend, prompts, n: int, sampling, config, dtype_bytes: int,
                target_lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """One timed rollout and what it cost; an OOM becomes a record, not a crash. ``target_lengths`` (one per
    completion row) replays a length workload; None lets EOS decide."""
    from cbkit.telemetry import kv_accounting

    try:
        kw = {} if target_lengths is None else {"target_lengths": target_lengths}
        rollout = backend.generate(prompts, n, sampling, **kw)
    except Exception as e:
        if not is_oom(e):
            raise
        cuda = torch.cuda.is_available()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        if cuda:
            torch.cuda.empty_cache()
        return {"status": "oom", "error": str(e).splitlines()[0][:300], "peak_mem_bytes": peak,
                "peak_mem_kind": "cuda_allocated" if cuda else None}
    return {"status": "ok", "rollout_s": rollout.wall_s, "completion_tokens": rollout.completion_tokens,
            "tokens_per_s": rollout.tokens_per_s, "peak_mem_bytes": rollout.peak_mem_bytes,
            "peak_mem_kind": rollout.peak_mem_kind,
            **lengths_record(rollout.completions), "engine_config": rollout.engine_config,
            **kv_accounting(rollout, config, dtype_bytes)}


def plan_record(cfg, model, prompts, n, backend, dtype_bytes, budget, run, targets=None) -> dict[str, Any]:
    """The planner's peak for this point (`planner.plan`, with the attention the engine ran) and its error against the
    measured peak. With replayed targets the static batch runs to the longest one; the CB pool is sized from the
    generation limit, as the engine cannot know the lengths in advance."""
    from cbkit.measure.planner import plan
    from cbkit.rollout.engine_config import make_cb_config
    from cbkit.rollout.varlen_attention import NAME as VARLEN

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


def step_plan_record(cfg, model, prompts, n, run, planned, targets=None, *, overlapped: bool = False) -> dict[str, Any]:
    """The planner's peak for a whole GRPO step (`planner.step_peak_bytes`; the sweep's trainer is fresh, so AdamW's
    moments appear at the update), the phase that sets it, and its error. The async row's phases overlap: its later
    steps hold AdamW's moments and the next rollout's KV beside the training's own peak, so the peak is their sum."""
    from cbkit.measure.planner import step_peak_bytes

    rows = len(prompts) * n
    replayed = bool(targets) and cfg.workload.kind != "natural"
    longest = max(targets) if replayed else cfg.max_new_tokens
    later = {}
    if replayed and cfg.forward_chunk_rows and rows > cfg.forward_chunk_rows:
        # the trainer's chunks take the rows longest first: past the first chunk, none is wider than these
        rest = sorted(((len(prompts[i // n]) + t, t) for i, t in enumerate(targets)), reverse=True)
        rest = rest[cfg.forward_chunk_rows:]
        later = {"later_tokens_per_row": rest[0][0], "later_completion_len": max(t for _, t in rest)}
    step = step_peak_bytes(sum(p.numel() for p in model.parameters()), rollout_peak_bytes=planned["planned_peak_bytes"],
                           micro_batch_rows=rows, chunk_rows=cfg.forward_chunk_rows,
                           tokens_per_row=max(map(len, prompts)) + longest, completion_len=longest,
                           config=model.config, autocast=False, optimizer_state_resident=overlapped,
                           device="cuda" if model.device.type == "cuda" else "cpu", **later)
    phase = max(("rollout", "backward", "optimizer_step"), key=step.__getitem__)
    peak = step["peak"]
    if overlapped:
        peak, phase = planned["planned_peak_bytes"] + max(step["backward"], step["optimizer_step"]), "overlapped"
    measured = run.get("peak_mem_bytes")
    return {"planned_peak_bytes": peak, "planned_rollout_peak_bytes": planned["planned_peak_bytes"],
            "planned_phase": phase, "plan_error": measured / peak - 1 if measured and peak else None}
