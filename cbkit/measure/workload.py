"""Length workloads: how long each completion of a rollout runs, and how much spread that gives. CB wins back the
decode slots a static batch spends on rows already finished, so whether it wins depends on that spread; a benchmark
says what spread it ran, and controls it. One string names each (``cbkit sweep --lengths``):

* ``natural``: EOS decides, as in training;
* ``fixed``: every completion runs to ``max_new_tokens``, EOS ignored: the zero-spread control;
* ``replay:gsm8k``: each length drawn (seeded, with replacement) from GSM8K's 7,473 train reference solutions in
  SmolLM2 tokens (shipped in ``cbkit/resources``, made by ``scripts/gsm8k_lengths.py``), scaled so their p95 is the
  limit: ``clip(round(L * max_new_tokens / p95(L)), 1, max_new_tokens)``, fixed before anything was measured;
* ``replay:FILE``: lengths from an earlier ``natural`` sweep's results JSONL or a plain list, replayed as they are.
  A value above ``max_new_tokens`` is an error, not a clip: clipping would shrink the very spread the run measures.

In a replay (and ``fixed``) EOS is ignored and every request stops at its target, so both backends do the same useful
work and only the batching differs, as serving benchmarks replay a dataset's output lengths (vLLM's throughput
benchmark replays ShareGPT's). The static batch still runs to its longest target: the rest is its padding.
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
from typing import Any, Literal

from cbkit.jsonl import read_jsonl

Kind = Literal["natural", "fixed", "replay"]
KINDS = ("natural", "fixed", "replay:gsm8k", "replay:FILE")
GSM8K_RESOURCE = "resources/gsm8k_train_solution_lengths.json"


@dataclass(frozen=True)
class LengthWorkload:
    """A parsed ``--lengths`` value. Build it with `parse_lengths`; it reads its file once, up front."""

    spec: str
    kind: Kind
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
        if self.kind == "replay" and not self.scaled:
            longest = max(self.source_lengths)
            if longest > max_new_tokens:
                over = sum(x > max_new_tokens for x in self.source_lengths)
                raise ValueError(f"--lengths {self.spec}: {over} of {len(self.source_lengths)} lengths exceed "
                                 f"max_new_tokens={max_new_tokens} (longest {longest}). A replay does not clip them: "
                                 f"raise --max-new-tokens to at least {longest}, or use a file made at this limit.")

    def distribution(self, max_new_tokens: int) -> list[int]:
        """The lengths targets are drawn from at this limit; empty for ``natural``."""
        self.check(max_new_tokens)
        if self.kind == "natural":
            return []
        if self.kind == "fixed":
            return [max_new_tokens]
        if self.scaled:
            return scale_to_limit(self.source_lengths, max_new_tokens)
        return list(self.source_lengths)

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
        src = (f"{len(self.source_lengths)} lengths (mean {stats['mean']:.1f}, CV {stats['cv']:.2f}, "
               f"max {stats['max']})")
        if self.scaled:
            p = p95(self.source_lengths)
            return (f"lengths: replay:gsm8k, GSM8K train reference solutions in SmolLM2 tokens, {src}; scaled "
                    f"x{max_new_tokens}/{p} (p95 -> max_new_tokens={max_new_tokens}), clipped to "
                    f"1..{max_new_tokens}; EOS ignored, each completion runs to its drawn target")
        return (f"lengths: replay:{self.source}, {src}, replayed as they are (no scaling); EOS ignored, each "
                "completion runs to its drawn target")


def parse_lengths(spec: str) -> LengthWorkload:
    """``natural`` | ``fixed`` | ``replay:gsm8k`` | ``replay:FILE``, checked and read now, before model time."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--lengths must be one of {', '.join(KINDS)}; got {spec!r}.")
    spec = spec.strip()
    if spec in ("natural", "fixed"):
        return LengthWorkload(spec, spec)  # type: ignore[arg-type]
    kind, sep, source = spec.partition(":")
    if kind != "replay" or not sep:
        raise ValueError(f"Unknown length workload {spec!r}; choose from {', '.join(KINDS)}.")
    if not source:
        raise ValueError("--lengths replay: needs a source: replay:gsm8k or replay:FILE (a sweep JSONL or a list).")
    if source == "gsm8k":
        return LengthWorkload(spec, "replay", "gsm8k", tuple(gsm8k_solution_lengths()))
    return LengthWorkload(spec, "replay", source, tuple(read_lengths_file(source)))


def gsm8k_solution_lengths() -> list[int]:
    """The shipped GSM8K train reference-solution lengths (SmolLM2 tokens), in file order."""
    record = json.loads(resources.files("cbkit").joinpath(GSM8K_RESOURCE).read_text())
    return [int(x) for x in record["lengths"]]


def read_lengths_file(path: str | Path) -> list[int]:
    """Lengths from a sweep results JSONL (every run line's ``completion_lengths``), a JSON list, or one
    integer per line (blank lines and ``#`` comments skipped). Every value must be a whole number >= 1."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(
            f"--lengths replay:{path}: no such file. Give a sweep results JSONL (made with --lengths natural) or "
            "a list of lengths, one integer per line or a JSON list; or use replay:gsm8k."
        )
    text = p.read_text()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        values, where = _from_sweep_jsonl(p)
    elif first.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} starts like a JSON list but does not parse ({e}).") from None
        if not isinstance(values, list):
            raise ValueError(f"{p}: expected a JSON list of lengths.")
        where = [f"item {i}" for i in range(len(values))]
    else:
        values, where = [], []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                values.append(line)
                where.append(f"line {n}")
    out = []
    for v, w in zip(values, where, strict=True):
        x = _whole(v)
        if x is None or x < 1:
            raise ValueError(f"{p}, {w}: {v!r} is not a length (a whole number of tokens >= 1).")
        out.append(x)
    if not out:
        raise ValueError(
            f"{p} holds no usable lengths: a sweep JSONL needs run lines with completion_lengths (a sweep "
            "made by this cbkit version), a list needs at least one integer."
        )
    return out


def _from_sweep_jsonl(p: Path) -> tuple[list[Any], list[str]]:
    values: list[Any] = []
    where: list[str] = []
    for n, rec in enumerate(read_jsonl(p, what="run"), 1):
        if rec.get("kind") == "run" and rec.get("status") == "ok":
            lengths = rec.get("completion_lengths") or []
            values += lengths
            where += [f"record {n}"] * len(lengths)
    return values, where


def _whole(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if v.is_integer() else None
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return None
    return None


# --- statistics ------------------------------------------------------------------------------------------


def p95(lengths: Sequence[int]) -> int:
    """95th percentile, nearest rank: the value at rank ceil(0.95 n) of the sorted lengths (an actual length)."""
    if not lengths:
        raise ValueError("p95 of no lengths.")
    s = sorted(lengths)
    return s[math.ceil(0.95 * len(s)) - 1]


def scale_to_limit(lengths: Sequence[int], max_new_tokens: int) -> list[int]:
    """``clip(round(L * max_new_tokens / p95(L)), 1, max_new_tokens)`` for each L: the p95 maps to the limit."""
    ref = p95(lengths)
    return [min(max(round(x * max_new_tokens / ref), 1), max_new_tokens) for x in lengths]


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """mean, CV (population standard deviation / mean) and max of completion lengths."""
    if not lengths:
        raise ValueError("length_stats of no lengths.")
    mean = statistics.fmean(lengths)
    return {"mean": mean, "cv": statistics.pstdev(lengths) / mean if mean else 0.0, "max": max(lengths)}


def decode_padding_share(lengths: Sequence[int], batch_rows: int | None = None) -> float:
    """Share of a static batch's decode slots that compute padding, for these completion lengths.

    Each batch (consecutive ``batch_rows`` rows; one batch of all rows when None) runs rows x its longest
    length decode steps; the useful ones are the lengths. Over several batches: 1 - sum(len) / sum(slots).
    Prompt padding is not counted: it is the same for both backends' prefill.
    """
    if not lengths:
        raise ValueError("decode_padding_share of no lengths.")
    if batch_rows is not None and batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}.")
    size = batch_rows or len(lengths)
    batches = [lengths[i : i + size] for i in range(0, len(lengths), size)]
    slots = sum(len(b) * max(b) for b in batches)
    return 1 - sum(lengths) / slots
