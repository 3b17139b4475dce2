"""What a sweep's run line says beside its measurement: the roofline of its shape on the probed machine (the share
of the attainable tokens/s it reached), and the planner's peak for the same point (a rollout's, or a whole step's),
term by term, with its error against the measured peak.
"""

from __future__ import annotations

from typing import Any, Literal


def roof_record(config, prompts, measured: dict[str, Any], probe: dict[str, Any], dtype_bytes: int) -> dict[str, Any]:
    """A run's roofline fields: the attainable tokens/s of its shape (its prompts, its completions' lengths) on
    the probed machine, the share of it the run reached, and which roof bound most decode steps. Without both
    peaks the fields are None and ``roof_missing`` says which probe failed and why."""
    from cbkit.measure.roofline import rollout_roofline

    empty = {"roof_tokens_per_s": None, "roof_share": None, "roof_bound": None, "bytes_per_s": probe.get("bytes_per_s")}
    missing = {k: v for k, v in (probe.get("probe_missing") or {}).items()}
    for key in ("peak_flops", "bytes_per_s"):
        if not probe.get(key) and key not in missing:
            missing[key] = "not probed"
    if missing:
        return {**empty, "roof_missing": "; ".join(f"{k}: {v}" for k, v in sorted(missing.items()))}
    roof = rollout_roofline(config, prompt_lens=[len(p) for p in prompts],
                            completion_lengths=measured["completion_lengths"], dtype_bytes=dtype_bytes,
                            peak_flops=probe["peak_flops"], bytes_per_s=probe["bytes_per_s"])
    attainable = roof["attainable_tokens_per_s"]
    share = measured["tokens_per_s"] / attainable if attainable and measured.get("tokens_per_s") else None
    bound = "compute" if roof["compute_bound_steps"] * 2 > roof["decode_steps"] else "bandwidth"
    return {**empty, "roof_tokens_per_s": attainable, "roof_share": share, "roof_bound": bound,
            "roof_seconds": roof["roof_seconds"], "roof_compute_bound_steps": roof["compute_bound_steps"],
            "roof_decode_steps": roof["decode_steps"], "peak_flops_spread": probe.get("peak_flops_spread"),
            "bytes_per_s_spread": probe.get("bytes_per_s_spread")}


def plan_record(cfg, model, prompts, n, backend, dtype_bytes, budget, run, targets=None) -> dict[str, Any]:
    """The planner's prediction for this point, and its error against what was measured. With replayed
    targets the static batch runs to the longest one; the continuous backend's pool is sized from the
    generation limit as always (it cannot know the lengths in advance), which the planner does by itself."""
    from cbkit.measure.planner import plan
    from cbkit.rollout.varlen_attention import NAME as VARLEN

    impl = str((run.get("engine_config") or {}).get("attn_implementation", "sdpa"))
    device: Literal["cuda", "cpu"] = "cuda" if model.device.type == "cuda" else "cpu"
    cb_config = dict(cfg.cb_config)
    if targets and device == "cpu" and "num_blocks" not in cb_config:
        from cbkit.rollout.engine_config import make_cb_config

        rows = [x for x in prompts for _ in range(n)]
        resolved = make_cb_config(cb_config, device=model.device, rows=rows, max_new_tokens=cfg.max_new_tokens,
                                  warn=False)
        cb_config["num_blocks"] = resolved.num_blocks
    p = plan(model.config, num_prompts=len(prompts), num_generations=n, prompt_len=[len(x) for x in prompts],
             max_new_tokens=max(targets) if targets else cfg.max_new_tokens, dtype_bytes=dtype_bytes,
             budget_bytes=budget, cb_config=cb_config, device=device,
             attn_implementation="varlen" if impl == VARLEN else "flash" if "flash" in impl else "sdpa")
    planned = p.generate.peak_bytes if backend == "generate" else p.continuous.peak_bytes
    measured = run.get("peak_mem_bytes")
    error = measured / planned - 1 if measured and planned else None
    return {"planned_peak_bytes": planned, "plan_error": error, **plan_terms(p, backend)}


def plan_terms(p, backend: str) -> dict[str, int | None]:
    """The planned peak's terms for one backend, flat, so `cbkit report` can print each beside the measurement: the
    cache (generate()'s KV at the end, the CB engine's pool tensor), the transients at the peak, the engine's buffers
    and, on a CPU, the heap slack glibc keeps beside generate()'s growing cache (`fitted.CPU_HEAP_SLACK`)."""
    if backend == "generate":
        g = p.generate
        decode_peak = g.kv_bytes + g.cpu_heap_slack_bytes + g.decode_transient_bytes >= g.prefill_bytes
        return {"plan_cache_bytes": g.kv_bytes if decode_peak else 0,
                "plan_transient_bytes": g.decode_transient_bytes if decode_peak else g.prefill_bytes,
                "plan_buffer_bytes": 0, "plan_heap_slack_bytes": g.cpu_heap_slack_bytes if decode_peak else 0}
    c = p.continuous
    return {"plan_cache_bytes": c.cache_tensor_bytes, "plan_transient_bytes": c.transient_bytes,
            "plan_buffer_bytes": c.buffer_bytes, "plan_heap_slack_bytes": 0}


def step_plan_record(cfg, model, prompts, n, run, planned, targets=None, *, overlapped: bool = False) -> dict[str, Any]:
    """The planner's peak for a whole GRPO step (`planner.step_peak_bytes`: the rollout's planned peak, one
    chunk's backward beside the gradients, the optimizer step; the sweep's trainer is fresh, so AdamW's moments
    appear at the update), the phase that sets it, and its error against the step's measured peak.

    The async row's phases overlap (``overlapped``) instead of following each other: its later steps hold AdamW's moments
    throughout and the next rollout's KV beside the training's own peak, so the peak is their sum (phase
    ``overlapped``). The engine's copy of the weights is made with the trainer, before the step's baseline; the
    copy `AsyncRollouts.after_step` keeps for a checkpoint is not made here (the sweep's trainer has no output_dir)."""
    from cbkit.measure.planner import step_peak_bytes

    rows = len(prompts) * n
    longest = max(targets) if targets and cfg.workload.kind != "natural" else cfg.max_new_tokens
    params = sum(p.numel() for p in model.parameters())
    later = {}
    if targets and cfg.workload.kind != "natural" and cfg.forward_chunk_rows and rows > cfg.forward_chunk_rows:
        # the trainer's chunks take the rows longest first: past the first chunk, none is wider than these
        by_length = sorted(((len(prompts[i // n]) + t, t) for i, t in enumerate(targets)), reverse=True)
        rest = by_length[cfg.forward_chunk_rows:]
        later = {"later_tokens_per_row": rest[0][0], "later_completion_len": max(t for _, t in rest)}
    step = step_peak_bytes(params, rollout_peak_bytes=planned["planned_peak_bytes"],
                           micro_batch_rows=rows, chunk_rows=cfg.forward_chunk_rows,
                           tokens_per_row=max(map(len, prompts)) + longest, completion_len=longest,
                           config=model.config, autocast=False, optimizer_state_resident=overlapped,
                           device="cuda" if model.device.type == "cuda" else "cpu", **later)
    phase = max(("rollout", "backward", "optimizer_step"), key=step.__getitem__)
    peak = step["peak"]
    if overlapped:
        peak = planned["planned_peak_bytes"] + max(step["backward"], step["optimizer_step"])
        phase = "overlapped"
    measured = run.get("peak_mem_bytes")
    return {"planned_peak_bytes": peak, "planned_rollout_peak_bytes": planned["planned_peak_bytes"],
            "planned_phase": phase, "plan_error": measured / peak - 1 if measured and peak else None}


def step_roof_record(model, rollout, measured: dict[str, Any], probe: dict[str, Any], config) -> dict[str, Any]:
    """Each phase of a full step against its roof on the probed machine: the rollout's (`roof_record`: the decode
    steps of its shape), the old-logprob forward's and the update's (`roofline.training_roofline`: the FLOPs of
    every real token, the weights read once a chunk, AdamW's pass). A share is roof seconds over measured seconds.
    Without both peaks every share is None and ``roof_missing`` says why."""
    from cbkit.measure.roofline import training_roofline

    comps, n = rollout.completions, rollout.num_generations
    prompts = [comps[g * n].prompt_ids for g in range(len(comps) // n)]  # completions come in group order
    dtype_bytes = model.dtype.itemsize
    roll = roof_record(model.config, prompts, {"completion_lengths": measured["completion_lengths"],
                                               "tokens_per_s": measured["rollout_tokens_per_s"]}, probe, dtype_bytes)
    out = {"rollout_roof_s": roll.get("roof_seconds"), "rollout_roof_share": roll["roof_share"],
           "rollout_roof_bound": roll["roof_bound"], "bytes_per_s": probe.get("bytes_per_s"),
           "old_logprob_roof_s": None, "old_logprob_roof_share": None, "update_roof_s": None,
           "update_roof_share": None}
    if "roof_missing" in roll:
        return {**out, "roof_missing": roll["roof_missing"]}
    micro = len(comps) // config.gradient_accumulation_steps
    chunk = micro if config.forward_chunk_rows is None else min(config.forward_chunk_rows, micro)
    forwards = config.gradient_accumulation_steps * -(-micro // chunk)
    roofs = training_roofline(model.config, rows=[(len(c.prompt_ids), len(c.completion_ids)) for c in comps],
                              forwards=forwards, params=sum(p.numel() for p in model.parameters()),
                              dtype_bytes=dtype_bytes, peak_flops=probe["peak_flops"],
                              bytes_per_s=probe["bytes_per_s"], num_iterations=config.num_iterations)
    old_s, update_s = measured["old_logprob_s"], measured["update_s"]
    return {**out, "old_logprob_roof_s": roofs["old_logprob_roof_s"], "update_roof_s": roofs["update_roof_s"],
            "old_logprob_roof_share": roofs["old_logprob_roof_s"] / old_s if old_s else None,
            "update_roof_share": roofs["update_roof_s"] / update_s if update_s else None}
