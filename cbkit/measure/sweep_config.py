"""What one sweep measures (`SweepConfig`, every field a `cbkit sweep` flag), checked before any model time, and what
makes two sweeps' runs comparable (its fingerprint, the results file's first line)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.measure.workload import LengthWorkload, parse_lengths
from cbkit.rollout import BACKENDS
from cbkit.train.config import _help

# CB with async rollouts (`AsyncRollouts`): step t+1's rollout decodes while step t trains. Not a `RolloutBackend`:
# only whole steps show what it buys, so a rollout-only sweep refuses it.
ASYNC_BACKEND = "continuous-async"

DEFAULT_NS = (8, 16, 32, 64)


@dataclass
class SweepConfig:
    """What one sweep measures; every field is a `cbkit sweep` flag with this help."""

    model: str = _help("smollm2-offline, tiny, a hub id or a local directory", default="smollm2-offline")
    data: str = _help("synthetic (offline), gsm8k-local, gsm8k[:split] (hub), or a .jsonl path", default="synthetic")
    num_prompts: int = _help("prompts per rollout", default=1)
    ns: tuple[int, ...] = _help("N values (completions per prompt), comma- or space-separated", default=DEFAULT_NS)
    backends: tuple[str, ...] = _help("backends to compare; generate must be one (ratios are to it)",
                                      default=("generate", "continuous"))
    repeats: int = _help("runs per point; the median is reported", default=2)
    max_new_tokens: int = _help("most tokens generated per completion", default=96)
    temperature: float = _help("sampling temperature", default=1.0)
    top_p: float = _help("nucleus sampling mass; 1.0 disables it", default=1.0)
    top_k: int = _help("keep the top_k most likely tokens; 0 disables it", default=0)
    seed: int = _help("seeds the prompts and every rollout's sampler", default=0)
    dtype: str | None = _help("float32 / bfloat16 / float16: the weights the rollouts run in (None: fp32 on CPU, bf16 "
                              "or fp16 on CUDA). With --full-step, the step's compute precision as `cbkit train`'s "
                              "dtype: fp32 weights, bf16 autocast where native (None: auto; float16 refused)",
                              default=None)
    cb_config: dict[str, Any] = _help("JSON overrides for the CB engine, e.g. '{\"max_memory_percent\": 0.4}'",
                                      default_factory=dict)
    full_step: bool = _help(
        "time a whole GRPO step (rollout + old-logprob forward + forward/backward/update) through cbkit's loop "
        "instead of the rollout alone, split by phase; the weights are restored after every step", default=False)
    forward_chunk_rows: int | None = _help(
        "--full-step only: completions per teacher-forced forward of the step (the loop's forward_chunk_rows; "
        "None: all rows in one forward)", default=4)
    async_steps: int = _help(
        f"--full-step with {ASYNC_BACKEND} in --backends: GRPO steps run per point. The first has no earlier step to "
        "overlap; every later one does (its next rollout decodes while it trains), and the point is their mean",
        default=3)
    trainer_state: bool = _help(
        "hold a training step's state on the device while measuring (a gradient and AdamW's two moments in the "
        "weights' dtype, as TRL holds them): a CB pool sized as a share of free memory is then a share of what the "
        "trainer leaves, as in TRL", default=False)
    lengths: str = _help(
        "how long each completion runs: replay:gsm8k (GSM8K solution lengths scaled so their p95 is "
        "--max-new-tokens, EOS ignored), fixed (all to the limit), natural (EOS decides), or replay:FILE (a "
        "natural sweep's JSONL or a list of lengths, replayed as they are)",
        default="replay:gsm8k")

    def __post_init__(self) -> None:
        self.ns = tuple(self.ns)
        self.backends = tuple(self.backends)
        if not self.ns or any(not isinstance(n, int) or n < 1 for n in self.ns):
            raise ValueError(f"ns must be positive integers, e.g. 8,16,32,64; got {list(self.ns)}.")
        unknown = [b for b in self.backends if b not in BACKENDS and b != ASYNC_BACKEND]
        if not self.backends or unknown:
            raise ValueError(f"Unknown backend(s) {unknown or '(none given)'}; choose from "
                             f"{sorted(BACKENDS)} (and {ASYNC_BACKEND} with --full-step).")
        if ASYNC_BACKEND in self.backends:
            if not self.full_step:
                raise ValueError(
                    f"{ASYNC_BACKEND} overlaps the next step's rollout with this step's training: only a whole GRPO "
                    f"step shows that. Add --full-step, or drop {ASYNC_BACKEND} from --backends.")
            if self.async_steps < 2:
                raise ValueError(f"async_steps must be >= 2 (the first step has nothing to overlap), got "
                                 f"{self.async_steps}.")
        if "generate" not in self.backends:
            raise ValueError("The sweep reports ratios to generate(): keep 'generate' in the backends.")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}.")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}.")
        # Read and checked here, before any model time: a missing file or a too-long length fails now.
        self._workload = parse_lengths(self.lengths)
        self._workload.check(self.max_new_tokens)
        if self.forward_chunk_rows is not None and self.forward_chunk_rows < 1:
            raise ValueError(f"forward_chunk_rows must be >= 1 or None, got {self.forward_chunk_rows}.")
        if self.full_step:  # a whole step trains fp32 weights; dtype is its autocast, refused here as the loop would
            from cbkit.models.load import training_precision

            training_precision(self.dtype or "auto", "cuda" if torch.cuda.is_available() else "cpu")

    @property
    def workload(self) -> LengthWorkload:
        return self._workload

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs comparable. ns, backends and repeats may grow between reruns; nothing else."""
        import transformers

        import cbkit

        keep = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ns", "backends", "repeats")}
        if not self.full_step:  # a rollout-only sweep runs no training forward: files from before the field resume
            keep.pop("forward_chunk_rows")
        if keep["async_steps"] == 3:  # the default: files written before the async row stay resumable
            del keep["async_steps"]
        if not keep["trainer_state"]:  # likewise
            del keep["trainer_state"]
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        # A replayed file may change under the same name: its contents are part of what makes runs comparable.
        w = self._workload
        digest = (hashlib.sha256(json.dumps(w.source_lengths).encode()).hexdigest()[:16]
                  if w.kind == "replay" else None)
        return {**keep, "lengths_digest": digest, "device": device, "torch": torch.__version__,
                "transformers": transformers.__version__, "cbkit": cbkit.__version__}
