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
        target, kept = model.state_dict(), self.tensors(index)
        if target.keys() != kept.keys():
            raise RuntimeError(f"this weight snapshot holds {len(kept)} tensors and the model {len(target)}: it was "
                               "taken from another model.")
        with torch.no_grad():
            for name, tensor in target.items():
                tensor.copy_(kept[name], non_blocking=True)  # from pinned host memory: queued
        device = next(model.parameters()).device
        if device.type == "cuda":
            # Queued on this thread's stream; the CB engine's forwards run on another: in place before returning.
            torch.cuda.current_stream(device).synchronize()
        return self._ring[index][0]

    def tensors(self, index: int = 0) -> dict[str, Tensor]:
        """The version at `index` by name (a file's memory-mapped), a tied name the same tensor as its first: a
        checkpoint's `torch.save` writes it once."""
        _, kept, aliases = self._ring[index]
        distinct = torch.load(kept, map_location="cpu", mmap=True, weights_only=True) if isinstance(kept, Path) else kept
        return distinct | {name: distinct[first] for name, first in aliases.items()}

    def _drop(self) -> None:
        _, old, _ = self._ring.popleft()
        if isinstance(old, Path):
            old.unlink(missing_ok=True)

    def clear(self) -> None:
        while self._ring:
            self._drop()

    def close(self) -> None:
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

