"""KV slot recycling as a model with knobs: what a static batch and a paged pool hold, step by step, for the
same completion lengths.

The engine timeline (`cbkit.teach.figures_engine.timeline_figure`) shows what one real rollout did. This model lets a reader
turn the knobs that decide whether continuous batching pays, N and the spread of completion lengths, and
redraw in milliseconds. It is a model, and says so on its chart: time is counted in decode steps (one token
per running sequence per step) and a sequence's prompt is filled in the step it is admitted. What it keeps
from the two engines is their memory policy:

* **static batch** (`generate()`): every row starts at once, and every row's KV grows by one token per step
  until the *longest* row ends, finished rows included: rows x (prompt + step) token slots;
* **paged pool** (CB): a running sequence holds ceil((prompt + generated) / page) blocks, taking one more as
  it crosses a page boundary, and hands them all back when it ends. Two admission rules, drawn side by side:

  - ``admission="engine"``, transformers' rule (`FIFOScheduler`): each step the decoding sequences go first, each
    taking a block at a page boundary if one is free (else it waits that step); then waiting sequences are admitted
    in order while their prompt and first token fit the free blocks, reserving nothing for the tokens to come, and
    none while under 15% of the pool is free (its safety margin) unless the step would be empty. When no sequence
    can move, the engine offloads one and restores it later. The N completions share their prompt's complete pages
    (``allow_block_sharing``). Section 2's engine ran this rule.
  - ``admission="reserve"``, the conservative rule (and notebook 01's exercise): admit while the pool covers every
    running sequence's worst case, prompt + max_len, each with its own prompt pages, so no sequence ever waits for
    a block once admitted, and fewer run at once.

So the pool's peak follows the tokens actually alive, and a pool smaller than the static batch's peak makes
sequences queue: less memory, more steps. `paged_pool(..., pool_blocks=None)` is a pool big enough for all.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cbkit.viz.palette import BACKEND_COLORS, PALETTE

__all__ = ["Occupancy", "completion_lengths", "paged_pool", "recycling_explorer", "recycling_figure", "static_batch"]


@dataclass(frozen=True)
class Occupancy:
    """KV token slots held and sequences running at every decode step of one policy."""

    policy: str
    held_tokens: tuple[int, ...]  # KV token slots allocated at each step (blocks x page for the pool)
    running: tuple[int, ...]

    @property
    def steps(self) -> int:
        return len(self.held_tokens)

    @property
    def peak_tokens(self) -> int:
        return max(self.held_tokens, default=0)

    @property
    def token_steps(self) -> int:
        """The area under the curve: KV slot-steps held over the whole rollout."""
        return sum(self.held_tokens)


def completion_lengths(n: int, max_len: int, spread: float, seed: int = 0,
                       replay: Sequence[int] | None = None) -> list[int]:
    """N completion lengths. Spread 0 gives max_len for all (the ``fixed`` workload).

    Without ``replay``, spread s draws uniformly from [max_len * (1 - s), max_len], at least 1 token. With
    ``replay`` (lengths already scaled to max_len, e.g. ``cbkit.measure.workload``'s ``replay:gsm8k`` distribution),
    each length is drawn from it (seeded) and moved towards the limit: ``max_len - s * (max_len - L)``, so
    spread 1 is exactly the replayed workload and spread 0 the fixed one."""
    if n < 1 or max_len < 1:
        raise ValueError(f"need n >= 1 and max_len >= 1, got n={n}, max_len={max_len}.")
    if not 0 <= spread <= 1:
        raise ValueError(f"spread is a fraction of max_len in [0, 1], got {spread}.")
    rng = random.Random(seed)
    if replay is not None:
        pool = list(replay)
        if not pool or any(not 1 <= x <= max_len for x in pool):
            raise ValueError(f"replay lengths must be 1..max_len={max_len} (scaled to the limit); got "
                             f"{len(pool)} lengths, range {min(pool, default=None)}..{max(pool, default=None)}.")
        return [max(1, round(max_len - spread * (max_len - pool[rng.randrange(len(pool))]))) for _ in range(n)]
    low = max(1, round(max_len * (1 - spread)))
    return [rng.randint(low, max_len) for _ in range(n)]


def static_batch(prompt_len: int, lengths: Sequence[int]) -> Occupancy:
    """`generate()`'s policy: all rows hold prompt + step slots until the longest row ends."""
    _check(prompt_len, lengths)
    rows, longest = len(lengths), max(lengths)
    held = tuple(rows * (prompt_len + step) for step in range(1, longest + 1))
    running = tuple(sum(1 for n in lengths if n >= step) for step in range(1, longest + 1))
    return Occupancy("static batch", held, running)


ADMISSIONS = ("engine", "reserve")
ENGINE_SAFETY_MARGIN = 0.15  # transformers' FIFOScheduler default (ContinuousBatchingConfig.safety_margin=None)


def paged_pool(prompt_len: int, lengths: Sequence[int], page_size: int, pool_blocks: int | None = None,
               max_running: int | None = None, max_len: int | None = None, *, admission: str = "reserve",
               safety_margin: float = ENGINE_SAFETY_MARGIN, share_prompt: bool = True) -> Occupancy:
    """A paged pool under one of two admission rules (see the module docstring); `pool_blocks=None` is a pool
    with room for all.

    ``admission="reserve"``: admit while the pool covers every running sequence's worst case, prompt + ``max_len``
    (default: the longest of ``lengths``); a running sequence never waits for a block. ``admission="engine"``:
    transformers' rule, decoding sequences first, each taking a block when it crosses a page and waiting a step
    when none is free, then waiting sequences admitted while their prompt (and first token) fits the free blocks,
    none while fewer than ``safety_margin`` of the pool is free unless the step would otherwise be empty; when no
    sequence can move, the last admitted is offloaded (its blocks freed) and comes back first when room returns.
    With ``share_prompt`` (the engine's ``allow_block_sharing``, on by default) the sequences, N completions of one
    prompt, hold the prompt's complete pages once, from the first admission to the last sequence's end."""
    _check(prompt_len, lengths)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}.")
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}.")
    max_len = max(lengths) if max_len is None else max_len
    if max_len < max(lengths):
        raise ValueError(f"max_len={max_len} is below the longest completion ({max(lengths)} tokens).")
    worst = _blocks(prompt_len + (max_len if admission == "reserve" else max(lengths)), page_size)
    if pool_blocks is not None and pool_blocks < worst:
        raise ValueError(f"pool_blocks={pool_blocks} cannot hold even one sequence at full length ({worst} blocks "
                         f"of {page_size} tokens); give it at least {worst}.")
    max_running = max_running or len(lengths)
    if admission == "engine":
        return _engine_pool(prompt_len, lengths, page_size, pool_blocks, max_running, safety_margin,
                            prompt_len // page_size if share_prompt else 0)
    waiting = deque(range(len(lengths)))
    running: dict[int, int] = {}  # sequence -> tokens generated so far
    reserved = 0
    held_steps, running_steps = [], []
    while waiting or running:
        while waiting and len(running) < max_running and (pool_blocks is None or reserved + worst <= pool_blocks):
            running[waiting.popleft()] = 0
            reserved += worst
        for seq in running:
            running[seq] += 1
        held_steps.append(page_size * sum(_blocks(prompt_len + g, page_size) for g in running.values()))
        running_steps.append(len(running))
        for seq in [s for s, g in running.items() if g >= lengths[s]]:
            del running[seq]
            reserved -= worst
    return Occupancy("paged pool, worst-case reservation", tuple(held_steps), tuple(running_steps))


def _engine_pool(prompt_len: int, lengths: Sequence[int], page: int, pool: int | None, max_running: int,
                 margin: float, shared: int) -> Occupancy:
    waiting = deque(range(len(lengths)))
    done = [0] * len(lengths)  # tokens generated, kept across an offload (the engine restores the KV from CPU)
    running: dict[int, int] = {}  # admitted sequence -> its own blocks (beyond the shared prompt pages), in order
    held_steps, running_steps = [], []

    def own(seq: int, tokens: int) -> int:
        return _blocks(prompt_len + tokens, page) - shared

    while waiting or running:
        used = sum(running.values()) + (shared if running else 0)
        free = None if pool is None else pool - used
        in_margin = free is None or free >= margin * (pool or 0)
        moved = False
        for seq in list(running):  # decoding first: one token each, a new block at a page boundary if one is free
            need = own(seq, done[seq] + 1) - running[seq]
            if free is None or need <= free:
                running[seq] += need
                free = None if free is None else free - need
                done[seq] += 1
                moved = True
        for seq in list(waiting):  # then the waiting, in order, each one whose prompt and next token fit
            if len(running) >= max_running or (not in_margin and moved):
                break
            need = own(seq, done[seq] + 1) + (0 if running else shared)
            if free is not None and need > free:
                continue
            waiting.remove(seq)
            running[seq] = own(seq, done[seq] + 1)
            free = None if free is None else free - need
            done[seq] += 1
            moved = True
        if not moved:  # every admitted sequence is starved: offload the last one admitted, retry the step
            seq = list(running)[-1]
            del running[seq]
            waiting.appendleft(seq)
            continue
        held_steps.append(page * (sum(running.values()) + shared))
        running_steps.append(len(running))
        for seq in [s for s in running if done[s] >= lengths[s]]:
            del running[seq]
    return Occupancy("paged pool, engine admission", tuple(held_steps), tuple(running_steps))


def recycling_figure(static: Occupancy, paged: Occupancy, pool_tokens: int | None = None,
                     title: str | None = None, *, also: Sequence[Occupancy] = ()) -> go.Figure:
    """The policies on one step axis: KV token slots held (top) and sequences running (bottom). ``paged`` is the
    one the title compares with the static batch; ``also`` are drawn beside it, thinner (another admission rule)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.65, 0.35])
    extra = [PALETTE[4], PALETTE[2], PALETTE[5]]
    colors = {static.policy: BACKEND_COLORS["generate"], paged.policy: BACKEND_COLORS["continuous"],
              **{o.policy: extra[i % len(extra)] for i, o in enumerate(also)}}
    for occ in (static, paged, *also):
        steps = list(range(1, occ.steps + 1))
        width = 1.8 if occ in also else 2.5
        fig.add_trace(go.Scatter(x=steps, y=list(occ.held_tokens), name=f"{occ.policy}: KV slots held",
                                 mode="lines", line={"shape": "hv", "color": colors[occ.policy], "width": width},
                                 legendgroup=occ.policy), row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=list(occ.running), name=f"{occ.policy}: running",
                                 mode="lines", line={"shape": "hv", "color": colors[occ.policy], "width": 1.5,
                                                     "dash": "dot"}, legendgroup=occ.policy), row=2, col=1)
    if pool_tokens:
        last = max(o.steps for o in (static, paged, *also))
        fig.add_trace(go.Scatter(x=[1, last], y=[pool_tokens, pool_tokens], mode="lines", name="pool size",
                                 line={"color": "black", "dash": "dash", "width": 1.2}), row=1, col=1)
    peak = paged.peak_tokens / static.peak_tokens
    area = paged.token_steps / static.token_steps
    others = "".join(f"; {o.policy}: {o.steps} steps" for o in also)
    fig.update_yaxes(title_text="KV token slots", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="sequences running", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="decode step (model: one token per running sequence per step)", row=2, col=1)
    fig.update_layout(
        title=title or (f"Model, {paged.policy}: peak = {peak:.0%} of the static batch's, slot-steps {area:.0%}, "
                        f"{paged.steps} steps vs {static.steps}{others}"),
        template="plotly_white", height=600, legend={"orientation": "h", "y": -0.18, "x": 0},
        title_font={"size": 14},
    )
    return fig


def recycling_explorer(prompt_len: int = 128, max_len: int = 256, page_size: int = 32, *, n: int = 32,
                       spread: float = 0.8, pool_share: float = 0.5, seed: int = 0, interactive: bool | None = None,
                       replay: Sequence[int] | None = None):
    """Sliders for N, length spread and pool size (a share of the static batch's peak) that redraw the model.

    With ``replay`` (a length distribution scaled to ``max_len``) the spread slider runs from the ``fixed``
    workload (0) to that replayed one (1); see ``completion_lengths``.

    Where nobody can move a slider (CI, a script) it returns the figure for the given values instead, so the
    executed notebook keeps a chart. ``interactive=None`` decides by `cbkit.viz.figures.detect_mode`.
    """
    from cbkit.viz.display import detect_mode

    def figure(n: int, spread: float, pool_share: float) -> go.Figure:
        lengths = completion_lengths(n, max_len, spread, seed, replay=replay)
        static = static_batch(prompt_len, lengths)
        worst = _blocks(prompt_len + max_len, page_size)
        pool = max(worst, round(pool_share * static.peak_tokens / page_size))
        engine = paged_pool(prompt_len, lengths, page_size, pool_blocks=pool, max_len=max_len, admission="engine")
        reserve = paged_pool(prompt_len, lengths, page_size, pool_blocks=pool, max_len=max_len, admission="reserve")
        return recycling_figure(static, engine, pool_tokens=pool * page_size, also=[reserve])

    if interactive is None:
        import sys

        interactive = detect_mode() == "widget" or "google.colab" in sys.modules
    if not interactive:
        return figure(n, spread, pool_share)
    import ipywidgets as widgets

    def draw(n: int, spread: float, pool_share: float) -> None:
        figure(n, spread, pool_share).show()

    return widgets.interactive(
        draw,
        n=widgets.IntSlider(value=n, min=2, max=256, step=2, description="N"),
        spread=widgets.FloatSlider(value=spread, min=0.0, max=1.0, step=0.05,
                                   description="length spread" if replay is None else "fixed -> replay"),
        pool_share=widgets.FloatSlider(value=pool_share, min=0.05, max=1.0, step=0.05, description="pool / static"),
    )


def _blocks(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _check(prompt_len: int, lengths: Sequence[int]) -> None:
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0, got {prompt_len}.")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"lengths must be one positive completion length per sequence, got {list(lengths)[:8]}.")
