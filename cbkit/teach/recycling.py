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
  it crosses a page boundary, and hands them all back when it ends. Waiting sequences are admitted first in,
  first out while fewer than `max_running` run and the pool can cover the newcomer's worst case
  (prompt + max_len): the scheduler cannot know a length in advance, and reserving it means a running
  sequence never waits for a block.

That admission rule is the model's, the conservative one. transformers' engine is more optimistic: it admits a
waiting request as soon as its prompt chunk fits the free blocks (keeping a 15% safety margin free for running
requests), reserves nothing for the tokens to come, and when a running request then finds no free block it
offloads one and prefills it again later (`cbkit.teach.findings.timeline_findings` says so under a real
timeline). So for the same pool the model queues somewhat more than the engine and never offloads.

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

from cbkit.viz.palette import BACKEND_COLORS

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


def paged_pool(prompt_len: int, lengths: Sequence[int], page_size: int, pool_blocks: int | None = None,
               max_running: int | None = None, max_len: int | None = None) -> Occupancy:
    """The CB engine's policy (see the module docstring); `pool_blocks=None` is a pool with room for all.
    ``max_len`` is the generation limit each admission reserves for (default: the longest of ``lengths``)."""
    _check(prompt_len, lengths)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}.")
    max_len = max(lengths) if max_len is None else max_len
    if max_len < max(lengths):
        raise ValueError(f"max_len={max_len} is below the longest completion ({max(lengths)} tokens).")
    worst = _blocks(prompt_len + max_len, page_size)
    if pool_blocks is not None and pool_blocks < worst:
        raise ValueError(f"pool_blocks={pool_blocks} cannot hold even one sequence at full length ({worst} blocks "
                         f"of {page_size} tokens); give it at least {worst}.")
    max_running = max_running or len(lengths)
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
    return Occupancy("paged pool", tuple(held_steps), tuple(running_steps))


def recycling_figure(static: Occupancy, paged: Occupancy, pool_tokens: int | None = None,
                     title: str | None = None) -> go.Figure:
    """Both policies on one step axis: KV token slots held (top) and sequences running (bottom)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.65, 0.35])
    colors = {"static batch": BACKEND_COLORS["generate"], "paged pool": BACKEND_COLORS["continuous"]}
    for occ in (static, paged):
        steps = list(range(1, occ.steps + 1))
        fig.add_trace(go.Scatter(x=steps, y=list(occ.held_tokens), name=f"{occ.policy}: KV slots held",
                                 mode="lines", line={"shape": "hv", "color": colors[occ.policy], "width": 2.5},
                                 legendgroup=occ.policy), row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=list(occ.running), name=f"{occ.policy}: running",
                                 mode="lines", line={"shape": "hv", "color": colors[occ.policy], "width": 1.5,
                                                     "dash": "dot"}, legendgroup=occ.policy), row=2, col=1)
    if pool_tokens:
        last = max(static.steps, paged.steps)
        fig.add_trace(go.Scatter(x=[1, last], y=[pool_tokens, pool_tokens], mode="lines", name="pool size",
                                 line={"color": "black", "dash": "dash", "width": 1.2}), row=1, col=1)
    peak = paged.peak_tokens / static.peak_tokens
    area = paged.token_steps / static.token_steps
    fig.update_yaxes(title_text="KV token slots", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="sequences running", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="decode step (model: one token per running sequence per step)", row=2, col=1)
    fig.update_layout(
        title=title or (f"Model: paged pool peak = {peak:.0%} of the static batch's, slot-steps {area:.0%}, "
                        f"{paged.steps} steps vs {static.steps}"),
        template="plotly_white", height=560, legend={"orientation": "h", "y": -0.18, "x": 0},
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
    from cbkit.viz.live import detect_mode

    def figure(n: int, spread: float, pool_share: float) -> go.Figure:
        lengths = completion_lengths(n, max_len, spread, seed, replay=replay)
        static = static_batch(prompt_len, lengths)
        worst = _blocks(prompt_len + max_len, page_size)
        pool = max(worst, round(pool_share * static.peak_tokens / page_size))
        paged = paged_pool(prompt_len, lengths, page_size, pool_blocks=pool, max_len=max_len)
        return recycling_figure(static, paged, pool_tokens=pool * page_size)

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
