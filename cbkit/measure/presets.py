"""`cbkit sweep --preset`: the settings a sweep is run with on a named machine, what each needs, the CPU-sized dry
run that proves a GPU script where there is no GPU, and TRL's own benchmark the trl-benchmark preset sits beside.
"""

from __future__ import annotations

from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    # TRL's benchmark setting (PR #5765) on a GPU machine with no network (scripts/gpu_check.sh): Llama-3.2-1B-Instruct's exact
    # shape with random weights, synthetic GSM-style prompts, GSM8K solution lengths replayed up to the benchmark's
    # 2048 new tokens. Sized for <= 8 minutes on one A100/H100/H200 (the estimate is in the script).
    # TRL's CB pool is max_memory_percent=0.5 of what its trainer leaves free, so the sweep holds a training step's
    # state on the GPU while it measures (`trainer_state`: bf16 gradients and AdamW moments, 6 bytes a parameter, as
    # TRL holds them after its bf16 cast, `rollout_timing.TRAINER_STATE_COPIES`): both backends then see the memory
    # they would in TRL. `cbkit tiers` checks both at the largest point on an A100-40 (`plan_presets`).
    "trl-benchmark": dict(model="llama-1b-random", data="synthetic", num_prompts=4, ns=(8, 32, 64), max_new_tokens=2048,
                 repeats=1, dtype="bfloat16", lengths="replay:gsm8k", trainer_state=True),
    # TRL's benchmark setting with the real model from the hub; sized for an A100-80GB (about 10 minutes).
    "a100": dict(model="meta-llama/Llama-3.2-1B-Instruct", data="gsm8k:test", num_prompts=8,
                 max_new_tokens=512, repeats=3, dtype="bfloat16"),
    # A Colab T4 (16 GB, no bf16): a smaller model in fp16.
    "t4": dict(model="HuggingFaceTB/SmolLM2-360M-Instruct", data="gsm8k:test", num_prompts=4,
               max_new_tokens=256, repeats=3, dtype="float16"),
}


# What a preset needs, said before any model is loaded.
PRESET_NEEDS = {
    "trl-benchmark": "one CUDA GPU with bf16 and ~40 GB free (A100/H100/H200-class): Llama-3.2-1B's shape at N up to 64 "
            "and 2048 new tokens",
    "a100": "one CUDA GPU with bf16 and ~40 GB free (A100-class), and Llama-3.2-1B-Instruct from the hub or its cache",
    "t4": "one CUDA GPU with ~12 GB free (a Colab T4), and SmolLM2-360M-Instruct from the hub or its cache",
}


# `--dry-run`: the same preset at test size on CPU (same model family, same workload kind, same code path), to
# prove the GPU script end to end where there is no GPU: CI runs it in a venv with only torch + transformers.
DRY_RUN: dict[str, Any] = dict(model="llama-tiny-random", num_prompts=2, ns=(2, 4), max_new_tokens=8, repeats=1,
                               dtype="float32")


def check_preset_device(preset: str, *, dry_run: bool = False, dtype: str | None = None) -> None:
    """A GPU preset on a machine without CUDA fails here, naming the preset and what it needs, before
    anything is loaded; a dry run is the way to try it without one. So does a bf16 preset on a GPU that only
    emulates bf16 (a T4), where the timing would measure the emulation."""
    from cbkit.models.load import DTYPES, native_bf16

    if dry_run:
        return
    if torch.cuda.is_available():
        run_dtype = dtype or PRESETS[preset].get("dtype")
        if run_dtype is not None and DTYPES.get(run_dtype) == torch.bfloat16 and not native_bf16():
            major, minor = torch.cuda.get_device_capability()
            raise ValueError(
                f"--preset {preset} runs in bfloat16, which {torch.cuda.get_device_name()} (compute capability "
                f"{major}.{minor}) only emulates; add --dtype float16."
            )
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    raise ValueError(
        f"--preset {preset} needs {PRESET_NEEDS[preset]}; no CUDA device is visible here (torch {torch.__version__}, "
        f"{build}). Run it on a GPU machine, or add --dry-run (CBKIT_DRY_RUN=1 bash scripts/gpu_check.sh) to run "
        "the same sweep at test size on this CPU."
    )


# --- TRL's benchmark: TRL PR #5765 beside this run ----------------------------------------------------------------

# huggingface/trl PR #5765 (A100-80GB, Llama-3.2-1B-Instruct, GSM8K, up to 2048 new tokens): seconds per
# generation with generate() and with CB, and CB's VRAM minus generate()'s, in GB.
TRL_PR_5765: dict[int, tuple[float, float, float]] = {8: (18.24, 18.16, 17.86), 32: (37.06, 29.91, 7.39),
                                                      64: (41.12, 32.84, -16.66)}
