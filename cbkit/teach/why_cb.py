"""Why CB wins, taken apart on one run: shared-prompt prefill, padding, recycling and the engine's own overhead.

A sweep says *how much* faster continuous batching (CB) is than `generate()`; it cannot say *why*. This module
measures the three ways the two backends differ, at the same N on the same length workload, back to back:

* ``generate``: `generate()`'s static batch;
* ``cb``: the CB engine as cbkit runs it, with prefix sharing (`allow_block_sharing`, the engine's default: the N
  completions of a group share the prompt's complete KV pages, so the prompt is prefilled once per group);
* ``cb_no_sharing``: the same engine with ``allow_block_sharing=False``, which prefills every copy of the prompt.

What each run did is read from the run itself, not from a formula: the tokens each forward pass processed (a forward
pre-hook on the model for `generate()`, the engine trace's scheduled batches for CB,
`cbkit.rollout.engine_trace`), how long each step took, how many rows a static batch decoded that had already
finished (padding), and which blocks a finished request handed to another (recycling).

`split_win` turns those records into the split; it is pure (records in, numbers out), so it is tested on records
where a naive reading is wrong: a win on a workload with no padding is not padding's, and a large padding share is not
a large padding cost when a decode step's time hardly depends on how many rows it holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cbkit.measure.planner import versus_parity

__all__ = ["VARIANTS", "WinSplit", "guide_check", "measure_why_cb", "noise_line", "split_lines", "split_win", "why_cb_conclusion",
           "why_cb_findings"]

# The three ways a rollout is run at one point, in the order a repeat runs them (reversed on odd repeats).
VARIANTS = ("generate", "cb", "cb_no_sharing")


# --- measuring ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _forwards(model) -> Iterator[list[tuple[float, int]]]:
    """(perf_counter at the start, input tokens) of every forward pass of ``model`` inside the block."""
    seen: list[tuple[float, int]] = []

    def pre(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append((time.perf_counter(), int(ids.numel()) if ids is not None else 0))

    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _observe_generate(rollout, forwards: Sequence[tuple[float, int]], end: float) -> dict[str, Any]:
    """What `generate()`'s static batch computed: its first forward is the prefill of every row (padded to the
    longest prompt), each later one a decode step of every row, finished or not."""
    if not forwards:
        raise RuntimeError("no forward pass was seen during generate(): is the model the one the backend runs?")
    rows = len(rollout.completions)
    starts = [t for t, _ in forwards] + [end]
    steps = len(forwards)  # tokens produced per row: the prefill forward draws the first
    real = rollout.completion_tokens
    return {"rows": rows, "prefill_tokens": forwards[0][1], "prefill_s": starts[1] - starts[0],
            "decode_steps": steps - 1, "decode_step_rows": [rows] * (steps - 1),
            "decode_step_s": [b - a for a, b in zip(starts[1:-1], starts[2:], strict=True)],
            "padded_slots": rows * steps - real, "slots": rows * steps,
            "reused_blocks": 0, "refilled_requests": 0, "max_running": rows}


def _observe_cb(rollout, trace, end: float) -> dict[str, Any]:
    """What the CB engine computed, from its own trace: prefill tokens are the query tokens of requests still in
    their prompt (a shared prefix is found in the cache and never scheduled); a step with any prefill chunk counts
    as prefill time; decode-only steps keep their row counts; recycling is the blocks a finished completion handed
    to another request. cbkit's prefill helper requests (one per shared prompt, run alone before the completions are
    queued: `cbkit.rollout.engine.Engine.run`) are the trace's requests beyond the rollout's rows, the first
    scheduled; their prefill is counted as prefill, their hand-overs are not recycling."""
    if not trace.steps:
        raise RuntimeError("the engine trace is empty: run the CB backend inside record_engine_steps().")
    first: dict[str, int] = {}
    for step in trace.steps:
        for r in step.requests:
            first.setdefault(r.request_id, step.index)
    rows = len(rollout.completions)
    helpers = set(sorted(first, key=first.__getitem__)[: max(0, len(first) - rows)])
    starts = [s.t for s in trace.steps] + [end]
    prefill_tokens, helper_tokens, prefill_s, decode_rows, decode_s = 0, 0, 0.0, [], []
    for step, (a, b) in zip(trace.steps, zip(starts, starts[1:], strict=False), strict=True):
        filling = sum(r.query_len for r in step.requests if r.phase == "prefill")
        helper_tokens += sum(r.query_len for r in step.requests if r.phase == "prefill" and r.request_id in helpers)
        prefill_tokens += filling
        if filling:
            prefill_s += b - a
        else:
            decode_rows.append(len(step.requests))
            decode_s.append(b - a)
    reuses = [r for r in trace.reuses() if r.released_by not in helpers]
    real = rollout.completion_tokens
    # Packed batches: every scheduled decode slot is a real token (cumulative_seqlens_q, no padding rows).
    return {"rows": rows, "prefill_tokens": prefill_tokens, "helper_prefill_tokens": helper_tokens,
            "prefill_s": prefill_s, "decode_steps": len(decode_rows), "decode_step_rows": decode_rows,
            "decode_step_s": decode_s, "padded_slots": 0, "slots": real, "reused_blocks": len(reuses),
            "refilled_requests": len({r.taken_by for r in reuses}),
            "max_running": max(sum(r.request_id not in helpers for r in s.requests) for s in trace.steps)}


def measure_why_cb(cfg, policy, ns: Sequence[int], workloads: Sequence[str], *, repeats: int = 1) -> list[dict[str, Any]]:
    """Run every variant (`VARIANTS`) at every N of ``ns`` on every length workload, back to back in this process
    (each backend warmed up once, the variants' order alternating between repeats), and return one record per run.

    ``cfg`` is the notebook's `cbkit.measure.sweep_config.SweepConfig` (model, data, prompts, limit, seed, the CB
    pool); its ``cb_config`` is the engine's, with ``allow_block_sharing`` forced off for ``cb_no_sharing``."""
    from cbkit.rollout.engine_trace import record_engine_steps
    from cbkit.train.setup import set_up_run

    setup = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed, dtype=cfg.dtype, policy=policy)
    base = dict(cfg.cb_config or {})
    backends = {"generate": setup.backend("generate"),
                "cb": setup.backend("continuous", cb_config={**base, "allow_block_sharing": True}),
                "cb_no_sharing": setup.backend("continuous", cb_config={**base, "allow_block_sharing": False})}
    records = []
    k = 0
    for workload in workloads:
        wl = dataclasses.replace(cfg, lengths=workload).workload
        for n in ns:
            for rep in range(repeats):
                sampling = setup.sampling(cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                          top_k=cfg.top_k, seed=cfg.seed + rep)
                targets = wl.targets(len(setup.prompts) * n, cfg.max_new_tokens, seed=sampling.seed)
                order = VARIANTS if k % 2 == 0 else tuple(reversed(VARIANTS))
                k += 1
                for variant in order:
                    kwargs = {"target_lengths": targets} if targets is not None else {}
                    if variant == "generate":
                        with _forwards(setup.model) as seen:
                            rollout = backends[variant].generate(setup.prompts, n, sampling, **kwargs)
                            end = time.perf_counter()
                        seen_by = _observe_generate(rollout, seen, end)
                    else:
                        with record_engine_steps() as trace:
                            rollout = backends[variant].generate(setup.prompts, n, sampling, **kwargs)
                            end = time.perf_counter()
                        seen_by = _observe_cb(rollout, trace, end)
                    records.append({"variant": variant, "workload": workload, "N": n, "repeat": rep,
                                    "wall_s": rollout.wall_s, "completion_tokens": rollout.completion_tokens,
                                    **seen_by})
    return records


# --- the split ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WinSplit:
    """CB's win over `generate()` at one N on one workload, in seconds (medians over repeats), by source.

    ``total_s = sharing_s + padding_s + rest_s``; a positive part is time CB saved, a negative one time it lost."""

    workload: str
    n: int
    generate_s: float
    cb_s: float
    cb_no_sharing_s: float
    total_s: float  # generate() - CB
    sharing_s: float  # CB without prefix sharing - CB with it: what prefilling the group's prompt once bought
    padding_s: float  # the part of generate()'s decode time spent on rows that had already finished
    rest_s: float  # the remainder: the engine's per-step cost against generate()'s own, everything not above
    prefill_tokens: dict[str, int]  # per variant, as each processed them
    helper_prefill_tokens: int  # of CB's: those of cbkit's prefill helper requests (the shared prompt, once)
    padding_share: float  # generate()'s decode slots that were padding (finished rows), of all its decode slots
    row_share: float | None  # share of a decode step's time that grows with its rows (fitted on CB's steps); None: no fit
    padding_cost_share: float  # padding_s over generate()'s decode time
    reused_blocks: int  # blocks a finished request handed to another (CB, from its trace)
    refilled_requests: int  # requests that took such a block
    max_running: int  # the most requests CB ran in one step
    rows: int  # completions in the rollout
    decode_step_s: dict[str, float]  # median decode step with every row running: generate, cb_no_sharing
    completion_tokens: int

    @property
    def speed(self) -> float:
        return self.generate_s / self.cb_s


def _median(records: Sequence[Mapping[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in records)


def _row_share(steps: Sequence[tuple[int, float]], rows: int) -> float | None:
    """The share of a ``rows``-row decode step's time that scales with its rows, from decode steps of different row
    counts: a least-squares line seconds = a + b * rows; b * rows / (a + b * rows), in [0, 1]. None when the steps
    hold one row count only (no slope to fit)."""
    xs = [float(r) for r, _ in steps]
    if len(set(xs)) < 2:
        return None
    ys = [s for _, s in steps]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    b = max(b, 0.0)  # noise can tilt the line below flat; a row never makes a step faster
    full = max(a, 0.0) + b * rows
    return b * rows / full if full > 0 else None


def split_win(records: Sequence[Mapping[str, Any]]) -> WinSplit:
    """CB's win over `generate()` at one (workload, N), by source, from `measure_why_cb`'s records of that point.

    * **sharing**: CB without prefix sharing minus CB with it, the same engine on the same targets: what
      prefilling each group's prompt once (instead of N times) bought;
    * **padding**: generate()'s decode time x the share of its decode slots that were finished rows x the share of
      a decode step's time that grows with its rows (fitted on CB's own decode steps of this run, whose row count
      falls as requests finish). A padded row costs only that per-row part: where a step's time is mostly reading
      the weights (small N on a CPU), even half the slots padded cost little. No padded slot: zero, whatever the win;
    * **rest**: the remainder, total - sharing - padding: the engine's per-step cost against generate()'s
      (scheduling, packing, paged KV reads against the growing cache's copies), and anything else that differs.
    """
    by = {v: [r for r in records if r["variant"] == v] for v in VARIANTS}
    missing = [v for v, rs in by.items() if not rs]
    if missing:
        raise ValueError(f"split_win needs a run of each of {', '.join(VARIANTS)}; none of {', '.join(missing)}.")
    points = {(r["workload"], r["N"]) for r in records}
    if len(points) != 1:
        raise ValueError(f"split_win takes the records of one (workload, N); got {sorted(points)}: filter them first.")
    ((workload, n),) = points
    gen, cb, solo = (_median(by[v], "wall_s") for v in VARIANTS)
    g = by["generate"]
    slots, padded = _median(g, "slots"), _median(g, "padded_slots")
    padding_share = padded / slots if slots else 0.0
    gen_decode = max(gen - _median(g, "prefill_s"), 0.0)
    steps = [(rows, s) for r in by["cb"] + by["cb_no_sharing"]
             for rows, s in zip(r["decode_step_rows"], r["decode_step_s"], strict=True)]
    rows = int(_median(g, "rows"))
    share = _row_share(steps, rows)
    # No fit (every CB step held the same rows): a padded row is priced as a full row, the most it can cost.
    padding_cost_share = padding_share * (share if share is not None else 1.0)
    padding = gen_decode * padding_cost_share if padded else 0.0
    sharing = solo - cb

    cbs = by["cb"]

    def full_step(rs: Sequence[Mapping[str, Any]]) -> float:
        full = [s for r in rs for k, s in zip(r["decode_step_rows"], r["decode_step_s"], strict=True) if k == r["rows"]]
        return statistics.median(full) if full else float("nan")

    return WinSplit(
        workload=workload, n=n, generate_s=gen, cb_s=cb, cb_no_sharing_s=solo, total_s=gen - cb, sharing_s=sharing,
        padding_s=padding, rest_s=gen - cb - sharing - padding,
        prefill_tokens={v: int(_median(by[v], "prefill_tokens")) for v in VARIANTS},
        helper_prefill_tokens=int(_median(cbs, "helper_prefill_tokens")),
        padding_share=padding_share, row_share=share,
        padding_cost_share=padding / gen_decode if gen_decode else 0.0,
        reused_blocks=int(_median(cbs, "reused_blocks")), refilled_requests=int(_median(cbs, "refilled_requests")),
        max_running=int(_median(cbs, "max_running")), rows=rows,
        decode_step_s={"generate": full_step(g), "cb_no_sharing": full_step(by["cb_no_sharing"])},
        completion_tokens=int(_median(g, "completion_tokens")))


# --- in words ----------------------------------------------------------------------------------------------------


def _part(seconds: float, total: float) -> str:
    share = f" ({seconds / total:.0%} of the saving)" if total > 0 and seconds > 0 else ""
    return f"{seconds:+.2f} s{share}"


def split_lines(s: WinSplit) -> str:
    """One point's split, each part on a line, every number and word the run's."""
    p, rows = s.prefill_tokens, s.rows
    tail = (p["cb"] - s.helper_prefill_tokens) / rows
    if s.helper_prefill_tokens:
        cb_prefill = (f"CB {p['cb']}: the prompt once ({s.helper_prefill_tokens}, cbkit's prefill request), then "
                      f"{tail:.0f} per completion (the part past the prompt's last full KV page)")
    else:
        cb_prefill = f"CB {p['cb']}: no prompt was shared"
    if not s.padding_share:
        padding = "no decode slot of generate()'s was a finished row: nothing to save"
    elif s.row_share is not None:
        padding = (f"{s.padding_share:.0%} of generate()'s decode slots were finished rows; one row is "
                   f"{s.row_share / rows:.1%} of a {rows}-row decode step's time (fitted on CB's steps, whose rows "
                   f"fall as requests finish), so the padding took {s.padding_cost_share:.0%} of generate()'s decode "
                   "time")
    else:
        padding = (f"{s.padding_share:.0%} of generate()'s decode slots were finished rows, priced as full rows "
                   f"(CB's steps all held {rows} rows: no slope to fit): {s.padding_cost_share:.0%} of its decode time")
    if s.reused_blocks:
        recycling = (f"{s.reused_blocks} blocks passed from a finished completion to {s.refilled_requests} other "
                     f"requests; at most {s.max_running} of {rows} ran at once")
    else:
        recycling = ("no block passed from a finished completion to another request: "
                     + (f"all {rows} ran at once, so none waited for a freed slot" if s.max_running >= rows
                        else f"at most {s.max_running} of {rows} ran at once"))
    return "\n".join([
        f"{s.workload}, N={s.n}: generate() {s.generate_s:.2f} s, CB {s.cb_s:.2f} s ({s.speed:.2f}x), CB without "
        f"prefix sharing {s.cb_no_sharing_s:.2f} s. CB saved {s.total_s:+.2f} s:",
        f"  (a) the group's prompt prefilled once {_part(s.sharing_s, s.total_s)}. Prefill tokens: generate() "
        f"{p['generate']} ({rows} x {p['generate'] // rows}), CB without sharing {p['cb_no_sharing']}, {cb_prefill}.",
        f"  (b) padding {_part(s.padding_s, s.total_s)}: {padding}.",
        f"  (c) recycling: {recycling}.",
        f"  the rest {_part(s.rest_s, s.total_s)}: the engine's per-step cost against generate()'s, and every other "
        "difference, noise between runs included.",
    ])


def why_cb_conclusion(splits: Sequence[WinSplit]) -> str:
    """What the splits add up to: the engine's own overhead where nothing else pays (d), and the largest part of
    CB's saving at the largest N on each workload; every word chosen by the measured numbers."""
    if not splits:
        return "Nothing measured: no split to explain."
    out = []
    fixed = sorted((s for s in splits if s.padding_share == 0), key=lambda s: s.n)
    if fixed:
        s = fixed[0]
        g, c = s.decode_step_s["generate"], s.decode_step_s["cb_no_sharing"]
        if g == g and c == c:
            word = "more" if c > g else "less"
            out.append(f"(d) The engine's own overhead, where nothing above pays ({s.workload}, N={s.n}, CB without "
                       f"sharing): a {s.rows}-row decode step took {c * 1e3:.1f} ms in CB and {g * 1e3:.1f} ms in "
                       f"generate(), {abs(c - g) / g:.0%} {word}: {c / s.rows * 1e3:.2f} against "
                       f"{g / s.rows * 1e3:.2f} ms per token.")
    top = max(s.n for s in splits)
    leads = {}
    for s in (s for s in splits if s.n == top):
        parts = {"prefilling the group's prompt once": s.sharing_s, "not decoding padding": s.padding_s,
                 "the rest": s.rest_s}
        lead = max(parts, key=lambda k: parts[k])
        leads[s.workload] = lead
        verdict = {1: "ahead", -1: "behind", 0: "level (within 5%)"}[versus_parity(s.speed)]
        out.append(f"At N={s.n} on {s.workload} CB was {verdict} at {s.speed:.2f}x; the largest part was {lead} "
                   f"({parts[lead]:+.2f} s of {s.total_s:+.2f} s).")
    if len(set(leads.values())) == 1 and len(leads) > 1:
        out.append(f"The largest part is the same with and without a length spread ({next(iter(leads.values()))}), "
                   "so on this run it is not the spread.")
    for s in (s for s in splits if s.n == top and s.padding_share > 0):
        out.append(f"On {s.workload} the spread left {s.padding_share:.0%} of generate()'s decode slots to finished "
                   f"rows, and not decoding them saved CB {s.padding_s:.2f} s of {s.total_s:+.2f} s.")
    return "\n".join(out)


def why_cb_findings(splits: Sequence[WinSplit]) -> str:
    """The splits of a run in sentences: each point's parts (`split_lines`), then `why_cb_conclusion`."""
    if not splits:
        return "Nothing measured: no split to explain."
    return "\n".join([*(split_lines(s) for s in splits), why_cb_conclusion(splits)])


def noise_line(splits: Sequence[WinSplit], by_workload: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The noise baseline of the split: the same points were timed twice, by the sweep and by the split, on the same
    machine minutes apart. How far those two timings of one rollout differ is how large a part must be to be read."""
    sweep = {(w, p["backend"], p["N"]): p.get("rollout_s") for w, pts in by_workload.items() for p in pts
             if p.get("status", "ok") == "ok"}
    gaps = []
    for s in splits:
        for backend, split_s in (("generate", s.generate_s), ("continuous", s.cb_s)):
            t = sweep.get((s.workload, backend, s.n))
            if t:
                gaps.append((abs(split_s - t) / t, backend, s.workload, s.n, t, split_s))
    if not gaps:
        return "No point of the split was also timed by the sweep: no noise baseline."
    gap, backend, workload, n, t, again = max(gaps)
    return (f"Noise baseline: the sweep and the split timed the same {len(gaps)} rollouts minutes apart; they differ "
            f"by up to {gap:.0%} ({backend}, {workload}, N={n}: {t:.2f} s, then {again:.2f} s). A part smaller than "
            "that share of its rollout's time is not told apart from noise on this machine now.")


def guide_check(by_workload: Mapping[str, Sequence[Mapping[str, Any]]], guide_n: int = 32) -> str:
    """TRL's guide (CB from N=32 when completion lengths vary) against a sweep of both workloads: from which N CB
    was faster (beyond the parity margin) on each, and whether the length spread moved that N."""
    from cbkit.teach.findings import measured_crossover

    found = {w: measured_crossover(pts, "speed_vs_generate") for w, pts in by_workload.items()}
    said = "; ".join(f"{w}: from N={n}" if n is not None else f"{w}: at no N measured" for w, n in found.items())
    head = f"TRL's guide says CB from N={guide_n} when completion lengths vary. This sweep: CB faster {said}."
    spread = [w for w in found if w != "fixed"]
    if "fixed" not in found or not spread:
        return head
    if len({found[w] for w in found}) == 1:
        return head + (" The same N with and without a length spread: here the spread did not decide where CB pays."
                       if found["fixed"] is not None else "")
    return head + (" The workloads crossed at different N; the split under *Why CB wins* says how much of the "
                   "difference is padding, and how much is the run-to-run noise in its rest.")
