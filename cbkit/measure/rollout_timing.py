"""One timed rollout of the sweep, and what it records: its speed, its peak memory, its completion lengths (each,
and their spread) and the KV it needed. A run that runs out of memory becomes a record, not a crash.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from cbkit.measure.workload import decode_padding_share, length_stats
from cbkit.rollout import SamplingParams


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def oom_record(e: BaseException, mem) -> dict[str, Any]:
    """A run that ran out of memory: its first error line and the peak its PeakMemory saw before."""
    return {"status": "oom", "error": str(e).splitlines()[0][:300], "peak_mem_bytes": mem.peak_bytes,
            "peak_mem_kind": mem.kind}


def measure_run(backend, prompts, n: int, sampling: SamplingParams, config, dtype_bytes: int,
                target_lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """One timed rollout and what it cost; an OOM becomes a record, not a crash. ``target_lengths`` (one per
    completion row) replays a length workload; None lets EOS decide."""
    from cbkit.telemetry import kv_accounting, nvml_process_bytes

    try:
        if target_lengths is None:
            rollout = backend.generate(prompts, n, sampling)
        else:
            rollout = backend.generate(prompts, n, sampling, target_lengths=target_lengths)
    except Exception as e:
        if not is_oom(e):
            raise
        cuda = torch.cuda.is_available()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        if cuda:
            torch.cuda.empty_cache()
        return {"status": "oom", "error": str(e).splitlines()[0][:300], "peak_mem_bytes": peak,
                "peak_mem_kind": "cuda_allocated" if cuda else None, "nvml_bytes": nvml_process_bytes()}
    lengths = [len(c.completion_ids) for c in rollout.completions]
    return {
        "status": "ok",
        "rollout_s": rollout.wall_s,
        "completion_tokens": rollout.completion_tokens,
        "tokens_per_s": rollout.tokens_per_s,
        "peak_mem_bytes": rollout.peak_mem_bytes,
        "peak_mem_kind": rollout.peak_mem_kind,
        "nvml_bytes": nvml_process_bytes(),
        "truncated_share": statistics.mean(c.finish_reason == "length" for c in rollout.completions),
        **lengths_record(lengths),
        "engine_config": rollout.engine_config,
        **kv_accounting(rollout, config, dtype_bytes),
    }


def lengths_record(lengths: Sequence[int]) -> dict[str, Any]:
    """What a run line records about its completion lengths: each of them (so a later sweep can replay them),
    their mean / CV / max, and the share of a static batch's decode slots they leave as padding (one batch of
    every row, as generate() runs them)."""
    stats = length_stats(lengths)
    return {"completion_lengths": list(lengths), "length_mean": stats["mean"], "length_cv": stats["cv"],
            "length_max": stats["max"], "decode_padding_share": decode_padding_share(lengths)}


# What TRL's trainer keeps beside the weights between updates: a gradient and AdamW's two moments, each in the
# weights' own dtype. Under bf16 with CB, TRL casts the policy itself to bf16 (`unwrapped_model.to(torch.bfloat16)`
# in GRPOTrainer._generate_single_turn); the backward then makes bf16 gradients, torch's AdamW its moments with
# `torch.zeros_like(param)` (torch/optim/adam.py, `_init_group`), and accelerate's bf16 is autocast with no fp32 master
# copy: 2 + 2 + 2 = 6 bytes a parameter, not the 12 of fp32 gradients and moments.
TRAINER_STATE_COPIES = 3


def trainer_state_bytes(model) -> int:
    """What a training step keeps on the device between updates beside the weights, as TRL does
    (`TRAINER_STATE_COPIES`): a gradient and AdamW's two moments in the weights' dtype, 6 bytes a parameter in bf16."""
    return TRAINER_STATE_COPIES * sum(p.numel() * p.element_size() for p in model.parameters())
