"""`cbkit sweep --preset`: the settings a sweep is run with on a named GPU, what each needs, the CPU-sized dry run that
proves a GPU script where there is no GPU, and TRL's own benchmark the trl-benchmark preset sits beside."""

from __future__ import annotations

from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    # TRL's benchmark setting (PR #5765) with no network (scripts/gpu_check.sh): Llama-3.2-1B-Instruct's shape with
    # random weights, synthetic prompts, GSM8K solution lengths replayed up to 2048 new tokens; <= 8 minutes on one
    # A100/H100/H200. TRL's pool is a share of what its trainer leaves free, so the sweep holds a training step's state
    # while it measures (`trainer_state`). `cbkit tiers` checks both backends at the largest point on an A100-40.
    "trl-benchmark": dict(model="llama-1b-random", data="synthetic", num_prompts=4, ns=(8, 32, 64),
                          max_new_tokens=2048, repeats=1, dtype="bfloat16", lengths="replay:gsm8k", trainer_state=True),
    # TRL's benchmark setting with the real model from the hub, for an A100-80GB (about 10 minutes).
    "a100": dict(model="meta-llama/Llama-3.2-1B-Instruct", data="gsm8k:test", num_prompts=8,
                 max_new_tokens=512, repeats=3, dtype="bfloat16"),
    # A Colab T4 (16 GB, no bf16): a smaller model in fp16.
    "t4": dict(model="HuggingFaceTB/SmolLM2-360M-Instruct", data="gsm8k:test", num_prompts=4,
               max_new_tokens=256, repeats=3, dtype="float16"),
}
PRESET_NEEDS = {
    "trl-benchmark": "one CUDA GPU with bf16 and ~40 GB free (A100/H100/H200-class)",
    "a100": "one CUDA GPU with bf16 and ~40 GB free (A100-class), and Llama-3.2-1B-Instruct from the hub or its cache",
    "t4": "one CUDA GPU with ~12 GB free (a Colab T4), and SmolLM2-360M-Instruct from the hub or its cache",
}
# `--dry-run`: the same preset at test size on a CPU (same model family, workload kind and code path).
DRY_RUN: dict[str, Any] = dict(model="llama-tiny-random", num_prompts=2, ns=(2, 4), max_new_tokens=8, repeats=1,
                               dtype="float32")
# huggingface/trl PR #5765 (A100-80GB, Llama-3.2-1B-Instruct, GSM8K, up to 2048 new tokens): seconds per generation
# with generate() and with CB, and CB's VRAM minus generate()'s, in GB.
TRL_PR_5765: dict[int, tuple[float, float, float]] = {8: (18.24, 18.16, 17.86), 32: (37.06, 29.91, 7.39),
                                                      64: (41.12, 32.84, -16.66)}
# What TRL's trainer keeps beside the weights between updates under bf16 with CB: it casts the policy to bf16
# (GRPOTrainer._generate_single_turn), so a gradient and AdamW's two moments (`torch.zeros_like(param)`) are bf16.
TRAINER_STATE_COPIES = 3


def trainer_state_bytes(model) -> int:
    """A trainer's state between updates, as TRL holds it: 3 copies of the weights in their dtype (6 bytes a bf16
    parameter)."""
    return TRAINER_STATE_COPIES * sum(p.numel() * p.element_size() for p in model.parameters())


def check_preset_device(preset: str, *, dry_run: bool = False, dtype: str | None = None) -> None:
    """A GPU preset on a machine without CUDA fails here, naming what it needs, before anything is loaded; so does a
    bf16 preset on a GPU that only emulates bf16 (a T4), where the timing would measure the emulation."""
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
    raise ValueError(f"--preset {preset} needs {PRESET_NEEDS[preset]}; no CUDA device is visible here (torch "
                     f"{torch.__version__}, {build}). Run it on a GPU machine, or add --dry-run (CBKIT_DRY_RUN=1 bash "
                     "scripts/gpu_check.sh) to run the same sweep at test size on this CPU.")
