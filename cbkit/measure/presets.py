"""`cbkit sweep --preset trl-benchmark`: TRL's benchmark setting (PR #5765) on one GPU, and its CPU-sized dry run."""

from __future__ import annotations

from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    # TRL PR #5765's setting with no network (scripts/gpu_check.sh): Llama-3.2-1B-Instruct's shape with random
    # weights, GSM8K solution lengths up to 2048 new tokens, a trainer's state held as TRL's trainer holds it.
    "trl-benchmark": dict(model="llama-1b-random", data="synthetic", num_prompts=4, ns=(8, 32, 64),
                          max_new_tokens=2048, repeats=1, dtype="bfloat16", lengths="replay:gsm8k", trainer_state=True),
}
# `--dry-run`: the same preset at test size on a CPU (same model family, workload kind and code path).
DRY_RUN: dict[str, Any] = dict(model="llama-tiny-random", num_prompts=2, ns=(2, 4), max_new_tokens=8, repeats=1,
                               dtype="float32")
TRAINER_STATE_COPIES = 3  # TRL's bf16 policy under CB: a gradient and AdamW's two moments in the weights' dtype


def trainer_state_bytes(model) -> int:
    return TRAINER_STATE_COPIES * sum(p.numel() * p.element_size() for p in model.parameters())


def check_preset_device(preset: str, *, dry_run: bool = False, dtype: str | None = None) -> None:
    """A GPU preset without CUDA, or in bf16 on a GPU that only emulates it (a T4), fails before any model loads."""
    from cbkit.models.load import DTYPES, native_bf16

    if dry_run:
        return
    if torch.cuda.is_available():
        run_dtype = dtype or PRESETS[preset].get("dtype")
        if run_dtype is not None and DTYPES.get(run_dtype) == torch.bfloat16 and not native_bf16():
            major, minor = torch.cuda.get_device_capability()
            raise ValueError(f"--preset {preset} runs in bfloat16, which {torch.cuda.get_device_name()} (compute "
                             f"capability {major}.{minor}) only emulates; add --dtype float16.")
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    raise ValueError(f"--preset {preset} needs one CUDA GPU with bf16 and ~40 GB free; no CUDA device is visible here "
                     f"(torch {torch.__version__}, {build}). Run it on a GPU machine, or add --dry-run to run the same "
                     "sweep at test size on this CPU.")
