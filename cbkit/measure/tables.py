"""Text tables and CSV of a sweep's points, for the terminal and the README."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cbkit.measure.presets import TRL_PR_5765
from cbkit.measure.results import Results, read_results
from cbkit.measure.workload import parse_lengths


def trl_benchmark_table(points: list[dict[str, Any]], backend: str = "continuous") -> str:
    """TRL's benchmark table (PR #5765's format): N | speed vs generate | memory behaviour, for one backend against generate(), and the
    length spread of the point (generate()'s runs: the static batch is the one that pads)."""
    rows = ["| N | speed vs generate | memory behaviour | lengths: mean, CV, max; static batch padding |",
            "| --- | --- | --- | --- |"]
    gen = {p["N"]: p for p in points if p["backend"] == "generate"}
    for p in (p for p in points if p["backend"] == backend):
        spread = _spread_cell(gen.get(p["N"]) or p)
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['status'].upper()} | — | {spread} |")
            continue
        speed = f"{p['speed_vs_generate']:.2f}x" if p["speed_vs_generate"] is not None else "n/a"
        mem = p["mem_vs_generate"]
        if mem is None:
            behaviour = "n/a"
        else:
            word = "less than" if mem < 0.95 else "more than" if mem > 1.05 else "about the same as"
            behaviour = f"{word} generate ({mem:.2f}x peak)"
        rows.append(f"| {p['N']} | {speed} | {behaviour} | {spread} |")
    return "\n".join(rows)


def roof_table(points: list[dict[str, Any]]) -> str:
    """Every backend at every N against the roofline of its shape: speed vs generate(), MFU, the attainable tokens/s
    on the probed machine (and which roof binds), and the share of it reached. An empty cell is a roof that
    could not be probed (the results summary says why), never a zero."""
    rows = ["| N | backend | tok/s | speed vs generate | MFU | roof tok/s (bound) | share of roof |",
            "| --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "—"

    for p in sorted(points, key=lambda p: (p["N"], p["backend"])):
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['backend']} | {p['status'].upper()} | — | — | — | — |")
            continue
        roof = (f"{p['roof_tokens_per_s']:.0f} ({p.get('roof_bound') or '?'})"
                if p.get("roof_tokens_per_s") is not None else "—")
        speed = f(p.get("speed_vs_generate"), ".2f") + ("x" if p.get("speed_vs_generate") is not None else "")
        rows.append(f"| {p['N']} | {p['backend']} | {f(p.get('tokens_per_s'), '.1f')} | {speed} | "
                    f"{f(p.get('mfu'), '.1%')} | {roof} | {f(p.get('roof_share'), '.1%')} |")
    return "\n".join(rows)


def _spread_cell(p: dict[str, Any]) -> str:
    """Mean, CV, max; padding share: each a dash where the run did not record it (a full-step run from before
    full steps recorded their lengths has a mean only)."""
    if p.get("length_mean") is None:
        return "—"

    def f(key: str, fmt: str) -> str:
        return format(p[key], fmt) if p.get(key) is not None else "—"

    return (f"{f('length_mean', '.1f')}, {f('length_cv', '.2f')}, {f('length_max', '.0f')}; "
            f"{f('decode_padding_share', '.0%')} of decode slots")


def step_split_table(points: list[dict[str, Any]]) -> str:
    """A full GRPO step per backend and N (`cbkit sweep --full-step`), split into the rollout, the old-logprob
    forward, the update and the rest, each phase's seconds with its share of its roof (the probe of the same run);
    the rollout's share of the step; the step's speed-up over generate(); and the Amdahl ceiling, the speed-up the
    rollout's speed-up alone predicts (`results.amdahl_ceiling`), with the share of it reached."""
    rows = ["| N | backend | step s | rollout s (of roof) | old-logprob fwd s (of roof) | update s (of roof) | other s "
            "| rollout share | step speed-up | Amdahl ceiling | of ceiling |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "—"

    def phase(p, key):
        return f"{f(p.get(key + '_s'), '.2f')} ({f(p.get(key + '_roof_share'), '.0%')})"

    for p in sorted(points, key=lambda p: (p["N"], p["backend"] != "generate", p["backend"])):
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['backend']} | {p['status'].upper()} |" + " — |" * 8)
            continue
        speed = f(p.get("step_speedup"), ".2f") + ("x" if p.get("step_speedup") is not None else "")
        ceiling = f(p.get("amdahl_ceiling"), ".2f") + ("x" if p.get("amdahl_ceiling") is not None else "")
        rows.append(f"| {p['N']} | {p['backend']} | {f(p.get('step_s'), '.2f')} | {phase(p, 'rollout')} | "
                    f"{phase(p, 'old_logprob')} | {phase(p, 'update')} | {f(p.get('other_s'), '.2f')} | "
                    f"{f(p.get('rollout_share'), '.0%')} | {speed} | {ceiling} | {f(p.get('of_ceiling'), '.0%')} |")
    table = "\n".join(rows)
    overlapped = async_overlap_table(points)
    return table if overlapped is None else f"{table}\n\n{overlapped}"


def async_overlap_table(points: list[dict[str, Any]]) -> str | None:
    """The async rows of a full-step sweep (`continuous-async`) beside synchronous CB: the steady-state step (the
    mean of the steps after the first), what the trainer still waited for its rollout, the rollout's own wall
    clock (run beside the training), and the overlap bought (`results.aggregate`). None without async rows."""
    rows = [p for p in sorted(points, key=lambda p: p["N"]) if p.get("rollout_wall_s") is not None or (
        p["backend"] == "continuous-async" and p["status"] != "ok")]
    if not rows:
        return None

    def f(v, fmt, unit=""):
        return format(v, fmt) + unit if v is not None else "—"

    out = ["continuous-async = CB with async rollouts: step t+1's rollout decodes while step t trains. step s = the "
           "mean of its steady-state steps (every step after the first); rollout wait = what the trainer still "
           "waited for a rollout (its rollout s above); overlap bought = synchronous CB's rollout s minus that wait",
           "| N | steady steps | step s | rollout wait s | rollout wall s | CB rollout s | overlap bought s | "
           "step vs CB | step vs generate |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    cb = {p["N"]: p for p in points if p["backend"] == "continuous" and p["status"] == "ok"}
    for p in rows:
        if p["status"] != "ok":
            out.append(f"| {p['N']} | {p['status'].upper()} |" + " — |" * 7)
            continue
        out.append(f"| {p['N']} | {f(p.get('steady_steps'), '.0f')} | {f(p.get('step_s'), '.2f')} | "
                   f"{f(p.get('rollout_s'), '.2f')} | {f(p.get('rollout_wall_s'), '.2f')} | "
                   f"{f(cb.get(p['N'], {}).get('rollout_s'), '.2f')} | {f(p.get('overlap_s'), '.2f')} | "
                   f"{f(p.get('step_vs_sync'), '.2f', 'x')} | {f(p.get('step_speedup'), '.2f', 'x')} |")
    return "\n".join(out)


def points_table(points: list[dict[str, Any]]) -> str:
    """Every point: speed, memory, the length spread it ran (mean, CV, max; idle = share of a static batch's
    decode slots those lengths leave to rows already past their end, named apart from the padding share of all KV
    slots that notebook 01's section 1 prints), its MFU against the sweep's matmul probe, and its share of the
    roofline of its shape (roof = attainable tok/s on the probed machine; bound: c = compute, b = bandwidth)."""
    head = f"{'N':>4} {'backend':<17} {'status':<6} {'tok/s':>8} {'rollout s':>9} {'peak MiB':>9} " \
           f"{'KV MiB':>8} {'len':>6} {'CV':>5} {'max':>4} {'idle':>5} {'speed x':>7} {'mem x':>6} {'MFU':>6} " \
           f"{'roof':>7} {'of roof':>7} {'plan err':>8}"
    lines = [head, "-" * len(head)]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    for p in points:
        lines.append(
            f"{p['N']:>4} {p['backend']:<17} {p['status']:<6} {f(p['tokens_per_s'], '8.1f'):>8} "
            f"{f(p['rollout_s'], '9.1f'):>9} {f(p['peak_mem_bytes'] and p['peak_mem_bytes'] / 2**20, '9.0f'):>9} "
            f"{f(p['kv_bytes'] and p['kv_bytes'] / 2**20, '8.1f'):>8} {f(p.get('length_mean'), '6.1f'):>6} "
            f"{f(p.get('length_cv'), '5.2f'):>5} {f(p.get('length_max'), '4.0f'):>4} "
            f"{f(p.get('decode_padding_share'), '5.2f'):>5} "
            f"{f(p['speed_vs_generate'], '7.2f'):>7} {f(p['mem_vs_generate'], '6.2f'):>6} "
            f"{f(p.get('mfu'), '6.1%'):>6} {_roof_cell(p):>7} {f(p.get('roof_share'), '7.1%'):>7} "
            f"{f(p.get('plan_error'), '+8.0%'):>8}"
        )
    return "\n".join(lines)


def _roof_cell(p: dict[str, Any]) -> str:
    if p.get("roof_tokens_per_s") is None:
        return "-"
    return f"{p['roof_tokens_per_s']:.0f} {(p.get('roof_bound') or '?')[0]}"


def results_summary(results: Results | str | Path) -> str:
    """What a results file ran: its length workload (and how lengths were made) and its latest matmul probe,
    for the lines printed above the tables."""
    results = results if isinstance(results, Results) else read_results(results)
    fp = results.fingerprint
    spec = fp.get("lengths")
    if spec is None:
        out = ["lengths: natural (a results file from before length workloads were recorded)"]
    else:
        try:
            out = [parse_lengths(spec).describe(fp.get("max_new_tokens", 0))]
        except ValueError:  # a replayed file that has moved since: the spec is still what ran
            out = [f"lengths: {spec}"]
    probes = results.probes
    probe = next((x for x in reversed(probes) if x.get("peak_flops")), probes[-1] if probes else None)
    if probe is not None and probe.get("peak_flops"):
        hidden, inter = probe["probe_shape"]
        out.append(f"matmul probe: {probe['peak_flops'] / 1e9:.1f} GFLOP/s ({probe['probe_device']}, "
                   f"{probe['probe_dtype']}, [rows x {hidden}] @ [{hidden} x {inter}], best of rows "
                   f"{', '.join(probe['probe_flops_by_rows'])}); MFU = 2 x matmul params x completion tokens / "
                   "rollout seconds / this peak")
    out.extend(_probe_lines(probes))
    return "\n".join(out)


def _probe_lines(probes: list[dict[str, Any]]) -> list[str]:
    """Both roofs over every probe of the file (one at the start, one before each N): the range they moved in,
    the rounds' spread inside a probe, and any probe that could not run, with its reason."""
    out = []
    for key, unit, scale, what in (("peak_flops", "GFLOP/s", 1e9, "matmul"),
                                   ("bytes_per_s", "GB/s", 1e9, "read bandwidth (sum over a 256 MiB tensor)")):
        vals = [p[key] for p in probes if p.get(key)]
        spreads = [p[f"{key}_spread"] for p in probes if p.get(f"{key}_spread") is not None]
        failed = [p["probe_missing"][key] for p in probes if key in (p.get("probe_missing") or {})]
        missing = sorted(set(failed))
        if vals:
            line = (f"{what}: {len(vals)} probe(s), {min(vals) / scale:.2f}-{max(vals) / scale:.2f} {unit}"
                    + (f", spread within a probe up to {max(spreads):.0%}" if spreads else ""))
            out.append(line)
        if missing:
            out.append(f"{what}: missing in {len(failed)} probe(s): {'; '.join(missing)} -- its columns stay empty")
        if not vals and not missing and probes:
            out.append(f"{what}: not probed in this file (a sweep from before that probe) -- its columns stay empty")
    if probes:
        out.append("roof = attainable completion tokens/s of each run's shape on the probe next to it "
                   "(cbkit/measure/roofline.py); of roof = the run's tokens/s over it")
    return out


def write_csv(points: list[dict[str, Any]], path: str | Path) -> None:
    import csv

    keys = ["N", "backend", "status", "repeats", "tokens_per_s", "rollout_s", "peak_mem_bytes", "peak_mem_kind",
            "kv_bytes", "kv_padding_share", "completion_tokens", "speed_vs_generate",
            "mem_vs_generate", "planned_peak_bytes", "plan_error", "lengths", "length_mean", "length_cv",
            "length_max", "decode_padding_share", "mfu", "peak_flops", "peak_reserved_bytes", "device_used_bytes",
            "nvml_bytes", "bytes_per_s", "roof_tokens_per_s", "roof_share", "roof_bound", "roof_missing",
            "step_s", "old_logprob_s", "update_s", "other_s", "rollout_share", "rollout_roof_share",
            "old_logprob_roof_share", "update_roof_share", "step_speedup", "rollout_speedup", "amdahl_ceiling",
            "of_ceiling", "planned_phase", "rollout_wait_s", "publish_wait_s", "rollout_wall_s", "steady_steps",
            "first_step_s", "overlap_s", "step_vs_sync"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(points)


def trl_comparison_table(points: list[dict[str, Any]]) -> str:
    """This run's seconds and memory next to TRL PR #5765's, per N: TRL's claim and what was measured here.

    Memory deltas are CB minus generate() at the same N, in GB (1e9 bytes, as the PR's table), for three
    counters: the allocator's peak allocated above the weights, its peak reserved (what PyTorch held from the
    driver) and the device's used memory after the call (cudaMemGetInfo: every process and the CUDA context,
    what nvidia-smi shows). The PR does not say which counter its VRAM column is; reserved is the closest.
    """
    by = {(p["backend"], p["N"]): p for p in points}
    head = ("| N | TRL generate s | TRL CB s | TRL CB speed-up | TRL CB VRAM delta GB | generate s | CB s | "
            "CB speed-up | CB delta allocated / reserved / device GB |")
    rows = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ns = sorted({p["N"] for p in points} | set(TRL_PR_5765))
    for n in ns:
        trl = TRL_PR_5765.get(n)
        trl_cells = (f"{trl[0]:.2f} | {trl[1]:.2f} | {trl[0] / trl[1]:.2f}x | {trl[2]:+.2f}" if trl
                     else "— | — | — | —")
        g, c = by.get(("generate", n)), by.get(("continuous", n))
        if g is None or c is None:
            rows.append(f"| {n} | {trl_cells} | not run | not run | — | — |")
            continue
        gs, cs = _seconds_cell(g), _seconds_cell(c)
        ok = g["status"] == "ok" and c["status"] == "ok"
        speed = f"{g['rollout_s'] / c['rollout_s']:.2f}x" if ok and g["rollout_s"] and c["rollout_s"] else "—"
        deltas = " / ".join(_delta_gb(g.get(k), c.get(k)) for k in ("peak_mem_bytes", "peak_reserved_bytes",
                                                                     "device_used_bytes"))
        rows.append(f"| {n} | {trl_cells} | {gs} | {cs} | {speed} | {deltas} |")
    return "\n".join(rows)


def memory_table(points: list[dict[str, Any]]) -> str:
    """The planner's prediction beside every memory counter measured, per point, in GiB."""
    rows = ["| N | backend | planned peak | allocated peak | plan error | reserved peak | device used | "
            "NVML process |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def gib(v) -> str:
        return f"{v / 2**30:.2f}" if v is not None else "—"

    for p in points:
        err = f"{p['plan_error']:+.0%}" if p.get("plan_error") is not None else "—"
        rows.append(f"| {p['N']} | {p['backend']} | {gib(p.get('planned_peak_bytes'))} | "
                    f"{gib(p.get('peak_mem_bytes'))} | {err} | {gib(p.get('peak_reserved_bytes'))} | "
                    f"{gib(p.get('device_used_bytes'))} | {gib(p.get('nvml_bytes'))} |")
    return "\n".join(rows)


def plan_terms_table(points: list[dict[str, Any]]) -> str | None:
    """The planner's peak term by term beside the measured peak, per point, in MiB: which term is off when the plan
    misses. None when no point carries the terms (a file written before they were recorded, or a full step)."""
    if not any(p.get("plan_cache_bytes") is not None for p in points):
        return None
    rows = ["| N | backend | measured peak | planned peak | plan error | cache (KV / pool) | transients | buffers | "
            "CPU heap slack | measured - planned |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def mib(v) -> str:
        return f"{v / 2**20:.0f}" if v is not None else "—"

    for p in points:
        if p["status"] != "ok" or p.get("plan_cache_bytes") is None:
            continue
        measured, planned = p.get("peak_mem_bytes"), p.get("planned_peak_bytes")
        err = f"{p['plan_error']:+.0%}" if p.get("plan_error") is not None else "—"
        rest = mib(measured - planned) if measured is not None and planned is not None else "—"
        rows.append(f"| {p['N']} | {p['backend']} | {mib(measured)} | {mib(planned)} | {err} | "
                    f"{mib(p['plan_cache_bytes'])} | {mib(p.get('plan_transient_bytes'))} | "
                    f"{mib(p.get('plan_buffer_bytes'))} | {mib(p.get('plan_heap_slack_bytes'))} | {rest} |")
    return "\n".join(rows)


def _seconds_cell(p: dict[str, Any]) -> str:
    if p["status"] != "ok":
        return p["status"].upper()
    return f"{p['rollout_s']:.2f}" if p.get("rollout_s") is not None else "—"


def _delta_gb(generate: float | None, continuous: float | None) -> str:
    if generate is None or continuous is None:
        return "—"
    return f"{(continuous - generate) / 1e9:+.2f}"


# The GPUs of `cbkit tiers` and their dtypes there: the rollout in fp16 on a T4 (no bf16) and bf16 on an A100; the
# training forwards in fp32 on a T4 and under bf16 autocast on an A100.
ESTIMATE_GPUS = {"t4": ("float16", "float32"), "a100-40": ("bfloat16", "bfloat16")}


def estimated_steps(config: Any, *, prompt_lens: list[int], lengths_by_n: dict[int, list[int]]) -> list[dict[str, Any]]:
    """The rows of `estimated_step_table` as data: per GPU of ``ESTIMATE_GPUS`` and N, one row per backend, or one
    row (backend ``generate = CB``, ``tied``) where the estimate gives both the same rollout. Each row: ``gpu``
    (its name), ``rollout_dtype``, ``N``, ``rows`` (completions in the step), ``backend``, the phases' seconds,
    ``step_s``, ``rollout_share`` and ``speedup`` (generate()'s step over this one)."""
    import math

    from cbkit.measure.roofline import GPUS, estimated_step_split

    out = []
    for gpu, (rollout_dtype, train_dtype) in ESTIMATE_GPUS.items():
        for n, lengths in sorted(lengths_by_n.items()):
            split = estimated_step_split(config, prompt_lens=prompt_lens, targets=lengths, machine=GPUS[gpu],
                                         rollout_dtype=rollout_dtype, train_dtype=train_dtype, dtype_bytes=2)
            reference = sum(split["generate"].values())
            tied = math.isclose(split["generate"]["rollout_s"], split["continuous"]["rollout_s"], rel_tol=1e-6)
            if tied:
                split = {"generate = CB": split["generate"]}
            for b, v in split.items():
                step = sum(v.values())
                out.append({"gpu": gpu, "name": GPUS[gpu].name, "rollout_dtype": rollout_dtype, "N": n,
                            "rows": len(lengths), "backend": b, "tied": tied, **v, "step_s": step,
                            "rollout_share": v["rollout_s"] / step, "speedup": reference / step})
    return out


def estimated_step_table(config: Any, *, prompt_lens: list[int], lengths_by_n: dict[int, list[int]]) -> str:
    """The full step's split on a T4 and an A100, **estimated** from the roofline's assumptions
    (`roofline.estimated_step_split`: DECODE_EFFICIENCY, TRAIN_EFFICIENCY, the per-step launch floor), never
    measured: where the rollout's share, and so what a faster rollout can buy, moves on a GPU. ``lengths_by_n``:
    the completion lengths each N ran with (a sweep's own). In an estimate only the rollout differs between the
    backends, so the step's speed-up is its Amdahl ceiling.

    The static batch decodes every row until the longest target ends and the CB pool only the rows still running,
    but a decode step costs at least the launch floor: while every step of the shape is under it, padded rows cost
    nothing and the two estimates are equal. Then one row stands for both backends (``generate = CB``) and a
    sentence under the table says why, with the rows a static batch's step would need to leave the floor on each
    GPU (`roofline.rows_off_the_floor`): two identical rows would read as a measured parity. Where the estimates
    differ, each backend has its row. What the estimate leaves out is whatever differs between the two
    implementations per step (kernels, scheduling): TRL's A100 benchmark (`presets.TRL_PR_5765`) measures it."""
    import statistics

    from cbkit.measure.roofline import GPUS, Shape, rows_off_the_floor, step_floor_seconds

    rows = ["| GPU (estimate, not measured) | N | backend | step s | rollout s | old-logprob fwd s | update s | "
            "rollout share | step speed-up (= Amdahl ceiling) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    estimated = estimated_steps(config, prompt_lens=prompt_lens, lengths_by_n=lengths_by_n)
    for r in estimated:
        rows.append(f"| {r['name']} ({r['rollout_dtype']} rollout) | {r['N']} | {r['backend']} | {r['step_s']:.2f} | "
                    f"{r['rollout_s']:.2f} | {r['old_logprob_s']:.2f} | {r['update_s']:.2f} | "
                    f"{r['rollout_share']:.0%} | {r['speedup']:.2f}x |")
    tied: dict[str, tuple[int, str]] = {}  # GPU -> (the most rows a tied step ran, its rollout dtype)
    for r in estimated:
        if r["tied"]:
            tied[r["gpu"]] = (max(r["rows"], tied.get(r["gpu"], (0, ""))[0]), r["rollout_dtype"])
    if not tied:
        return "\n".join(rows)
    context = round(statistics.mean(prompt_lens)) + max(max(v) for v in lengths_by_n.values()) // 2
    where = []
    for gpu, (most, dtype) in tied.items():
        off = rows_off_the_floor(config, context=context, dtype_bytes=2, machine=GPUS[gpu], dtype=dtype)
        where.append(f"{'more than a million' if off is None else f'about {off:,}'} rows on the {GPUS[gpu].name} "
                     f"(the largest step here: {most} rows)")
    floor = step_floor_seconds(config)
    note = (f"generate = CB: one estimate for both backends on the {' and the '.join(GPUS[g].name for g in tied)}. "
            f"There every decode step of this shape is under the launch floor of an eager forward ({floor * 1e3:.1f} "
            f"ms a step for {Shape.of(config).layers} layers), so the static batch's padded rows cost no time and both "
            "backends take the longest completion's steps: from these assumptions the estimate cannot separate "
            "generate() from CB, and what a GPU measures between them is per-step overhead the estimate does not "
            f"model. A static batch's decode step of this context leaves the floor at {'; at '.join(where)}.")
    return "\n".join(rows) + "\n" + note
