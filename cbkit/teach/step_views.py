"""How far an update moved the weights (tests/test_precision.py's bf16 step reads it)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def weight_change(before: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, float]:
    """How far an update moved the weights: the share of weight elements that changed at all, and the
    relative norm of the change. ``before`` is a ``state_dict`` copy taken before the update."""
    changed = total = 0
    diff_sq = base_sq = 0.0
    for name, after in model.state_dict().items():
        if name not in before or not after.is_floating_point():
            continue
        old = before[name].to(after.device)
        changed += int((after != old).sum())
        total += after.numel()
        diff_sq += float((after.double() - old.double()).pow(2).sum())
        base_sq += float(old.double().pow(2).sum())
    if not total:
        raise ValueError("no floating-point weight in common between `before` and the model.")
    return {"changed_share": changed / total, "relative_change": (diff_sq / base_sq) ** 0.5 if base_sq else 0.0}
