"""What a static batch and a paged pool hold, step by step, for the same completion lengths: the model behind the
tier planner's step counts (`cbkit.teach.tiers.runtime`).

Time is counted in decode steps (one token per running sequence per step); a sequence's prompt is filled in the step
it is admitted. What it keeps from the two backends is their memory policy:

* **static batch** (`generate()`): every row starts at once, and every row's KV grows by one token per step
  until the *longest* row ends, finished rows included: rows x (prompt + step) token slots;
* **paged pool**: a running sequence holds ceil((prompt + generated) / page) blocks and hands them back when it ends;
  admission reserves each newcomer's worst case (prompt + max_len), so a running sequence never waits for a block.
  This is a conservative planner, not the engine's rule: transformers' scheduler admits while the next tokens fit,
  shares a group's prompt pages, and is stepped beside the engine's own record in notebook 01.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Occupancy", "paged_pool", "static_batch"]


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


def static_batch(prompt_len: int, lengths: Sequence[int]) -> Occupancy:
    """`generate()`'s policy: all rows hold prompt + step slots until the longest row ends."""
    _check(prompt_len, lengths)
    rows, longest = len(lengths), max(lengths)
    held = tuple(rows * (prompt_len + step) for step in range(1, longest + 1))
    running = tuple(sum(1 for n in lengths if n >= step) for step in range(1, longest + 1))
    return Occupancy("static batch", held, running)


def paged_pool(prompt_len: int, lengths: Sequence[int], page_size: int, pool_blocks: int | None = None,
               max_running: int | None = None, max_len: int | None = None) -> Occupancy:
    """A paged pool that admits while it covers every running sequence's worst case, prompt + ``max_len``
    (default: the longest of ``lengths``); `pool_blocks=None` is a pool with room for all."""
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
    return Occupancy("paged pool, worst-case reservation", tuple(held_steps), tuple(running_steps))


def _blocks(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _check(prompt_len: int, lengths: Sequence[int]) -> None:
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0, got {prompt_len}.")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"lengths must be one positive completion length per sequence, got {list(lengths)[:8]}.")
