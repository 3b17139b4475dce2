"""The CB engine's settings, resolved once and without a model (the planner, the training config and the TRL bridge
need them too): cbkit's defaults, the CPU pool rule, the page size and the attention."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cbkit.rollout.varlen_attention import NAME as VARLEN

# Overridable key by key, like TRL's `transformers_continuous_batching_config`. Half the free memory for the pool
# leaves the rest to the training step in the same process; CUDA graphs re-capture as shapes drift and rarely pay.
CB_DEFAULTS: dict[str, Any] = {"max_memory_percent": 0.5, "use_cuda_graph": False}
# Tokens per KV page on CPU: a page is the unit a request allocates and a prompt is shared in; 256 would share none.
CPU_PAGE_SIZE = 32
# A pool fixed in blocks only gates the engine's footprint check with max_memory_percent: transformers' own margin.
FIXED_POOL_MEMORY_PERCENT = 0.9
# flash-attn's block-table decode takes pages in multiples of 256 tokens; with smaller ones cbkit turns it off.
KERNEL_PAGE_MULTIPLE = 256
# What the engine runs where a model needs its own attention (`varlen_unsupported_reason`): SDPA, a dense mask.
ENGINE_OWN = "sdpa"


def cb_config_values(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """cbkit's defaults + the user's keys + `return_logprobs=True`, checked: the device-independent part of
    `make_cb_config`, and what the TRL bridge writes into TRL's config."""
    from transformers import ContinuousBatchingConfig

    overrides = dict(overrides or {})
    valid = sorted(f.name for f in dataclasses.fields(ContinuousBatchingConfig))
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"Unknown continuous batching config key(s) {unknown}. transformers' "
                         f"ContinuousBatchingConfig accepts: {', '.join(valid)}.")
    if overrides.get("return_logprobs") is False:
        raise ValueError("return_logprobs=False would drop the sampling logprobs the importance-sampling correction "
                         "needs; remove it from the continuous batching config (cbkit always sets it to True).")
    values = {**CB_DEFAULTS, **overrides, "return_logprobs": True}
    mmp = values.get("max_memory_percent")
    if mmp is not None and not (isinstance(mmp, int | float) and 0 < mmp <= 1):
        raise ValueError(f"max_memory_percent must be a fraction in (0, 1] of free memory, got {mmp!r}; e.g. 0.5.")
    return values


def make_cb_config(overrides: Mapping[str, Any] | None = None, *, seed: int | None = None,
                   device: torch.device | None = None, rows: Sequence[Sequence[int]] | None = None,
                   max_new_tokens: int | None = None, warn: bool = True):
    """The `ContinuousBatchingConfig` of one call. On CPU the pool is sized to the workload (`workload_blocks`), in
    pages of `CPU_PAGE_SIZE` tokens, unless the user set them (`{"num_blocks": None}`: sized from memory)."""
    from transformers import ContinuousBatchingConfig

    overrides = dict(overrides or {})
    values = cb_config_values(overrides)
    kind = torch.device(device).type if device is not None else None
    if kind == "cpu" and "page_size" not in overrides:
        values["page_size"] = CPU_PAGE_SIZE
    values["auto_switch_to_flash"] = False  # cbkit chooses the attention itself (`engine_attention`)
    if kind == "cuda" and "max_blocks_per_request" not in overrides and page_size(values) % KERNEL_PAGE_MULTIPLE:
        values["max_blocks_per_request"] = 0
    if kind == "cpu" and rows and max_new_tokens and "num_blocks" not in overrides:
        values["num_blocks"] = workload = workload_blocks(rows, max_new_tokens, page_size(values))
        if warn and overrides.get("max_memory_percent", mmp := CB_DEFAULTS["max_memory_percent"]) != mmp:
            warnings.warn(f"max_memory_percent={overrides['max_memory_percent']} is a share of free GPU memory; on a "
                          f"CPU the engine would take that share of host RAM. cbkit sizes the CPU pool to the workload "
                          f"({workload} blocks) instead. Set num_blocks to fix the pool yourself, or num_blocks=None "
                          "to let the engine size it from max_memory_percent.", UserWarning, stacklevel=3)
    if values.get("num_blocks") is not None and "max_memory_percent" not in overrides:
        values["max_memory_percent"] = FIXED_POOL_MEMORY_PERCENT
    if seed is not None and "seed" not in overrides:
        values["seed"] = seed
    return ContinuousBatchingConfig(**values)


def workload_blocks(rows: Sequence[Sequence[int]], max_new_tokens: int, page_size: int) -> int:
    """Blocks for every request at the generation limit at once, plus the engine's trash block."""
    return sum(-(-(len(r) + max_new_tokens) // page_size) for r in rows) + 1


def flash_versions() -> tuple[int, ...]:
    """The flash-attn versions installed as packages, newest first (not the hub fallback: offline it fails)."""
    from transformers.utils import import_utils

    found = [(3, import_utils.is_flash_attn_3_available), (2, import_utils.is_flash_attn_2_available)]
    return tuple(v for v, available in found if available(kernels_fallback_ok=False))


def engine_attention(device: torch.device | str, dtype: torch.dtype, capability: tuple[int, int] | None = None,
                     flash: Sequence[int] | None = None, needs_own: str | None = None) -> str:
    """The CB engine's attention: flash-attn 3 on a Hopper, 2 from capability 8.0, for fp16/bf16 weights where it is
    installed; else cbkit's varlen attention, or `ENGINE_OWN` where the model needs its own (``needs_own``)."""
    if torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        flash = flash_versions() if flash is None else flash
        if flash:
            capability = capability if capability is not None else torch.cuda.get_device_capability()
            if 3 in flash and capability[0] == 9:
                return "flash_attention_3"
            if 2 in flash and capability >= (8, 0):
                return "flash_attention_2"
    return ENGINE_OWN if needs_own else VARLEN


def page_size(config) -> int:
    """Tokens per KV page of a ContinuousBatchingConfig or a dict of its keys (the engine's default if unset)."""
    from transformers import ContinuousBatchingConfig

    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    return int(get("page_size") or ContinuousBatchingConfig().page_size)
