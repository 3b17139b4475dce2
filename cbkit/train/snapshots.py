"""A ring of the policy's recent weights (`rollout_staleness`, a notebook's saved copies), bitwise, kept on the
"device", pinned "host" memory or "disk" (a file per version); a tied storage is kept once (`_aliases`)."""

from __future__ import annotations

import collections
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from cbkit.train.config import SNAPSHOT_PLACES

TIER_PLACES = {"t4": "disk", "a100": "device"}


def place_for_tier(tier: str, device: str = "cuda") -> str:
    """Where a notebook on `tier` keeps a copy of the weights (a T4 has no room but files)."""
    return TIER_PLACES.get(tier, "disk" if device == "cpu" else "host")


class WeightSnapshots:
    """The last `maxlen` versions of a model's weights, oldest first, kept `where`."""

    def __init__(self, maxlen: int, where: str = "host") -> None:
        if where not in SNAPSHOT_PLACES:
            raise ValueError(f"where={where!r} is not a place for weight snapshots; use one of {SNAPSHOT_PLACES}.")
        self.where, self.maxlen = where, maxlen
        # (version, the distinct tensors or their file, {a tied name: the name its storage is kept under})
        self._ring: collections.deque[tuple[int, dict[str, Tensor] | Path, dict[str, str]]] = collections.deque()
        self._dir: Path | None = Path(tempfile.mkdtemp(prefix="cbkit-snapshots-")) if where == "disk" else None
        if self._dir is not None:  # removed with the ring even when nobody calls close()
            weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)

    @property
    def versions(self) -> list[int]:
        return [v for v, _, _ in self._ring]

    def append(self, version: int, weights: torch.nn.Module | Mapping[str, Tensor], *,
               device: torch.device | str | None = None) -> None:
        """Keep `weights` (a model or a state dict) as `version`, dropping the oldest past `maxlen`."""
        full = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        aliases = _aliases(full)
        state = {n: t for n, t in full.items() if n not in aliases}
        kept: dict[str, Tensor] | Path
        if self.where == "device":
            kept = {n: t.detach().to(device or t.device, copy=True) for n, t in state.items()}
        elif self.where == "host":  # page-locked where CUDA is: copies to and from the GPU at full speed
            pin = torch.cuda.is_available()
            kept = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t.detach()) for n, t in state.items()}
        else:  # one file per version, read back through a memory map: never a whole copy in host memory
            assert self._dir is not None
            kept = self._dir / f"v{version}.bin"
            torch.save({n: t.detach() for n, t in state.items()}, kept)
        self._ring.append((version, kept, aliases))
        while len(self._ring) > self.maxlen:
            self._drop()

    def load_into(self, model: torch.nn.Module, index: int = 0) -> int:
        """Overwrite `model`'s weights with the version at `index` (0: the oldest, -1: the newest); returns it."""
        version, kept, aliases = self._ring[index]
        with torch.no_grad():
            _fill(model.state_dict(), kept, aliases, non_blocking=True)  # from pinned host memory: queued
        device = next(model.parameters()).device
        if device.type == "cuda":
            # Queued on this thread's stream; the CB engine's forwards run on another: in place before returning.
            torch.cuda.current_stream(device).synchronize()
        return version

    def state_dict(self, template: torch.nn.Module, index: int = 0) -> dict[str, Tensor]:
        """The version at `index` as a new state dict on the CPU, shaped like `template`'s."""
        _, kept, aliases = self._ring[index]
        # One new tensor per kept storage, each tied name pointing at it, in the template's order.
        distinct = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in template.state_dict().items()
                    if n not in aliases}
        _fill(distinct, kept, {})
        return {n: distinct[aliases.get(n, n)] for n in template.state_dict()}

    def _drop(self) -> None:
        _, old, _ = self._ring.popleft()
        if isinstance(old, Path):
            old.unlink(missing_ok=True)

    def clear(self) -> None:
        while self._ring:
            self._drop()

    def close(self) -> None:
        """Drop every snapshot and, on disk, the folder."""
        self.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _aliases(state: Mapping[str, Tensor]) -> dict[str, str]:
    """{name: the first name} for every entry of `state` viewing the same memory as an earlier one (tied weights)."""
    first: dict[tuple, str] = {}
    out = {}
    for name, t in state.items():
        if t.numel() == 0:  # an empty tensor's storage pointer may be shared by unrelated ones
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def _fill(target: Mapping[str, Tensor], kept: Mapping[str, Tensor] | Path, aliases: Mapping[str, str], *,
          non_blocking: bool = False) -> None:
    """Copy a snapshot into `target`'s tensors: each kept storage into its first name, then every tied name from it."""
    tensors = torch.load(kept, map_location="cpu", mmap=True, weights_only=True) if isinstance(kept, Path) else kept
    distinct = [n for n in target if n not in aliases]
    if set(distinct) != set(tensors):
        raise RuntimeError(f"this weight snapshot holds {len(tensors)} tensors and the model {len(distinct)} distinct "
                           "ones: it was taken from another model (or one tied otherwise).")
    for name in distinct:
        target[name].copy_(tensors[name], non_blocking=non_blocking)
    for name, source in aliases.items():
        if target[name].data_ptr() != target[source].data_ptr():
            target[name].copy_(target[source])
