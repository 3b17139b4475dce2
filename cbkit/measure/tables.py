"""A sweep's points as text tables and CSV, for the terminal and the README. An empty cell is a number not measured
(a roof that could not be probed, a column an older file lacks), never a zero."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cbkit.measure.presets import TRL_PR_5765
from cbkit.measure.results import Results, read_results
from cbkit.measure.workload import parse_lengths


def _f(v, fmt: str, unit: str = "", empty: str = "—") -> str:
    return format(v, fmt) + unit if v is not None else empty


def trl_benchmark_table(points: list[dict[str, Any]], backend: str = "continuous") -> str:
    """TRL's benchmark table (PR #5765's format): N | speed vs generate | memory behaviour, for one backend against
    generate(), and the length spread of the point (generate()'s runs: the static batch is the one that pads)."""
    rows = ["| N | speed vs generate | memory behaviour | lengths: mean, CV, max; static batch padding |",
            "| --- | --- | --- | --- |"]
    gen = {p["N"]: p for p in points if p["backend"] == "generate"}
    for p in (p for p in points if p["backend"] == backend):
        s = gen.get(p["N"]) or p
        spread = "—" if s.get("length_mean") is None else (
            f"{_f(s.get('length_mean'), '.1f')}, {_f(s.get('length_cv'), '.2f')}, {_f(s.get('length_max'), '.0f')}; "
            f"{_f(s.get('decode_padding_share'), '.0%')} of decode slots")
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['status'].upper()} | — | {spread} |")
            continue
        mem = p["mem_vs_generate"]
        word = "n/a" if mem is None else "less than" if mem < 0.95 else "more than" if mem > 1.05 else "about the same as"
        behaviour = "n/a" if mem is None else f"{word} generate ({mem:.2f}x peak)"
        rows.append(f"| {p['N']} | {_f(p['speed_vs_generate'], '.2f', 'x', 'n/a')} | {behaviour} | {spread} |")
    return "\n".join(rows)


def points_table(points: list[dict[str, Any]]) -> str:
    """Every point: speed, memory, the length spread it ran (idle = share of a static batch's decode slots those
    lengths leave to rows already past their end), its MFU against the probed matmul peak, the attainable tokens/s of
    its shape on the probed machine (c = compute-bound, b = bandwidth-bound), its share of it, the plan's error."""
    head = (f"{'N':>4} {'backend':<17} {'status':<6} {'tok/s':>8} {'rollout s':>9} {'peak MiB':>9} {'KV MiB':>8} "
            f"{'len':>6} {'CV':>5} {'max':>4} {'idle':>5} {'speed x':>7} {'mem x':>6} {'MFU':>6} {'roof':>7} "
            f"{'of roof':>7} {'plan err':>8}")
    lines = [head, "-" * len(head)]
    for p in points:
        mib = {k: p.get(k) and p[k] / 2**20 for k in ("peak_mem_bytes", "kv_bytes")}
        roof = "-" if p.get("roof_tokens_per_s") is None else \
            f"{p['roof_tokens_per_s']:.0f} {(p.get('roof_bound') or '?')[0]}"
        cells = [(p["tokens_per_s"], "8.1f"), (p["rollout_s"], "9.1f"), (mib["peak_mem_bytes"], "9.0f"),
                 (mib["kv_bytes"], "8.1f"), (p.get("length_mean"), "6.1f"), (p.get("length_cv"), "5.2f"),
                 (p.get("length_max"), "4.0f"), (p.get("decode_padding_share"), "5.2f"),
                 (p["speed_vs_generate"], "7.2f"), (p["mem_vs_generate"], "6.2f"), (p.get("mfu"), "6.1%")]
        widths = [8, 9, 9, 8, 6, 5, 4, 5, 7, 6, 6]
        lines.append(f"{p['N']:>4} {p['backend']:<17} {p['status']:<6} "
                     + " ".join(f"{_f(v, fmt, empty='-'):>{w}}" for (v, fmt), w in zip(cells, widths, strict=True))
                     + f" {roof:>7} {_f(p.get('roof_share'), '7.1%', empty='-'):>7} "
                     f"{_f(p.get('plan_error'), '+8.0%', empty='-'):>8}")
    return "\n".join(lines)


def step_split_table(points: list[dict[str, Any]]) -> str:
    """A full GRPO step per backend and N (`cbkit sweep --full-step`): the rollout, the old-logprob forward, the update
    and the rest, each phase's seconds with its share of its roof; the rollout's share of the step; the step's
    speed-up over generate(); the Amdahl ceiling (`results.amdahl_ceiling`) and the share of it reached. The async
    rows follow, beside synchronous CB."""
    rows = ["| N | backend | step s | rollout s (of roof) | old-logprob fwd s (of roof) | update s (of roof) | other s "
            "| rollout share | step speed-up | Amdahl ceiling | of ceiling |", "|" + " --- |" * 11]

    def phase(p, key):
        return f"{_f(p.get(key + '_s'), '.2f')} ({_f(p.get(key + '_roof_share'), '.0%')})"

    for p in sorted(points, key=lambda p: (p["N"], p["backend"] != "generate", p["backend"])):
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['backend']} | {p['status'].upper()} |" + " — |" * 8)
            continue
        rows.append(f"| {p['N']} | {p['backend']} | {_f(p.get('step_s'), '.2f')} | {phase(p, 'rollout')} | "
                    f"{phase(p, 'old_logprob')} | {phase(p, 'update')} | {_f(p.get('other_s'), '.2f')} | "
                    f"{_f(p.get('rollout_share'), '.0%')} | {_f(p.get('step_speedup'), '.2f', 'x')} | "
                    f"{_f(p.get('amdahl_ceiling'), '.2f', 'x')} | {_f(p.get('of_ceiling'), '.0%')} |")
    overlapped = [p for p in sorted(points, key=lambda p: p["N"]) if p["backend"] == "continuous-async"]
    if not overlapped:
        return "\n".join(rows)
    rows += ["", "continuous-async = CB with async rollouts: step t+1's rollout decodes while step t trains. step s = "
             "the mean of its steps after the first; rollout wait = what the trainer still waited for a rollout; "
             "overlap bought = synchronous CB's rollout s minus that wait",
             "| N | steady steps | step s | rollout wait s | rollout wall s | CB rollout s | overlap bought s | "
             "step vs CB | step vs generate |", "|" + " --- |" * 9]
    cb = {p["N"]: p for p in points if p["backend"] == "continuous" and p["status"] == "ok"}
    for p in overlapped:
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['status'].upper()} |" + " — |" * 7)
            continue
        rows.append(f"| {p['N']} | {_f(p.get('steady_steps'), '.0f')} | {_f(p.get('step_s'), '.2f')} | "
                    f"{_f(p.get('rollout_s'), '.2f')} | {_f(p.get('rollout_wall_s'), '.2f')} | "
                    f"{_f(cb.get(p['N'], {}).get('rollout_s'), '.2f')} | {_f(p.get('overlap_s'), '.2f')} | "
                    f"{_f(p.get('step_vs_sync'), '.2f', 'x')} | {_f(p.get('step_speedup'), '.2f', 'x')} |")
    return "\n".join(rows)


def results_summary(results: Results | str | Path) -> str:
    """What a results file ran: its length workload and the roofs its probes read (the range they moved in, the
    spread of a probe's rounds, any probe that could not run and why)."""
    results = results if isinstance(results, Results) else read_results(results)
    fp = results.fingerprint
    try:
        out = [parse_lengths(fp.get("lengths") or "natural").describe(fp.get("max_new_tokens", 0))]
    except ValueError:  # a replayed file that has moved since: the spec is still what ran
        out = [f"lengths: {fp['lengths']}"]
    probes = results.probes
    for key, unit, what in (("peak_flops", "GFLOP/s", "matmul probe"),
                            ("bytes_per_s", "GB/s", "read bandwidth (sum over a 256 MiB tensor)")):
        vals = [p[key] / 1e9 for p in probes if p.get(key)]
        spreads = [p[f"{key}_spread"] for p in probes if p.get(f"{key}_spread") is not None]
        failed = [p["probe_missing"][key] for p in probes if key in (p.get("probe_missing") or {})]
        if vals:
            out.append(f"{what}: {len(vals)} probe(s), {min(vals):.2f}-{max(vals):.2f} {unit}"
                       + (f", spread within a probe up to {max(spreads):.0%}" if spreads else ""))
        if failed:
            out.append(f"{what}: missing in {len(failed)} probe(s): {'; '.join(sorted(set(failed)))} -- its "
                       "columns stay empty")
    if probes:
        out.append("MFU = 2 x matmul params x completion tokens / rollout seconds / the matmul peak; roof = attainable "
                   "tokens/s of each run's shape on the probe next to it (cbkit/measure/roofline.py)")
    return "\n".join(out)


def write_csv(points: list[dict[str, Any]], path: str | Path) -> None:
    """Every point, every column `results.aggregate` made."""
    import csv

    keys = list(dict.fromkeys(k for p in points for k in p))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(points)


def trl_comparison_table(points: list[dict[str, Any]]) -> str:
    """This run's seconds and memory next to TRL PR #5765's, per N. Memory deltas are CB minus generate() in GB (1e9
    bytes, as the PR's table) for three counters: the allocator's peak allocated above the weights, its peak reserved
    and the device's used memory after the call (what nvidia-smi shows). The PR does not say which its VRAM column
    is; reserved is the closest."""
    by = {(p["backend"], p["N"]): p for p in points}
    rows = ["| N | TRL generate s | TRL CB s | TRL CB speed-up | TRL CB VRAM delta GB | generate s | CB s | "
            "CB speed-up | CB delta allocated / reserved / device GB |", "|" + " --- |" * 9]
    for n in sorted({p["N"] for p in points} | set(TRL_PR_5765)):
        trl = TRL_PR_5765.get(n)
        trl_cells = f"{trl[0]:.2f} | {trl[1]:.2f} | {trl[0] / trl[1]:.2f}x | {trl[2]:+.2f}" if trl else "— | — | — | —"
        g, c = by.get(("generate", n)), by.get(("continuous", n))
        if g is None or c is None:
            rows.append(f"| {n} | {trl_cells} | not run | not run | — | — |")
            continue
        secs = [q["status"].upper() if q["status"] != "ok" else _f(q.get("rollout_s"), ".2f") for q in (g, c)]
        ok = g["status"] == c["status"] == "ok" and g["rollout_s"] and c["rollout_s"]
        deltas = " / ".join("—" if g.get(k) is None or c.get(k) is None else f"{(c[k] - g[k]) / 1e9:+.2f}"
                            for k in ("peak_mem_bytes", "peak_reserved_bytes", "device_used_bytes"))
        speed = f"{g['rollout_s'] / c['rollout_s']:.2f}x" if ok else "—"
        rows.append(f"| {n} | {trl_cells} | {secs[0]} | {secs[1]} | {speed} | {deltas} |")
    return "\n".join(rows)


def memory_table(points: list[dict[str, Any]]) -> str:
    """The planner's prediction beside every memory counter measured, per point, in GiB."""
    rows = ["| N | backend | planned peak | allocated peak | plan error | reserved peak | device used | "
            "NVML process |", "|" + " --- |" * 8]
    for p in points:
        gib = [_f(p.get(k) and p[k] / 2**30, ".2f") for k in ("planned_peak_bytes", "peak_mem_bytes",
                                                              "peak_reserved_bytes", "device_used_bytes", "nvml_bytes")]
        rows.append(f"| {p['N']} | {p['backend']} | {gib[0]} | {gib[1]} | {_f(p.get('plan_error'), '+.0%')} | "
                    f"{gib[2]} | {gib[3]} | {gib[4]} |")
    return "\n".join(rows)


# The GPUs of `cbkit tiers` and their dtypes there: the rollout in fp16 on a T4 (no bf16) and bf16 on an A100; the
# training forwards in fp32 on a T4 and under bf16 autocast on an A100.
ESTIMATE_GPUS = {"t4": ("float16", "float32"), "a100-40": ("bfloat16", "bfloat16")}


def estimated_steps(config: Any, *, prompt_lens: list[int], lengths_by_n: dict[int, list[int]]) -> list[dict[str, Any]]:
    """The full step's phases on a T4 and an A100 per N and backend, **estimated** from the roofline's assumptions
    (`roofline.estimated_step_split`), never measured. Where every decode step of the shape is under the launch floor
    the two backends' estimates are equal, and one row (backend ``generate = CB``, ``tied``) stands for both: two
    identical rows would read as a measured parity. ``speedup``: generate()'s step over this one."""
    import math

    from cbkit.measure.roofline import GPUS, estimated_step_split

    out = []
    for gpu, (rollout_dtype, train_dtype) in ESTIMATE_GPUS.items():
        for n, lengths in sorted(lengths_by_n.items()):
            split = estimated_step_split(config, prompt_lens=prompt_lens, targets=lengths, machine=GPUS[gpu],
                                         rollout_dtype=rollout_dtype, train_dtype=train_dtype, dtype_bytes=2)
            reference = sum(split["generate"].values())
            tied = math.isclose(split["generate"]["rollout_s"], split["continuous"]["rollout_s"], rel_tol=1e-6)
            for b, v in ({"generate = CB": split["generate"]} if tied else split).items():
                step = sum(v.values())
                out.append({"gpu": gpu, "name": GPUS[gpu].name, "rollout_dtype": rollout_dtype, "N": n,
                            "rows": len(lengths), "backend": b, "tied": tied, **v, "step_s": step,
                            "rollout_share": v["rollout_s"] / step, "speedup": reference / step})
    return out


def estimated_step_table(config: Any, *, prompt_lens: list[int], lengths_by_n: dict[int, list[int]]) -> str:
    """`estimated_steps` as a table; where the floor ties the backends, a line under it names the GPUs and the rows a
    static batch's step would need to leave the floor (`roofline.rows_off_the_floor`)."""
    import statistics

    from cbkit.measure.roofline import GPUS, rows_off_the_floor, step_floor_seconds

    rows = ["| GPU (estimate, not measured) | N | backend | step s | rollout s | old-logprob fwd s | update s | "
            "rollout share | step speed-up (= Amdahl ceiling) |", "|" + " --- |" * 9]
    estimated = estimated_steps(config, prompt_lens=prompt_lens, lengths_by_n=lengths_by_n)
    tied: dict[str, tuple[int, str]] = {}  # GPU -> (the most rows a tied step ran, its rollout dtype)
    for r in estimated:
        rows.append(f"| {r['name']} ({r['rollout_dtype']} rollout) | {r['N']} | {r['backend']} | {r['step_s']:.2f} | "
                    f"{r['rollout_s']:.2f} | {r['old_logprob_s']:.2f} | {r['update_s']:.2f} | "
                    f"{r['rollout_share']:.0%} | {r['speedup']:.2f}x |")
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
    return "\n".join(rows) + (
        f"\ngenerate = CB on the {' and the '.join(GPUS[g].name for g in tied)}. There every decode step of this "
        f"shape is under the launch floor ({step_floor_seconds(config) * 1e3:.1f} ms a step), so padded rows cost no "
        f"time in the estimate; a static batch's step leaves the floor at {'; at '.join(where)}.")
