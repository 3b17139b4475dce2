"""A ring of the policy's recent weights, for rollouts sampled from an older policy (`rollout_staleness`).

A lag of k updates needs the weights of the last k + 1 versions at hand: k + 1 copies of the model. In memory
(`where="memory"`, the default) that is k + 1 clones beside the policy: 2.7 GB at k = 4 for a 135M model in fp32,
more than the rest of a CPU training step. On disk (`where="disk"`) each version is one file in a temporary folder,
written once when the version is made and read straight into the model when it is due (`LaggedRollouts` loads the
oldest into the policy for the rollout and the newest back after it): no copy of the weights stays in memory, at
the price of one write and two reads of the weights a step (the page cache, not the process, holds what the disk
has just seen).

A snapshot is bitwise the weights it was taken from, wherever it is kept: the files hold the tensors' raw bytes
in the model's own state-dict order and dtypes.
"""

from __future__ import annotations

import collections
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from cbkit.train.config import SNAPSHOT_PLACES as WHERE


class WeightSnapshots:
    """The last `maxlen` versions of a model's weights, oldest first; each in memory or in a file."""

    def __init__(self, maxlen: int, where: str = "memory") -> None:
        if where not in WHERE:
            raise ValueError(f"where={where!r}: keep weight snapshots in one of {WHERE}.")
        if maxlen < 1:
            raise ValueError(f"maxlen={maxlen} must be >= 1.")
        self.where, self.maxlen = where, maxlen
        self._ring: collections.deque[tuple[int, dict[str, Tensor] | Path]] = collections.deque()
        self._dir: Path | None = Path(tempfile.mkdtemp(prefix="cbkit-snapshots-")) if where == "disk" else None

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def versions(self) -> list[int]:
        return [v for v, _ in self._ring]

    def append(self, version: int, weights: torch.nn.Module | Mapping[str, Tensor]) -> None:
        """Keep `weights` (a model or a state dict) as `version`; the oldest is dropped past `maxlen`."""
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        if self._dir is None:
            kept: dict[str, Tensor] | Path = {n: t.detach().clone() for n, t in state.items()}
        else:
            kept = self._dir / f"v{version}.bin"
            with open(kept, "wb") as f:
                for t in state.values():
                    f.write(_bytes(t.detach().cpu()).numpy())
        self._ring.append((version, kept))
        while len(self._ring) > self.maxlen:
            _, old = self._ring.popleft()
            if isinstance(old, Path):
                old.unlink(missing_ok=True)

    def load_into(self, model: torch.nn.Module, index: int = 0) -> int:
        """Overwrite `model`'s weights, in place, with the version at `index` (0: the oldest kept, -1: the newest);
        returns that version."""
        version, kept = self._ring[index]
        with torch.no_grad():
            if isinstance(kept, Path):
                with open(kept, "rb") as f:
                    for name, t in model.state_dict().items():
                        _read_into(f, t, name, kept)
            else:
                for name, t in model.state_dict().items():
                    t.copy_(kept[name])
        return version

    def items(self, template: torch.nn.Module) -> Iterator[tuple[int, dict[str, Tensor]]]:
        """Every version as (version, state dict on the CPU), oldest first: what a checkpoint saves. A file is
        read into new tensors shaped like `template`'s state dict."""
        for version, kept in self._ring:
            if isinstance(kept, Path):
                state = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in template.state_dict().items()}
                with open(kept, "rb") as f:
                    for name, t in state.items():
                        _read_into(f, t, name, kept)
                yield version, state
            else:
                yield version, {n: t.to("cpu", copy=True) for n, t in kept.items()}

    def state_dict(self, template: torch.nn.Module, index: int = 0) -> dict[str, Tensor]:
        """The version at `index` (0: the oldest kept, -1: the newest) as a new state dict on the CPU, shaped like
        `template`'s: a copy, read from its file where it is on disk."""
        kept = self._ring[index][1]
        if not isinstance(kept, Path):
            return {n: t.to("cpu", copy=True) for n, t in kept.items()}
        state = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in template.state_dict().items()}
        with open(kept, "rb") as f:  # this version's file only
            for name, t in state.items():
                _read_into(f, t, name, kept)
        return state

    def clear(self) -> None:
        while self._ring:
            _, old = self._ring.popleft()
            if isinstance(old, Path):
                old.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop every snapshot and, on disk, the folder."""
        self.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __del__(self) -> None:
        if getattr(self, "_dir", None) is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _bytes(t: Tensor) -> Tensor:
    """A contiguous tensor's storage as bytes (any dtype, bf16 included), without a copy where it is contiguous."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _read_into(f, t: Tensor, name: str, path: Path) -> None:
    """Fill `t` from the next bytes of `f`: straight into its memory on the CPU, through a buffer elsewhere."""
    target = t if t.device.type == "cpu" and t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
    view = _bytes(target).numpy()
    if f.readinto(view) != view.nbytes:
        raise RuntimeError(f"weight snapshot {path} ends before {name}: the file is truncated or from another model.")
    if target is not t:
        t.copy_(target)
