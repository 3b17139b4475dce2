"""The CB engine's settings, resolved once: cbkit's defaults, the CPU pool rule, the page size, the attention, the loop.

All of it works on transformers' public `ContinuousBatchingConfig` and plain values, so the planner, the training
config and the TRL bridge resolve a config without a model; `cbkit.rollout.engine` hands it to an engine.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# cbkit's defaults, overridable key by key like TRL's `transformers_continuous_batching_config`.
# max_memory_percent: half the free memory for the KV pool leaves the other half to the training step
# that shares the process (transformers' own default, 0.9, assumes inference alone).
# use_cuda_graph: graphs are captured per shape and re-captured as shapes drift; with weights changing
# every step and short runs, capture time is rarely paid back.
CB_DEFAULTS: dict[str, Any] = {"max_memory_percent": 0.5, "use_cuda_graph": False}
# Tokens per KV page on CPU, where no kernel wants large pages (cbkit's attention gathers keys by index). A page is
# the unit a request allocates and a group's prompt is shared in: with the engine's 256, a GSM8K prompt is never
# shared and every request holds 256 tokens from its first (lab/cpu_results.md has the RSS it costs).
CPU_PAGE_SIZE = 32
# Who runs the engine's loop. "auto": the caller's thread on CPU (faster there: lab/small_n.md), transformers'
# background thread elsewhere.
ENGINE_LOOPS = ("auto", "caller", "thread")
# A pool fixed in blocks (`num_blocks`) is sized already; `max_memory_percent` then only gates the engine's admission
# check (transformers' `PagedAttentionMemoryHandler._check_footprint`: the pool, its per-token buffers and, without
# flash attention, the attention mask must fit that share of the free memory). cbkit's 0.5 would refuse a pool sized
# for a training step's leftovers on a T4; 0.9 is transformers' own margin for temporary tensors.
FIXED_POOL_MEMORY_PERCENT = 0.9
# The engine's block-table decode path calls flash-attn's `flash_attn_with_kvcache` with the pool's pages, which it
# takes in multiples of 256 tokens (the engine's default page). With smaller pages cbkit turns that path off, and the
# engine decodes through its varlen path, as on a CPU.
KERNEL_PAGE_MULTIPLE = 256


def resolve_engine_loop(engine_loop: str, device: torch.device, cb_overrides: Mapping[str, Any] | None = None) -> str:
    """"caller" or "thread" for a call on `device`: "auto" is the caller's loop on CPU and the thread elsewhere, and
    the thread wherever the caller's loop cannot run the engine as the thread does (async batching); an explicit
    "caller" is refused there."""
    if engine_loop not in ENGINE_LOOPS:
        raise ValueError(f"engine_loop must be one of {', '.join(ENGINE_LOOPS)}; got {engine_loop!r}.")
    if engine_loop == "caller" and (cb_overrides or {}).get("use_async_batching"):
        raise ValueError("engine_loop='caller' cannot run async batching (use_async_batching=True overlaps two "
                         "batches across the loop's iterations); use engine_loop='thread', or drop the override.")
    if engine_loop == "auto":
        return "caller" if device.type == "cpu" and not (cb_overrides or {}).get("use_async_batching") else "thread"
    return engine_loop


def cb_config_keys() -> list[str]:
    from transformers import ContinuousBatchingConfig

    return sorted(f.name for f in dataclasses.fields(ContinuousBatchingConfig))


def cb_config_values(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """cbkit's defaults + the user's keys + `return_logprobs=True`, checked: the device-independent part of
    `make_cb_config`, and what the TRL bridge writes into TRL's config."""
    overrides = dict(overrides or {})
    # Tokens per KV page: page_size since transformers 5.17, block_size before (and in TRL configs written for it).
    if "block_size" in overrides:
        if overrides.get("page_size", overrides["block_size"]) != overrides["block_size"]:
            raise ValueError(f"page_size={overrides['page_size']!r} and block_size={overrides['block_size']!r} "
                             "are one setting, tokens per KV page; give one of them.")
        overrides["page_size"] = overrides.pop("block_size")
    valid = cb_config_keys()
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
    """cbkit's defaults + the user's overrides + what cbkit requires, validated with errors that say what to change.

    On CPU the engine would size its pool as a share of *host RAM*: gigabytes of zeroed KV for a small model. There
    cbkit sizes the pool to the workload instead: enough blocks for every request (`rows`) to run to
    `max_new_tokens` at once (the generation limit, never a replayed length, which a real engine cannot know in
    advance), unless the user set `num_blocks`. Pages are `CPU_PAGE_SIZE` tokens there unless the user set a size.
    `max_memory_percent` means a share of free *GPU* memory wherever it is written (TRL's CB config too), so on CPU
    it is ignored with a warning; `{"num_blocks": None}` lets the engine size the pool from memory anyway.
    lab/cpu_results.md has what the host-RAM sizing cost.
    """
    from transformers import ContinuousBatchingConfig

    overrides = dict(overrides or {})
    values = cb_config_values(overrides)
    cpu = device is not None and torch.device(device).type == "cpu"
    if cpu and "page_size" not in overrides and "block_size" not in overrides:
        values["page_size"] = CPU_PAGE_SIZE
    # cbkit chooses the attention itself (`engine_attention`, applied by the engine module); left on, the engine
    # switches to flash-attn whenever it is importable, which refuses fp32 weights and has no kernel on a T4.
    values["auto_switch_to_flash"] = False
    if (device is not None and torch.device(device).type == "cuda" and "max_blocks_per_request" not in overrides
            and page_size(values) % KERNEL_PAGE_MULTIPLE):
        values["max_blocks_per_request"] = 0
    mmp_default = CB_DEFAULTS["max_memory_percent"]
    workload = cpu_pool_blocks(overrides, rows, max_new_tokens, page_size(values)) if cpu else None
    if workload:
        # A max_memory_percent equal to cbkit's default is the default, not a choice (configs merge defaults in).
        if warn and overrides.get("max_memory_percent", mmp_default) != mmp_default:
            warnings.warn(f"max_memory_percent={overrides['max_memory_percent']} is a share of free GPU memory; on a "
                          f"CPU the engine would take that share of host RAM. cbkit sizes the CPU pool to the workload "
                          f"({workload} blocks) instead. Set num_blocks to fix the pool yourself, or num_blocks=None "
                          "to let the engine size it from max_memory_percent.", UserWarning, stacklevel=3)
        values["num_blocks"] = workload
    if values.get("num_blocks") is not None and "max_memory_percent" not in overrides:
        values["max_memory_percent"] = FIXED_POOL_MEMORY_PERCENT
    if seed is not None and "seed" not in overrides:
        values["seed"] = seed
    return ContinuousBatchingConfig(**values)


def workload_blocks(rows: Sequence[Sequence[int]], max_new_tokens: int, page_size: int) -> int:
    """Blocks for every request at full length at once, plus one spare (the engine reserves a trash block).
    Always the generation limit, never replayed targets: an engine cannot know a completion's length ahead."""
    return sum(-(-(len(r) + max_new_tokens) // page_size) for r in rows) + 1


def cpu_pool_blocks(overrides: Mapping[str, Any], rows: Sequence[Sequence[int]] | None, max_new_tokens: int | None,
                    page: int) -> int | None:
    """The CPU pool rule, in one place (`make_cb_config` and notebook 02's stock TRL step apply it): on a CPU a CB
    pool holds every request at the generation limit at once (`workload_blocks`, pages of ``page`` tokens), unless
    the caller's ``overrides`` set ``num_blocks`` (None included: the engine then sizes it from memory). None where
    the rule does not decide: ``num_blocks`` set, or no workload given."""
    if "num_blocks" in overrides or not rows or not max_new_tokens:
        return None
    return workload_blocks(rows, max_new_tokens, page)


# --- the attention the engine runs with --------------------------------------------------------------------------

# What the engine runs where a model needs its own attention (`varlen_unsupported_reason`): its SDPA path, with the
# dense block-diagonal mask (a model loaded with eager keeps eager, the engine's other dense path).
ENGINE_OWN = "sdpa"


def flash_versions() -> tuple[int, ...]:
    """The flash-attn versions installed here as packages, newest first. The hub fallback is not counted
    (`kernels_fallback_ok=False`): with the `kernels` package it says yes by fetching kernels from the Hub at the first
    forward, which an offline machine cannot, and which would put rollouts on a kernel no test has run."""
    from transformers.utils import import_utils

    found = [(3, import_utils.is_flash_attn_3_available), (2, import_utils.is_flash_attn_2_available)]
    return tuple(v for v, available in found if available(kernels_fallback_ok=False))


def engine_attention(device: torch.device | str, dtype: torch.dtype, capability: tuple[int, int] | None = None,
                     flash: Sequence[int] | None = None, needs_own: str | None = None) -> str:
    """The attention the CB engine runs with, decided by cbkit for every device (not by whether flash-attn happens to
    be importable, the engine's own rule): "flash_attention_3" on a Hopper (9.x), "flash_attention_2" on compute
    capability 8.0 or newer, both only for fp16/bf16 weights (a training policy's fp32 weights would crash them; a T4
    is 7.5) and only where that flash-attn is installed (``flash``); else cbkit's varlen attention (its registered
    name, `varlen_attention.NAME`), on a CPU, a T4, for fp32 weights and without flash-attn; else, where the model
    needs it (``needs_own``, `varlen_unsupported_reason`'s answer), the engine's own `ENGINE_OWN`, whose dense mask
    grows with the square of the batch. ``capability`` and ``flash`` default to this machine's
    (`torch.cuda.get_device_capability`, `flash_versions`), read only where they decide."""
    from cbkit.rollout.varlen_attention import NAME

    if torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        flash = flash_versions() if flash is None else flash
        if flash:
            capability = capability if capability is not None else torch.cuda.get_device_capability()
            if 3 in flash and capability[0] == 9:
                return "flash_attention_3"
            if 2 in flash and capability >= (8, 0):
                return "flash_attention_2"
    return ENGINE_OWN if needs_own else NAME


def page_size(config) -> int:
    """Tokens per KV page of a resolved ContinuousBatchingConfig or a dict of engine keys (the engine's default where
    none is set). The one page-size lookup: the backend, the planner and the TRL bridge call it."""
    from transformers import ContinuousBatchingConfig

    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    return int(get("page_size") or get("block_size") or ContinuousBatchingConfig().page_size)
