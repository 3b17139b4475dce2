"""What every plan reads: the model's layers the way transformers' caches read them, the dtype's bytes, and the
check of the sizes a plan is given."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cbkit.measure.roofline import Shape
from cbkit.models.load import DTYPES

DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class CacheShape(Shape):
    """Roofline's `Shape` plus what the planner reads the way transformers' CB engine reads it: which layers
    attend to a sliding window, and the dtype's bytes."""

    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    a: int  # dtype bytes

    @classmethod
    def read(cls, cfg: Any, a: int) -> CacheShape:
        base = Shape.of(cfg)
        layers = base.layers
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        # Mirrors group_layers_by_attn_type (cache.py): no layer_types + a sliding window = all sliding.
        if types is None:
            sliding = layers if window is not None else 0
        else:
            unknown = set(types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ValueError(f"The planner knows full and sliding-window attention only, not {sorted(unknown)}.")
            sliding = sum(t == "sliding_attention" for t in types)
        return cls(**dataclasses.asdict(base), full_layers=layers - sliding, sliding_layers=sliding,
                   sliding_window=window if sliding else None, a=a)

    @property
    def kv_layer_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.a

    def forward_bytes_per_token(self) -> int:
        """Activations of one token inside one decoder layer, no gradients: the residual and its normed copy,
        plus the larger of the attention projections and the MLP's gate, up and product."""
        attn = self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim + self.hidden
        mlp = 3 * self.intermediate
        return self.a * (2 * self.hidden + max(attn, mlp))



def check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")

