"""Length workloads: how long each completion of a rollout runs. CB wins back the decode slots a static batch spends
on rows already finished, so whether it wins depends on the lengths' spread; a benchmark says which spread it ran
and controls it. One string names each (``cbkit sweep --lengths``):

* ``natural``: EOS decides, as in training;
* ``fixed``: every completion runs to ``max_new_tokens``: the zero-spread control;
* ``replay:gsm8k``: lengths drawn (seeded, with replacement) from GSM8K's train reference solutions in SmolLM2
  tokens (``cbkit/resources``, made by ``scripts/gsm8k_lengths.py``), scaled so their p95 is the limit;
* ``replay:FILE``: lengths from an earlier ``natural`` sweep's JSONL or one integer a line, replayed as they are; a
  value above ``max_new_tokens`` is an error, not a clip, which would shrink the very spread the run measures.

In a replay (and ``fixed``) EOS is ignored and every request stops at its target, so both backends do the same useful
work and only the batching differs, as vLLM's throughput benchmark replays ShareGPT's output lengths.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from cbkit.jsonl import read_jsonl

KINDS = ("natural", "fixed", "replay:gsm8k", "replay:FILE")


@dataclass(frozen=True)
class LengthWorkload:
    """A parsed ``--lengths`` value. Build it with `parse_lengths`; it reads its file once, up front."""

    spec: str
    kind: Literal["natural", "fixed", "replay"]
    source: str | None = None  # "gsm8k" or the file's path, for replays
    source_lengths: tuple[int, ...] = field(default=(), repr=False)  # the replayed distribution, unscaled

    @property
    def scaled(self) -> bool:
        """Whether replayed lengths are rescaled to the run's limit (only the shipped GSM8K distribution is)."""
        return self.kind == "replay" and self.source == "gsm8k"

    def check(self, max_new_tokens: int) -> None:
        """Refuse a file whose lengths cannot run at this limit (no clip: see the module docstring)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        longest = max(self.source_lengths, default=0)
        if not self.scaled and longest > max_new_tokens:
            over = sum(x > max_new_tokens for x in self.source_lengths)
            raise ValueError(f"--lengths {self.spec}: {over} of {len(self.source_lengths)} lengths exceed "
                             f"max_new_tokens={max_new_tokens} (longest {longest}). A replay does not clip them: "
                             f"raise --max-new-tokens to at least {longest}, or use a file made at this limit.")

    def distribution(self, max_new_tokens: int) -> list[int]:
        """The lengths targets are drawn from at this limit; empty for ``natural``."""
        self.check(max_new_tokens)
        if self.kind == "fixed":
            return [max_new_tokens]
        return scale_to_limit(self.source_lengths, max_new_tokens) if self.scaled else list(self.source_lengths)

    def targets(self, rows: int, max_new_tokens: int, seed: int) -> list[int] | None:
        """One target per completion row (group order), drawn with replacement from (seed, rows) only: both
        backends at a sweep point get the same targets, and a rerun reproduces them. None for ``natural``."""
        pool = self.distribution(max_new_tokens)
        if not pool:
            return None
        rng = random.Random(f"cbkit-lengths/{seed}/{rows}")
        return [pool[rng.randrange(len(pool))] for _ in range(rows)]

    def describe(self, max_new_tokens: int) -> str:
        """One line for the sweep's output: which workload ran and how its lengths were made."""
        if self.kind == "natural":
            return f"lengths: natural (EOS decides, up to max_new_tokens={max_new_tokens})"
        if self.kind == "fixed":
            return f"lengths: fixed (every completion runs to max_new_tokens={max_new_tokens}, EOS ignored)"
        stats = length_stats(self.source_lengths)
        src = f"{len(self.source_lengths)} lengths (mean {stats['mean']:.1f}, CV {stats['cv']:.2f}, max {stats['max']})"
        how = (f"scaled x{max_new_tokens}/{p95(self.source_lengths)} (p95 -> max_new_tokens={max_new_tokens}), "
               f"clipped to 1..{max_new_tokens}" if self.scaled else "replayed as they are (no scaling)")
        return f"lengths: {self.spec}, {src}; {how}; EOS ignored, each completion runs to its drawn target"


def parse_lengths(spec: str) -> LengthWorkload:
    """``natural`` | ``fixed`` | ``replay:gsm8k`` | ``replay:FILE``, checked and read now, before model time."""
    spec = spec.strip() if isinstance(spec, str) else ""
    if spec in ("natural", "fixed"):
        return LengthWorkload(spec, spec)  # type: ignore[arg-type]
    kind, sep, source = spec.partition(":")
    if kind != "replay" or not sep:
        raise ValueError(f"Unknown length workload {spec!r}; choose from {', '.join(KINDS)}.")
    if not source:
        raise ValueError("--lengths replay: needs a source: replay:gsm8k or replay:FILE (a sweep JSONL or a list).")
    return LengthWorkload(spec, "replay", source, tuple(gsm8k_solution_lengths() if source == "gsm8k"
                                                        else read_lengths_file(source)))


def gsm8k_solution_lengths() -> list[int]:
    """The shipped GSM8K train reference-solution lengths (SmolLM2 tokens), in file order."""
    text = resources.files("cbkit").joinpath("resources/gsm8k_train_solution_lengths.json").read_text()
    return [int(x) for x in json.loads(text)["lengths"]]


def read_lengths_file(path: str | Path) -> list[int]:
    """Lengths from a sweep results JSONL (every ok run's ``completion_lengths``) or one integer a line (blank lines
    and ``#`` comments skipped). Every value must be a whole number >= 1."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--lengths replay:{path}: no such file. Give a sweep results JSONL (made with --lengths "
                         "natural) or a list of lengths, one integer a line; or use replay:gsm8k.")
    lines = p.read_text().splitlines()
    values: list[tuple[object, str]] = []
    if next((line.strip() for line in lines if line.strip()), "").startswith("{"):
        for n, rec in enumerate(read_jsonl(p, what="run"), 1):
            if rec.get("kind") == "run" and rec.get("status") == "ok":
                values += [(v, f"record {n}") for v in rec.get("completion_lengths") or []]
    else:
        values = [(line.split("#", 1)[0].strip(), f"line {n}") for n, line in enumerate(lines, 1)]
        values = [(v, where) for v, where in values if v]
    out = []
    for v, where in values:
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.isdigit())) or int(v) < 1:
            raise ValueError(f"{p}, {where}: {v!r} is not a length (a whole number of tokens >= 1).")
        out.append(int(v))
    if not out:
        raise ValueError(f"{p} holds no usable lengths: a sweep JSONL needs run lines with completion_lengths, a "
                         "list at least one integer.")
    return out


def p95(lengths: Sequence[int]) -> int:
    """95th percentile, nearest rank: the value at rank ceil(0.95 n) of the sorted lengths (an actual length)."""
    s = sorted(lengths)
    return s[math.ceil(0.95 * len(s)) - 1]


def scale_to_limit(lengths: Sequence[int], max_new_tokens: int) -> list[int]:
    """``clip(round(L * max_new_tokens / p95(L)), 1, max_new_tokens)`` for each L: the p95 maps to the limit."""
    ref = p95(lengths)
    return [min(max(round(x * max_new_tokens / ref), 1), max_new_tokens) for x in lengths]


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """mean, CV (population standard deviation / mean) and max of completion lengths."""
    mean = statistics.fmean(lengths)
    return {"mean": mean, "cv": statistics.pstdev(lengths) / mean if mean else 0.0, "max": max(lengths)}


def decode_padding_share(lengths: Sequence[int]) -> float:
    """Share of a static batch's decode slots that compute padding: rows x the longest length slots, of which the
    lengths are useful (prompt padding is not counted: both backends' prefill pays it alike)."""
    return 1 - sum(lengths) / (len(lengths) * max(lengths))
