"""Sentences about a run, printed from its numbers: what the notebooks say, never typed ahead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cbkit.measure.advise import PARITY_MARGIN, versus_parity
from cbkit.rollout.engine import is_helper
from cbkit.train.hooks import StepRecord

# The live helpers live in cbkit.viz.live; the notebooks import them from here.

# --- sentences printed from the run ----------------------------------------------------------------------------
# A notebook's sentence about *this* run is computed here from the measured numbers, so it cannot disagree
# with the figure above it; the markdown states the general idea and points at the printed line.


def _more_less(ratio: float, more: str, less: str, same: str = "about the same") -> str:
    """The word for a ratio to 1, by cbkit's one "about equal" rule (`cbkit.measure.advise.versus_parity`)."""
    return {1: more, -1: less, 0: f"{same}: within {PARITY_MARGIN:.0%}"}[versus_parity(ratio)]


def measured_crossover(points: Sequence[Mapping[str, Any]], key: str = "mem_vs_generate") -> int | None:
    """The smallest N from which CB's ratio to generate() (``mem_vs_generate`` or ``speed_vs_generate``) stays
    on CB's side (memory below parity, speed above it, by `versus_parity`'s margin, so a point the sentences
    call "about the same" is never a crossover) at every larger N measured; None if it never gets there."""
    ratios = sorted((p["N"], p[key]) for p in points
                    if p["backend"] == "continuous" and p.get("status", "ok") == "ok" and p.get(key) is not None)
    side = -1 if key == "mem_vs_generate" else 1
    good = [(n, versus_parity(r) == side) for n, r in ratios]
    first = None
    for n, ok in good:
        first = (first if first is not None else n) if ok else None
    return first


def sweep_findings(points: Sequence[Mapping[str, Any]]) -> str:
    """What a sweep measured, in sentences: CB vs generate() at each N, how each backend's peak memory grew
    with N, and from which N (if any) CB was ahead on memory and on speed."""
    ok = [p for p in points if p.get("status", "ok") == "ok"]
    by = {(p["backend"], p["N"]): p for p in ok}
    ns = sorted({n for b, n in by if b == "continuous" and ("generate", n) in by})
    if not ns:
        return "No N has a successful run of both backends: nothing to compare."
    lines = []
    for n in ns:
        cb = by[("continuous", n)]
        speed, mem = cb["speed_vs_generate"], cb["mem_vs_generate"]
        lines.append(f"N={n}: CB ran at {speed:.2f}x generate()'s speed ({_more_less(speed, 'faster', 'slower')}) "
                     f"and used {mem:.2f}x its peak memory ({_more_less(mem, 'more', 'less')}).")
    if len(ns) > 1:
        lo, hi = ns[0], ns[-1]
        growth = []
        for backend, name in (("generate", "generate()"), ("continuous", "CB")):
            a, b = by[(backend, lo)]["peak_mem_bytes"], by[(backend, hi)]["peak_mem_bytes"]
            if a and b:
                growth.append(f"{name}'s {a / 2**20:.0f} -> {b / 2**20:.0f} MiB ({b / a:.2f}x)")
        if growth:
            lines.append(f"From N={lo} to N={hi} the measured peak went " + " and ".join(growth) + ".")
    for key, yes, no in (("mem_vs_generate", "used less peak memory than", "did not use less peak memory than"),
                         ("speed_vs_generate", "was faster than", "was not faster than")):
        n = measured_crossover(ok, key)
        lines.append(f"CB {yes} generate() from N={n} on." if n is not None
                     else f"CB {no} generate() at the largest N measured (N={ns[-1]}).")
    return "\n".join(lines)


def runs_findings(records: Mapping[str, Sequence[StepRecord]]) -> str:
    """Two or more training runs (label -> step records), in sentences: how each run's reward moved, whether
    the runs' rewards differ, and the first run's rollout speed (completion tokens/s, so runs whose completions
    differ in length compare fairly) and memory against each other run's. A run's first step is its warm-up
    (the engine's first call builds its cache and kernels) and is left out of the speed when there are more."""
    def mean(recs: Sequence[StepRecord], key: str) -> float:
        vals = [v for r in recs if isinstance(v := r.metrics.get(key), int | float) and v == v]
        return sum(vals) / len(vals) if vals else float("nan")

    lines = []
    for label, recs in records.items():
        if not recs:
            lines.append(f"{label}: no step finished.")
            continue
        first, last = recs[0].metrics, recs[-1].metrics
        lines.append(
            f"{label}: reward/mean {first.get('reward/mean', float('nan')):.3f} at step {recs[0].step} -> "
            f"{last.get('reward/mean', float('nan')):.3f} at step {recs[-1].step}; mean loss "
            f"{mean(recs, 'train/loss'):.4f}, mean grad norm {mean(recs, 'train/grad_norm'):.3g}.")
    labels = [label for label, recs in records.items() if recs]
    if len(labels) >= 2:
        a, others = labels[0], labels[1:]
        warm = {label: list(records[label][1:]) or list(records[label]) for label in labels}
        warmed = all(len(records[label]) > 1 for label in labels)
        for b in others:
            ra, rb = mean(records[a], "reward/mean"), mean(records[b], "reward/mean")
            same = abs(ra - rb) < 1e-9
            lines.append(f"Mean reward: {a} {ra:.3f}, {b} {rb:.3f}: " + (
                "the same." if same else "they differ (the two backends drew different samples)."))
            sa, sb = mean(warm[a], "rollout/tokens_per_s"), mean(warm[b], "rollout/tokens_per_s")
            m = mean(records[a], "rollout/peak_mem_bytes") / mean(records[b], "rollout/peak_mem_bytes")
            steps = "after each run's first (warm-up) step" if warmed else "one step each, warm-up included"
            if sa == sa and sb == sb and sb > 0:
                lines.append(f"{a}'s rollouts ran at {sa / sb:.2f}x {b}'s completion tokens/s ({steps}: "
                             f"{_more_less(sa / sb, 'faster', 'slower')}) and used {m:.2f}x its peak memory "
                             f"({_more_less(m, 'more', 'less')}).")
            else:
                lines.append(f"{a}'s rollouts used {m:.2f}x {b}'s peak memory ({_more_less(m, 'more', 'less')}); "
                             "no rollout/tokens_per_s was logged to compare their speed.")
    return "\n".join(lines)


def blocks_needed(timeline: Mapping[str, Any]) -> int:
    """KV blocks a CB rollout's requests needed in all, each at its final length, a group's shared complete
    prompt pages counted once (as `cbkit.telemetry.occupancy` does). More than the pool means some blocks
    served several requests in turn."""
    page, sharing = timeline["page_size"], bool(timeline.get("prefix_sharing", False))
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for r in timeline["requests"]:
        groups.setdefault(r["group"], []).append(r)
    needed = 0
    for rs in groups.values():
        shared = min(r["prompt_len"] for r in rs) // page if sharing else 0
        needed += shared + sum(-(-(r["prompt_len"] + len(r["token_times"])) // page) - shared for r in rs)
    return needed


def timeline_findings(timeline: Mapping[str, Any], trace: Any = None,
                      occupancy: Mapping[str, Any] | None = None) -> str:
    """What one CB rollout did with its pool, in sentences: the blocks its completions needed in all against the
    pool (recycling when more), and, from the engine's own record (``trace``, an
    ``cbkit.rollout.engine_trace.EngineTrace`` of the same call), the most blocks its block tables held at once and
    who waited to be admitted or for a place in a step (`admission_findings`).

    Without a trace nothing is said about waiting: the timeline's ``start`` is the engine's ``lifespan[0]``, stamped
    when a request leaves PENDING, which a prefix-cache match does even in a step that then fails to schedule it, so
    "admitted before the first one finished" read from it can be false. ``occupancy`` (``cbkit.telemetry``'s model
    of blocks in use from those clocks) is used for the peak only when there is no trace."""
    requests = timeline["requests"]
    if not requests:
        return "The timeline has no request."
    pool = timeline.get("pool_blocks") or (occupancy or {}).get("pool_blocks") or 0
    needed = blocks_needed(timeline)
    lines = []
    if trace is not None and trace.steps:
        held = trace.blocks_in_use()
        peak = max(held)
        lines.append(f"The requests' block tables held at most {peak} blocks at once (step {held.index(peak)} of "
                     f"{len(trace.steps)}, the engine's record)" + (f", of the {pool}-block pool." if pool else "."))
    else:
        from cbkit.telemetry import occupancy as compute_occupancy

        occupancy = occupancy if occupancy is not None else compute_occupancy(dict(timeline))
        peak = max(occupancy["blocks_in_use"], default=0)
        lines.append(f"KV blocks in use, modelled from the request clocks, peaked at {peak}"
                     + (f" of a {pool}-block pool." if pool else "."))
    if pool:
        lines.append(f"The {len(requests)} completions needed {needed} blocks in all against the {pool}-block pool: "
                     + (f"at least {needed - pool} blocks were used by more than one request in turn (recycling)."
                        if needed > pool else "they fit without any block serving two requests."))
    if trace is not None:
        lines.append(admission_findings(trace))
    else:
        lines.append("Who waited, and for what, is in the engine's record: run the call inside "
                     "`record_engine_steps()` and pass its trace.")
    return "\n".join(lines)


def admission_findings(trace: Any) -> str:
    """Who waited, read from what the scheduler did (an ``EngineTrace``): completions first scheduled only after
    another had finished, completions left out of steps between their first and their last (and whether the
    engine's read budget for one step explains it), the last first token, and how many completions shared a step.
    cbkit's helper requests (the prefill of each shared prompt) are counted apart and left out of the rest."""
    lives = trace.lives()
    done = [life for life in lives.values() if not life.helper]
    helpers = len(lives) - len(done)
    if not done:
        return "The engine's record holds no completion."
    steps, total = trace.steps, len(trace.steps)
    start = min(life.first_step for life in done)
    first_end = min(done, key=lambda life: (life.last_step, life.request_id))
    extra = (f" (and {helpers} cbkit helper request{'s' if helpers > 1 else ''}: the one prefill of each shared "
             "prompt, whose pages the completions then find, left out here)") if helpers else ""
    lines = [f"The engine's record: {len(done)} completions over {total} steps{extra}."]
    later = sorted((life for life in done if life.first_step > first_end.last_step), key=lambda life: life.first_step)
    if later:
        last = later[-1]
        lines.append(f"{len(later)} of {len(done)} completions were first scheduled only after another had finished "
                     f"({first_end.request_id}, at step {first_end.last_step}): they waited to be admitted, the last "
                     f"({last.request_id}) until step {last.first_step}, "
                     f"{_secs(steps[last.first_step].t - steps[start].t)} after the first completion step.")
    else:
        lines.append(f"All {len(done)} completions were scheduled before the first one finished ({first_end.request_id}, "
                     f"at step {first_end.last_step}): none waited to be admitted.")
    stalled = [life for life in done if life.skipped]
    if stalled:
        worst, run = max(((life, _longest_run(life.skipped)) for life in stalled), key=lambda x: (len(x[1]), x[0].request_id))
        seconds = steps[min(run[-1] + 1, total - 1)].t - steps[run[0]].t
        lines.append(f"{len(stalled)} completions were left out of steps after they had started, admitted but "
                     f"waiting for a place in the batch: the longest {len(run)} steps in a row ({worst.request_id}, "
                     f"steps {run[0]}-{run[-1]}, {_secs(seconds)}).")
        budget = (trace.pool_blocks or 0) * (trace.page_size or 0)
        if budget:
            # transformers' scheduler caps the KV one varlen batch reads at the pool's size in tokens
            # (`cache.max_tokens_read`, its `cache_budget`); a request whose length no longer fits is skipped.
            length = _lengths(trace)
            pairs = [(life.request_id, i) for life in stalled for i in life.skipped]
            bound = sum(sum(r.past_len for r in steps[i].requests) + length[rid][i] > budget for rid, i in pairs)
            lead = "In every one" if bound == len(pairs) else f"In {bound}"
            lines.append(f"{lead} of those {len(pairs)} skipped steps the requests already scheduled read so much KV "
                         "that the waiting one's would have passed the engine's read budget for a step (the pool in "
                         f"tokens, {trace.pool_blocks} x {trace.page_size} = {budget})" + (
                             "." if bound == len(pairs) else "; in the others another limit held it back (free "
                             "blocks, the token budget, the scheduler's safety margin)."))
    tokens = [life for life in done if life.first_token_step is not None]
    if tokens:
        slow = max(tokens, key=lambda life: (life.first_token_step, life.request_id))
        lines.append(f"The last first token came at step {slow.first_token_step} of {total} ({slow.request_id}), "
                     f"{_secs(steps[slow.first_token_step].t - steps[start].t)} after the first completion step.")
    together = max(steps, key=lambda s: sum(not r.helper for r in s.requests))
    lines.append(f"At most {sum(not r.helper for r in together.requests)} completions shared one forward "
                 f"(step {together.index}).")
    return "\n".join(lines)


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def _longest_run(indices: Sequence[int]) -> list[int]:
    best: list[int] = []
    run: list[int] = []
    for i in indices:
        run = [*run, i] if run and i == run[-1] + 1 else [i]
        best = run if len(run) > len(best) else best
    return best


def _lengths(trace: Any) -> dict[str, dict[int, int]]:
    """request -> step -> its length (tokens in its KV) as it stood when that step was scheduled."""
    out: dict[str, dict[int, int]] = {}
    now: dict[str, int] = {}
    for step in trace.steps:
        for r in step.requests:
            now[r.request_id] = r.past_len
        for rid, n in now.items():
            out.setdefault(rid, {})[step.index] = n
        for r in step.requests:
            now[r.request_id] = r.past_len + r.query_len
    return out


def engine_trace_findings(trace: Any, step: Any = None) -> str:
    """What the engine's own record (``cbkit.rollout.engine_trace.EngineTrace``) shows, in sentences: what one
    step held (``step``, default the trace's ``mixed_step``), how many blocks passed from one request to another,
    the first such hand-over from a finished completion (cbkit's helper requests, the prefill of each shared
    prompt, counted apart), and the requests the engine offloaded and computed again."""
    if not trace.steps:
        return "The engine scheduled no step inside the recorder."
    step = step if step is not None else trace.mixed_step()
    prefill = [r for r in step.requests if r.phase == "prefill"]
    decode = [r for r in step.requests if r.phase == "decode"]

    def name(rid: str) -> str:
        return f"{rid} (cbkit's helper prefill)" if is_helper(rid) else rid

    chunks = ", ".join(f"{name(r.request_id)}: {r.query_len} tokens at positions {r.past_len}.."
                       f"{r.past_len + r.query_len - 1}" for r in prefill)
    lines = [f"Step {step.index} of {len(trace.steps)}: {len(decode)} requests brought one decode token each"
             + (f" and {len(prefill)} a prefill chunk ({chunks})" if prefill else "")
             + f": {step.tokens} tokens in one forward, packed back to back, none of them padding."]
    reuses = trace.reuses()
    pool = f" of the {trace.pool_blocks}-block pool" if trace.pool_blocks else ""
    from_done = [r for r in reuses if not is_helper(r.released_by)]
    from_helpers = len(reuses) - len(from_done)
    if reuses:
        lines.append(f"Over the rollout the engine handed {len(reuses)} times a block one request had released to "
                     f"another ({len({r.block for r in reuses})} distinct blocks{pool}): recycling, in its own "
                     "block ids" + (f"; {from_helpers} of them from cbkit's helper prefills, the rest from finished "
                                    "completions." if from_helpers else "."))
    else:
        lines.append(f"No block passed from one request to another{pool}: the pool held every request at once.")
    if from_done:
        first = min(from_done, key=lambda r: (r.first_step, r.block))
        lines.append(f"The first from a completion: block {first.block}, held by {first.released_by} until step "
                     f"{first.last_step}, taken by {name(first.taken_by)} at step {first.first_step}.")
    elif reuses:
        lines.append("No completion's block was handed on: every hand-over came from a helper prefill.")
    again = trace.restarts()
    if again:
        lines.append(f"{len(again)} requests were offloaded when the pool ran out and computed again from position "
                     f"0 later ({sum(again.values())} tokens computed twice): the cost of a starved pool.")
    return "\n".join(lines)


def trl_step_findings(logs: Mapping[str, Any]) -> str:
    """What one logged TRL GRPO step says, in a sentence: when no group's rewards had any spread, every advantage
    was 0, and so were the loss and the gradient (with beta = 0): the step ran, and changed nothing."""
    zero_std, reward = logs.get("frac_reward_zero_std"), logs.get("reward")
    loss, grad = logs.get("loss", float("nan")), logs.get("grad_norm", float("nan"))
    if zero_std is None:
        return f"TRL's step logged loss {loss:.4g} and grad norm {grad:.3g}."
    if zero_std >= 1.0:
        same = "0" if reward == 0 else "equal"
        return (f"TRL's step: every group's rewards were {same} (frac_reward_zero_std = 1), so every advantage was 0, "
                f"and with it the loss ({loss:.4g}) and the gradient norm ({grad:.3g}): the step ran end to end and "
                "changed nothing. One step of a few prompts on a small model often draws no reward difference; "
                "the runs above show the loop learning over many steps.")
    return (f"TRL's step: {zero_std:.0%} of its groups had no reward spread; the others' advantages gave loss "
            f"{loss:.4g} and grad norm {grad:.3g}.")


def step_split_findings(points: Sequence[Mapping[str, Any]]) -> str:
    """A full-step sweep (`cbkit sweep --full-step`) in sentences, per N: how much of generate()'s step the rollout
    was, the most any rollout speed-up could buy (1 / the rest's share), CB's step speed-up against the Amdahl
    ceiling its rollout's speed-up predicts, and, with an async row, what its overlap bought against what the
    step gained (they differ by what running decode beside training cost the training)."""
    ok = [p for p in points if p.get("status", "ok") == "ok" and p.get("step_s") is not None]
    by = {(p["backend"], p["N"]): p for p in ok}
    ns = sorted({n for b, n in by if b == "continuous" and ("generate", n) in by})
    if not ns:
        return "No N has a full step of both generate() and CB: nothing to compare."
    lines = []
    for n in ns:
        g, c = by[("generate", n)], by[("continuous", n)]
        share = g["rollout_share"]
        bound = f"{1 / (1 - share):.2f}x" if share < 1 else "unbounded"
        lines.append(f"N={n}: the rollout was {share:.0%} of generate()'s {g['step_s']:.2f} s step, so even a rollout "
                     f"taking no time would make the step at most {bound} faster.")
        if c.get("amdahl_ceiling") is not None and c.get("step_speedup") is not None:
            ceiling, speed = c["amdahl_ceiling"], c["step_speedup"]
            verdict = {0: "at its ceiling (within 5%)",
                       1: "above its ceiling: the phases outside the rollout also ran faster in CB's step",
                       -1: "below its ceiling: CB's step paid for something outside its rollout"}[
                versus_parity(speed / ceiling)]
            lines.append(f"  CB's rollout ran {c['rollout_speedup']:.2f}x as fast as generate()'s, which predicts a "
                         f"step {ceiling:.2f}x as fast; the step went {speed:.2f}x, {verdict}.")
        a = by.get(("continuous-async", n))
        if a is not None and a.get("overlap_s") is not None:
            trained = (a["old_logprob_s"] + a["update_s"]) - (c["old_logprob_s"] + c["update_s"])
            gained = c["step_s"] - a["step_s"]
            line = (f"  Async CB (steady state, {a.get('steady_steps') or '?'} steps): its trainer waited "
                    f"{a['rollout_s']:.2f} s a step for a rollout against CB's {c['rollout_s']:.2f} s, so the overlap "
                    f"bought {a['overlap_s']:.2f} s; its step took {a['step_s']:.2f} s against CB's "
                    f"{c['step_s']:.2f} s ({_more_less(a['step_vs_sync'], 'faster', 'slower')}).")
            if trained > 0 and versus_parity(a["step_vs_sync"]) < 1:
                line += (f" Its old-logprob forward and update took {trained:.2f} s longer than CB's: the decode "
                         "running beside them took that from the same device.")
            elif gained > a["overlap_s"]:
                line += (f" The step gained {gained:.2f} s, more than the {a['overlap_s']:.2f} s the overlap hid: its "
                         "other phases ran faster than CB's too.")
            elif gained > 0:
                line += f" The step gained {gained:.2f} s of the {a['overlap_s']:.2f} s the overlap hid."
            lines.append(line)
    return "\n".join(lines)


def gpu_estimate_findings(points: Sequence[Mapping[str, Any]], estimated: Sequence[Mapping[str, Any]]) -> str:
    """What changes on a GPU, from the estimate rows (`cbkit.measure.tables.estimated_steps`) beside the measured
    full steps: the rollout's share of generate()'s step at the largest N here and on each GPU, and the most a
    rollout speed-up can buy there (1 / the rest's share). Said as an estimate."""
    measured = {p["N"]: p for p in points if p["backend"] == "generate" and p.get("status", "ok") == "ok"
                and p.get("rollout_share") is not None}
    if not measured or not estimated:
        return "No measured generate() step or no estimate: nothing to set side by side."
    n = max(measured)
    here = measured[n]["rollout_share"]
    there = [r for r in estimated if r["N"] == n and r["backend"] in ("generate", "generate = CB")]
    if not there:
        return f"The estimate has no row at N={n}."

    def bound(share: float) -> str:
        return f"{1 / (1 - share):.2f}x" if share < 1 else "unbounded"

    def moved(share: float) -> str:  # percentage points: a share 5 points either side is about where it was
        return ("larger than here" if share > here + 0.05 else "smaller than here" if share < here - 0.05
                else "about as here")

    gpus = "; ".join(f"{r['rollout_share']:.0%} on the {r['name']} ({moved(r['rollout_share'])}: at most "
                     f"{bound(r['rollout_share'])})" for r in there)
    tied = [r["name"] for r in there if r["tied"]]
    lines = [f"At N={n} the rollout was {here:.0%} of generate()'s step here (a rollout speed-up can buy at most "
             f"{bound(here)}); the estimate puts it at {gpus}. Where the share is larger, a faster rollout buys more "
             "of the step. An estimate from the roofline's assumptions, not a measurement."]
    if tied:
        lines.append(f"On the {' and the '.join(tied)} the estimate gives generate() and CB the same rollout for this "
                     "shape: each decode step is bound by the launch floor, not by the rows it carries (the note "
                     "under the table).")
    return "\n".join(lines)


def _points(recs: Sequence[StepRecord], key: str) -> list[tuple[int, float]]:
    """The finite values of `key`, step by step (NaN and non-numbers left out)."""
    values = [(r.step, r.metrics.get(key)) for r in recs]
    return [(step, float(v)) for step, v in values if isinstance(v, int | float) and v == v]


def reward_slope(recs: Sequence[StepRecord], key: str = "reward/mean") -> float:
    """The least-squares slope of ``key`` against the step (per step); nan under two points."""
    points = _points(recs, key)
    if len(points) < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(v for _, v in points) / len(points)
    return sum((x - mx) * (v - my) for x, v in points) / sum((x - mx) ** 2 for x, _ in points)


def reward_trend(records: Mapping[str, Sequence[StepRecord]], key: str = "reward/mean") -> str:
    """Whether each run's ``key`` moved over its steps, in sentences: the mean of its first third of steps against
    its last third's, and the least-squares slope a step (`reward_slope`). A run's first and last step alone are
    one sample each, and a step's reward swings with its prompts; a third of the run and the slope average that
    out. "rose" or "fell" only where the thirds and the slope agree; otherwise no trend is claimed."""
    lines = []
    for label, recs in records.items():
        points = _points(recs, key)
        if len(points) < 3:
            lines.append(f"{label}: {len(points)} step(s) of {key}, too few for a trend.")
            continue
        k = max(1, len(points) // 3)
        head, tail = points[:k], points[-k:]
        first, last = (sum(v for _, v in part) / k for part in (head, tail))
        slope = reward_slope(recs, key)
        verdict = ("it rose" if last > first and slope > 0 else "it fell" if last < first and slope < 0 else
                   "no trend: the thirds and the slope disagree")
        lines.append(f"{label}: {key} {first:.3f} over steps {head[0][0]}-{head[-1][0]} -> {last:.3f} over steps "
                     f"{tail[0][0]}-{tail[-1][0]}, a least-squares slope of {slope:+.4f} a step: {verdict}.")
    return "\n".join(lines)
