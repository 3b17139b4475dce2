"""Sentences about a run, printed from its numbers: what the notebooks say, never typed ahead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cbkit.measure.planner import PARITY_MARGIN, versus_parity
from cbkit.rollout.engine import is_helper

# The live helpers live in cbkit.viz.live; the notebooks import them from here.

# --- sentences printed from the run ----------------------------------------------------------------------------
# A notebook's sentence about *this* run is computed here from the measured numbers, so it cannot disagree
# with the figure above it; the markdown states the general idea and points at the printed line.


def _more_less(ratio: float, more: str, less: str, same: str = "about the same") -> str:
    """The word for a ratio to 1, by cbkit's one "about equal" rule (`cbkit.measure.planner.versus_parity`)."""
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
