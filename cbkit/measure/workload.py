"""Length workloads: how long each completion runs. CB wins back the decode slots a static batch spends on finished
rows, so the lengths' spread decides it; a benchmark names its spread (``cbkit sweep --lengths``): ``natural`` (EOS
decides), ``fixed`` (all to ``max_new_tokens``, the zero-spread control) or ``replay:gsm8k`` (GSM8K train solution
lengths in SmolLM2 tokens, p95 scaled to the limit). Outside ``natural`` EOS is ignored, as vLLM's benchmark replays
ShareGPT's output lengths: both backends do the same useful work."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

KINDS = ("natural", "fixed", "replay:gsm8k")


@dataclass(frozen=True)
class LengthWorkload:
    """A parsed ``--lengths`` value."""

    spec: str
    source_lengths: tuple[int, ...] = field(default=(), repr=False)  # replay:gsm8k's distribution, unscaled

    def distribution(self, max_new_tokens: int) -> list[int]:
        """The lengths targets are drawn from at this limit; empty for ``natural``."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        if self.spec == "fixed":
            return [max_new_tokens]
        return scale_to_limit(self.source_lengths, max_new_tokens) if self.source_lengths else []

    def targets(self, rows: int, max_new_tokens: int, seed: int) -> list[int] | None:
        """One target per completion row, drawn from (seed, rows) only, so both backends at a point get the same;
        None for ``natural``."""
        pool = self.distribution(max_new_tokens)
        if not pool:
            return None
        rng = random.Random(f"cbkit-lengths/{seed}/{rows}")
        return [pool[rng.randrange(len(pool))] for _ in range(rows)]

    def describe(self, max_new_tokens: int) -> str:
        """One line for the sweep's output: which workload ran and how its lengths were made."""
        if self.spec == "natural":
            return f"lengths: natural (EOS decides, up to max_new_tokens={max_new_tokens})"
        if self.spec == "fixed":
            return f"lengths: fixed (every completion runs to max_new_tokens={max_new_tokens}, EOS ignored)"
        s = length_stats(self.source_lengths)
        return (f"lengths: replay:gsm8k, GSM8K train reference solutions in SmolLM2 tokens, {len(self.source_lengths)} "
                f"lengths (mean {s['length_mean']:.1f}, CV {s['length_cv']:.2f}, max {s['length_max']}); "
                f"scaled x{max_new_tokens}/{p95(self.source_lengths)} (p95 -> max_new_tokens={max_new_tokens}), "
                f"clipped to 1..{max_new_tokens}; EOS ignored, each completion runs to its drawn target")


def parse_lengths(spec: str) -> LengthWorkload:
    spec = spec.strip() if isinstance(spec, str) else ""
    if spec not in KINDS:
        raise ValueError(f"Unknown length workload {spec!r}; choose from {', '.join(KINDS)}.")
    return LengthWorkload(spec, tuple(gsm8k_solution_lengths()) if spec == "replay:gsm8k" else ())


def gsm8k_solution_lengths() -> list[int]:
    """The shipped GSM8K train reference-solution lengths (SmolLM2 tokens), in file order."""
    text = resources.files("cbkit").joinpath("resources/gsm8k_train_solution_lengths.json").read_text()
    return [int(x) for x in json.loads(text)["lengths"]]


def p95(lengths: Sequence[int]) -> int:
    """95th percentile, nearest rank: the value at rank ceil(0.95 n) of the sorted lengths (an actual length)."""
    s = sorted(lengths)
    return s[math.ceil(0.95 * len(s)) - 1]


def scale_to_limit(lengths: Sequence[int], max_new_tokens: int) -> list[int]:
    """``clip(round(L * max_new_tokens / p95(L)), 1, max_new_tokens)`` for each L: the p95 maps to the limit."""
    ref = p95(lengths)
    return [min(max(round(x * max_new_tokens / ref), 1), max_new_tokens) for x in lengths]


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """Mean, CV (population standard deviation / mean) and max of completion lengths, as a run records them."""
    mean = statistics.fmean(lengths)
    return {"length_mean": mean, "length_cv": statistics.pstdev(lengths) / mean if mean else 0.0,
            "length_max": max(lengths)}


def decode_padding_share(lengths: Sequence[int]) -> float:
    """Share of a static batch's decode slots (rows x the longest) that compute padding."""
    return 1 - sum(lengths) / (len(lengths) * max(lengths))
