"""What one sweep measures, checked before any model time, and its fingerprint (the results file's first line);
`--preset trl-benchmark`, TRL's benchmark setting (PR #5765) on one GPU, and its CPU-sized dry run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from cbkit import __version__
from cbkit.measure.workload import LengthWorkload, parse_lengths
from cbkit.models.load import DTYPES, native_bf16, training_precision
from cbkit.rollout import BACKENDS
from cbkit.train.config import _help


@dataclass
class SweepConfig:
    """What one sweep measures; every field is a `cbkit sweep` flag with this help."""

    model: str = _help("smollm2-offline, tiny, a hub id or a local directory", default="smollm2-offline")
    data: str = _help("synthetic (offline), gsm8k-local, gsm8k[:split] (hub), or a .jsonl path", default="synthetic")
    num_prompts: int = _help("prompts per rollout", default=1)
    ns: tuple[int, ...] = _help("N values (completions per prompt), comma- or space-separated", default=(8, 16, 32, 64))
    backends: tuple[str, ...] = _help("backends to compare; generate must be one (ratios are to it)",
                                      default=("generate", "continuous"))
    repeats: int = _help("runs per point; the median is reported", default=2)
    max_new_tokens: int = _help("most tokens generated per completion", default=96)
    temperature: float = _help("sampling temperature", default=1.0)
    top_p: float = _help("nucleus sampling mass; 1.0 disables it", default=1.0)
    top_k: int = _help("keep the top_k most likely tokens; 0 disables it", default=0)
    seed: int = _help("seeds the prompts and every rollout's sampler", default=0)
    dtype: str | None = _help("float32 / bfloat16 / float16: the rollouts' weights (None: fp32 on CPU, bf16 or fp16 on "
                              "CUDA); with --full-step, the step's autocast as `cbkit train`'s dtype", default=None)
    cb_config: dict[str, Any] = _help("JSON overrides for the CB engine, e.g. '{\"max_memory_percent\": 0.4}'",
                                      default_factory=dict)
    full_step: bool = _help("time a whole GRPO step through cbkit's loop, split by phase, instead of the rollout "
                            "alone; the weights are restored after every step", default=False)
    forward_chunk_rows: int | None = _help("--full-step only: the loop's forward_chunk_rows (None: one forward)",
                                           default=4)
    trainer_state: bool = _help("hold a gradient and AdamW's two moments in the weights' dtype on the device while "
                                "measuring, so a CB pool sized as a share of free memory is one of what a trainer "
                                "leaves, as in TRL", default=False)
    lengths: str = _help("how long each completion runs: replay:gsm8k (GSM8K solution lengths, p95 scaled to "
                         "--max-new-tokens), fixed (all to the limit) or natural (EOS decides)", default="replay:gsm8k")

    def __post_init__(self) -> None:
        self.ns = tuple(self.ns)
        self.backends = tuple(self.backends)
        if not self.ns or any(not isinstance(n, int) or n < 1 for n in self.ns):
            raise ValueError(f"ns must be positive integers, e.g. 8,16,32,64; got {list(self.ns)}.")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if not self.backends or unknown:
            raise ValueError(f"Unknown backend(s) {unknown or '(none given)'}; choose from {sorted(BACKENDS)}.")
        if "generate" not in self.backends:
            raise ValueError("The sweep reports ratios to generate(): keep 'generate' in the backends.")
        for name in ("repeats", "num_prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        self.workload: LengthWorkload = parse_lengths(self.lengths)  # checked before any model time
        if self.forward_chunk_rows is not None and self.forward_chunk_rows < 1:
            raise ValueError(f"forward_chunk_rows must be >= 1 or None, got {self.forward_chunk_rows}.")
        if self.full_step:  # a whole step trains fp32 weights; dtype is its autocast, refused here as the loop would
            training_precision(self.dtype or "auto", "cuda" if torch.cuda.is_available() else "cpu")

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs comparable. ns, backends and repeats may grow between reruns; nothing else."""
        keep = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ns", "backends", "repeats")}
        if not self.full_step:  # a rollout-only sweep runs no training forward
            keep.pop("forward_chunk_rows")
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        return {**keep, "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                "cbkit": __version__}


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


def check_preset_device(preset: str, *, dtype: str | None = None) -> None:
    """A GPU preset without CUDA, or in bf16 on a GPU that only emulates it (a T4), fails before any model loads."""
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
