"""The N-sweep: both backends side by side at growing N, resumable, honest about what it measured.

The claim under test (A100-80GB, Llama-3.2-1B-Instruct, GSM8K): CB is at parity with `generate()` at N=8,
~1.25x faster at N=32 and N=64, and at N=64 uses *less* memory, because `generate()` holds KV for every
row at the padded length while CB fills a fixed pool and recycles blocks as sequences finish.

How a sweep runs, and why:
* one process, one model load; one warm-up call per backend before anything is timed;
* for every N, `repeats` runs of every backend, the backend order alternating between repeats (and
  between Ns) so neither backend always runs on a warmer machine; the point is the median of its runs;
* each finished run is appended to the results JSONL at once; a rerun reads the file and skips what is
  there, so Ctrl-C or a crash loses at most the run in flight. The file's first line records the
  configuration, and a rerun with a different one is refused rather than mixed into the same table;
* a run that runs out of memory is recorded as `oom` with the memory figures it reached, and the sweep
  goes on to the next point;
* speed and memory are reported as ratios to `generate()` at the same N, measured in the same process;
* the length workload (`cbkit.measure.workload`; default ``replay:gsm8k``) decides how long each completion runs.
  Both backends get the same targets at a point, and every run line records the workload, the
  per-completion lengths, their mean / CV / max and the share of a static batch's decode slots those
  lengths leave as padding: the spread CB has to win back, printed next to the speed it won;
* the limit beside the number: a probe of both roofs of this machine (matmul FLOP/s at the model's dtype and width,
  read bandwidth) runs at the sweep's start and again before every N, so a noisy machine shows as the spread of
  the probes; each run records the probe next to it, its model FLOP utilisation (MFU) and its share of the
  attainable tokens/s of its own shape (`measure/roofline.py`: FLOPs and bytes of every decode step, the lower
  roof binding). A probe that cannot run leaves those columns empty and the run line says why: no roof is made up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cbkit.measure.probe import machine_probe, matmul_params, mfu
from cbkit.measure.results import ResultsFile, aggregate
from cbkit.measure.workload import LengthWorkload, decode_padding_share, length_stats, parse_lengths
from cbkit.rollout import BACKENDS, SamplingParams
from cbkit.train.config import _help

DEFAULT_NS = (8, 16, 32, 64)
# A full-step-only backend: the continuous backend with async rollouts (`cbkit.train.offpolicy.AsyncRollouts`), step
# t+1's rollout decoding in transformers' thread while step t trains. Not a `RolloutBackend`: only a whole step (in
# fact several) can show what it buys, so a rollout-only sweep refuses it.
ASYNC_BACKEND = "continuous-async"
# The async row's update lands after every forward of the rollout it meets (`async_update_at` past any rollout's
# forwards): the trainer publishes once the queued rollout has finished, so the step takes max(training, rollout),
# every token is exactly one update old, and the timing is what a GPU run gets when the update would land at the
# end of training. A pinned early forward (the loop's default, for reproducible runs) would park the engine for
# most of the training and hide little.
AFTER_THE_ROLLOUT = 2**31 - 1

PRESETS: dict[str, dict[str, Any]] = {
    # TRL's benchmark setting (PR #5765) on a GPU machine with no network (scripts/gpu_sweep.sh): Llama-3.2-1B-Instruct's exact
    # shape with random weights, synthetic GSM-style prompts, GSM8K solution lengths replayed up to the benchmark's
    # 2048 new tokens. Sized for <= 8 minutes on one A100/H100/H200 (the estimate is in the script).
    # TRL's CB pool is max_memory_percent=0.5 of what its trainer leaves free, so the sweep holds a training step's
    # state on the GPU while it measures (`trainer_state`): both backends then see the memory they would in TRL.
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
        if DTYPES.get(dtype or PRESETS[preset].get("dtype")) == torch.bfloat16 and not native_bf16():
            major, minor = torch.cuda.get_device_capability()
            raise ValueError(
                f"--preset {preset} runs in bfloat16, which {torch.cuda.get_device_name()} (compute capability "
                f"{major}.{minor}) only emulates; add --dtype float16 (DTYPE=float16 for scripts/gpu_sweep.sh)."
            )
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    raise ValueError(
        f"--preset {preset} needs {PRESET_NEEDS[preset]}; no CUDA device is visible here (torch {torch.__version__}, "
        f"{build}). Run it on a GPU machine, or add --dry-run (CBKIT_DRY_RUN=1 bash scripts/gpu_sweep.sh) to run "
        "the same sweep at test size on this CPU."
    )


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
    cpu_attention: str = _help(
        "the CB engine's attention on CPU: batched (decoding sequences in one call, cbkit's default), per_sequence "
        "(one call per sequence) or engine (its own dense block-diagonal mask, quadratic in the batch): the "
        "'befores' of the CPU tuning, side by side", default="batched")
    engine_loop: str = _help(
        "who runs the CB engine's loop: auto (the caller's thread on CPU, transformers' thread on a GPU), caller "
        "or thread", default="auto")
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
        "hold a training step's state on the device while measuring (its fp32 gradients and AdamW's two fp32 "
        "moments: 12 bytes a parameter, beside the weights), as a rollout inside a trainer sees the memory: a CB "
        "pool sized as a share of free memory (max_memory_percent) is then a share of what the trainer leaves, as "
        "in TRL", default=False)
    lengths: str = _help(
        "how long each completion runs: replay:gsm8k (GSM8K solution lengths scaled so their p95 is "
        "--max-new-tokens, EOS ignored), fixed (all to the limit), natural (EOS decides), or replay:FILE (a "
        "natural sweep's JSONL or a list of lengths, replayed as they are)",
        default="replay:gsm8k")

    def __post_init__(self) -> None:
        from cbkit.rollout.cpu_attention import CPU_ATTENTION
        from cbkit.rollout.engine_config import resolve_engine_loop

        if self.cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION)}; got {self.cpu_attention!r}.")
        resolve_engine_loop(self.engine_loop, torch.device("cpu"), self.cb_config)
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
            if self.cpu_attention != "batched":
                raise ValueError(f"{ASYNC_BACKEND} runs the engine with the batched CPU attention; drop "
                                 f"--cpu-attention {self.cpu_attention} or {ASYNC_BACKEND}.")
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
        if keep["engine_loop"] == "auto":  # what every file written before the knob ran: they stay resumable
            del keep["engine_loop"]
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


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _oom_record(e: BaseException, mem) -> dict[str, Any]:
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
        if not _is_oom(e):
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


class _Replayed:
    """A backend whose every rollout stops each completion at its drawn target: the length workload replayed inside
    the GRPO loop, which asks for rollouts without targets."""

    def __init__(self, backend, targets: Sequence[int]) -> None:
        self.backend, self.targets, self.name = backend, list(targets), backend.name

    def generate(self, prompts, num_generations, sampling, *, prompt_names=None, target_lengths=None):
        return self.backend.generate(prompts, num_generations, sampling, prompt_names=prompt_names,
                                     target_lengths=self.targets if target_lengths is None else target_lengths)


def _time_phases(trainer) -> dict[str, float]:
    """Seconds spent in this trainer's `prepare` (the old-logprob forward, with the advantages and IS weights around
    it) and `optimize` (forwards, backwards and the optimizer step): the instance's methods wrapped, nothing else
    changed. CUDA is synchronised before each clock is read, so queued kernels count in their own phase."""
    spent = {"old_logprob_s": 0.0, "update_s": 0.0}

    def timed(inner, key: str):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                spent[key] += time.perf_counter() - start
        return run

    trainer.prepare = timed(trainer.prepare, "old_logprob_s")
    trainer.optimize = timed(trainer.optimize, "update_s")
    return spent


def _keep_weights(model):
    """The weights a measured step puts back afterwards: on a CPU in a file (a second copy of the model would sit
    in RAM beside the step's own peak), on a GPU in device memory."""
    from cbkit.train.snapshots import WeightSnapshots

    kept = WeightSnapshots(1, "disk" if model.device.type == "cpu" else "device")
    kept.append(0, model)
    return kept


def _put_back(model, kept) -> None:
    """Read the kept weights back into `model` and release what the step left: its gradients, the trainer
    the caller has dropped (collected, cycles included) and the heap it freed, so the next point starts where this one
    did."""
    from cbkit.telemetry import release_memory

    kept.load_into(model)
    kept.close()
    release_memory(model)


def _collect_garbage() -> None:
    """Free what the last point left in reference cycles before this one's memory baseline is read. A trainer is such
    a cycle (its timed methods hold the trainer, `_time_phases`), and with it its AdamW moments (8 bytes a
    parameter): left to the cyclic collector, they sit in the next point's baseline and are freed, and their heap
    reused, at whatever moment the collector runs inside that step, which takes up to their size off its peak."""
    import gc

    gc.collect()


def measure_full_step(cfg: SweepConfig, setup, backend, n: int, rep: int, targets: Sequence[int] | None = None,
                      probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """One GRPO step through cbkit's loop with this backend, split by phase: the rollout (its own wall clock),
    the old-logprob forward, the update, and the rest (rewards, batching, bookkeeping: what none of the three
    is). Peak memory covers the whole step. ``targets`` replays a length workload (each completion stops at its
    target); None lets EOS decide. With a ``probe``, each phase gets its share of its roof. The weights are put
    back afterwards."""
    from cbkit.telemetry import PeakMemory
    from cbkit.train.grpo import GRPOTrainer

    model, problems = setup.model, setup.problems
    saved = _keep_weights(model)
    config = _step_config(cfg, n, rep, len(problems), max_steps=1,
                          use_transformers_continuous_batching=backend.name == "continuous")
    step_backend = backend if targets is None else _Replayed(backend, targets)
    seen = _rollout_seen()
    trainer = GRPOTrainer(config, policy=(model, setup.tokenizer), backend=step_backend, problems=problems,
                          hooks=[seen])
    spent = _time_phases(trainer)
    _collect_garbage()
    try:
        with PeakMemory(model.device) as mem:
            record = trainer.step()
            mem.synchronize()
    except Exception as e:
        if not _is_oom(e):
            raise
        return _oom_record(e, mem)
    finally:
        del trainer  # its AdamW state and gradients, before the weights are read back
        _put_back(model, saved)
    m, rollout = record.metrics, seen.rollout
    lengths = [len(c.completion_ids) for c in rollout.completions]
    tokens = sum(lengths)
    step_s, rollout_s = m["step/seconds"], m["rollout/seconds"]
    measured = {
        "status": "ok",
        "step_s": step_s,
        "rollout_s": rollout_s,
        "train_s": m["train/seconds"],
        "old_logprob_s": spent["old_logprob_s"],
        "update_s": spent["update_s"],
        "other_s": step_s - rollout_s - spent["old_logprob_s"] - spent["update_s"],
        "rollout_share": rollout_s / step_s,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / step_s,  # completion tokens per second of whole step
        "rollout_tokens_per_s": tokens / rollout_s if rollout_s else None,
        "peak_mem_bytes": mem.peak_bytes,
        "peak_mem_kind": mem.kind,
        "truncated_share": statistics.mean(c.finish_reason == "length" for c in rollout.completions),
        **lengths_record(lengths),
        "reward_mean": m.get("reward/mean"),
        "forward_chunk_rows": cfg.forward_chunk_rows,
        "prompt_lens": [len(c.prompt_ids) for c in rollout.completions[::n]],  # one per prompt (group order)
        "engine_config": rollout.engine_config,
    }
    if probe is not None:
        measured.update(step_roof_record(model, rollout, measured, probe, config))
    return measured


def measure_async_steps(cfg: SweepConfig, setup, n: int, rep: int, targets: Sequence[int] | None = None,
                        probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """`continuous-async`: ``cfg.async_steps`` GRPO steps of cbkit's loop with async rollouts (`AsyncRollouts`), each
    later step's rollout decoding in transformers' thread while the step before it trains.

    Step 1 has nothing to overlap (its rollout is queued and waited for), so the point is the mean of the steps
    after it, each with its successor's rollout in flight (the trainer is configured one step longer than it
    runs). The rollout's part of such a step is what the trainer waited for it: at the step's start for the
    queued rollout (``offpolicy/rollout_wait_s``) and at the publish for the next one to finish
    (``offpolicy/publish_wait_s``, as the update lands after the whole rollout, `AFTER_THE_ROLLOUT`); its own wall
    clock, overlapping the training, is ``rollout_wall_s``. What the overlap bought, the synchronous CB rollout
    minus this wait, needs the continuous point beside it (`results.aggregate`). Every rollout replays
    ``targets``. The weights are put back and the engine closed (no thread left), whatever happened."""
    from cbkit.telemetry import PeakMemory
    from cbkit.train.grpo import GRPOTrainer

    model, problems = setup.model, setup.problems
    saved = _keep_weights(model)
    config = _step_config(cfg, n, rep, len(problems), use_transformers_continuous_batching=True, async_rollouts=True,
                          async_update_at=AFTER_THE_ROLLOUT, max_steps=cfg.async_steps + 1,
                          transformers_continuous_batching_config=dict(cfg.cb_config))
    seen = _rollout_seen()
    trainer = GRPOTrainer(config, policy=(model, setup.tokenizer), problems=problems, hooks=[seen])
    trainer.offpolicy.target_lengths = None if targets is None else list(targets)
    spent = _time_phases(trainer)
    steps: list[dict[str, float]] = []
    mem = PeakMemory(model.device)
    _collect_garbage()
    try:
        with mem:
            for _ in range(cfg.async_steps):
                spent.update(old_logprob_s=0.0, update_s=0.0)
                steps.append({**trainer.step().metrics, **spent})
            mem.synchronize()
    except Exception as e:
        if not _is_oom(e):
            raise
        return _oom_record(e, mem)
    finally:
        trainer.close()  # stops the engine thread; the rollout of the step never run is dropped uncollected
        del trainer
        _put_back(model, saved)
    steady = steps[1:]

    def mean(key: str) -> float:
        return statistics.mean(s[key] for s in steady)

    waits = [s["offpolicy/rollout_wait_s"] + s.get("offpolicy/publish_wait_s", 0.0) for s in steady]
    rollout = seen.rollout
    lengths = [len(c.completion_ids) for c in rollout.completions]
    tokens = sum(lengths)
    step_s, wait_s, wall_s = mean("step/seconds"), statistics.mean(waits), mean("rollout/seconds")
    old_s, update_s = mean("old_logprob_s"), mean("update_s")
    measured = {
        "status": "ok",
        "step_s": step_s,
        "rollout_s": wait_s,  # the rollout's part of the step: what the trainer waited for it
        "rollout_wait_s": mean("offpolicy/rollout_wait_s"),
        "publish_wait_s": statistics.mean(s.get("offpolicy/publish_wait_s", 0.0) for s in steady),
        "rollout_wall_s": wall_s,
        "train_s": mean("train/seconds"),
        "old_logprob_s": old_s,
        "update_s": update_s,
        "other_s": step_s - wait_s - old_s - update_s,
        "rollout_share": wait_s / step_s,
        "steady_steps": len(steady),
        "first_step_s": steps[0]["step/seconds"],
        "step_s_each": [s["step/seconds"] for s in steps],
        "staleness_max": max(s.get("offpolicy/staleness_max", 0.0) for s in steady),
        "regenerated": sum(s.get("offpolicy/regenerated", 0.0) for s in steady),
        "async_update_at": "after the rollout",
        "completion_tokens": tokens,
        "tokens_per_s": tokens / step_s,  # completion tokens per second of whole step
        "rollout_tokens_per_s": tokens / wall_s if wall_s else None,
        "peak_mem_bytes": mem.peak_bytes,
        "peak_mem_kind": mem.kind,
        "truncated_share": statistics.mean(c.finish_reason == "length" for c in rollout.completions),
        **lengths_record(lengths),
        "reward_mean": mean("reward/mean") if all("reward/mean" in s for s in steady) else None,
        "forward_chunk_rows": cfg.forward_chunk_rows,
        "prompt_lens": [len(c.prompt_ids) for c in rollout.completions[::n]],
        "engine_config": rollout.engine_config,
    }
    if probe is not None:
        roofs = step_roof_record(model, rollout, measured, probe, config)
        # The rollout's roof share is of its own wall clock (while the training ran beside it), not of the wait
        # the step's rollout column holds: kept under its own name, so no cell divides one by the other.
        roofs["rollout_wall_roof_share"], roofs["rollout_roof_share"] = roofs["rollout_roof_share"], None
        measured.update(roofs)
    return measured


def _step_config(cfg: SweepConfig, n: int, rep: int, prompts: int, **kw: Any):
    """The loop's config for a full-step point: the sweep's sampling, lengths and chunking, no output, no bar."""
    from cbkit.train.config import CBGRPOConfig

    return CBGRPOConfig(
        model=cfg.model, data=cfg.data, num_generations=n, prompts_per_step=prompts,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        seed=cfg.seed + rep, output_dir=None, disable_tqdm=True, forward_chunk_rows=cfg.forward_chunk_rows,
        dtype=cfg.dtype or "auto", **kw)


def _rollout_seen():
    """A step hook keeping the last rollout the loop produced (`StepHooks` imported here, as the loop is)."""
    from cbkit.train.hooks import StepHooks

    class Seen(StepHooks):
        rollout = None

        def on_rollout_end(self, rollout) -> None:
            self.rollout = rollout

    return Seen()


def step_roof_record(model, rollout, measured: dict[str, Any], probe: dict[str, Any], config) -> dict[str, Any]:
    """Each phase of a full step against its roof on the probed machine: the rollout's (`roof_record`: the decode
    steps of its shape), the old-logprob forward's and the update's (`roofline.training_roofline`: the FLOPs of
    every real token, the weights read once a chunk, AdamW's pass). A share is roof seconds over measured seconds.
    Without both peaks every share is None and ``roof_missing`` says why."""
    from cbkit.measure.roofline import training_roofline

    comps, n = rollout.completions, rollout.num_generations
    prompts = [comps[g * n].prompt_ids for g in range(len(comps) // n)]  # completions come in group order
    dtype_bytes = model.dtype.itemsize
    roll = roof_record(model.config, prompts, {"completion_lengths": measured["completion_lengths"],
                                               "tokens_per_s": measured["rollout_tokens_per_s"]}, probe, dtype_bytes)
    out = {"rollout_roof_s": roll.get("roof_seconds"), "rollout_roof_share": roll["roof_share"],
           "rollout_roof_bound": roll["roof_bound"], "bytes_per_s": probe.get("bytes_per_s"),
           "old_logprob_roof_s": None, "old_logprob_roof_share": None, "update_roof_s": None,
           "update_roof_share": None}
    if "roof_missing" in roll:
        return {**out, "roof_missing": roll["roof_missing"]}
    micro = len(comps) // config.gradient_accumulation_steps
    chunk = micro if config.forward_chunk_rows is None else min(config.forward_chunk_rows, micro)
    forwards = config.gradient_accumulation_steps * -(-micro // chunk)
    roofs = training_roofline(model.config, rows=[(len(c.prompt_ids), len(c.completion_ids)) for c in comps],
                              forwards=forwards, params=sum(p.numel() for p in model.parameters()),
                              dtype_bytes=dtype_bytes, peak_flops=probe["peak_flops"],
                              bytes_per_s=probe["bytes_per_s"], num_iterations=config.num_iterations)
    old_s, update_s = measured["old_logprob_s"], measured["update_s"]
    return {**out, "old_logprob_roof_s": roofs["old_logprob_roof_s"], "update_roof_s": roofs["update_roof_s"],
            "old_logprob_roof_share": roofs["old_logprob_roof_s"] / old_s if old_s else None,
            "update_roof_share": roofs["update_roof_s"] / update_s if update_s else None}


def run_sweep(
    cfg: SweepConfig,
    out: str | Path,
    *,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    policy=None,
) -> list[dict[str, Any]]:
    """Run (or resume) the sweep; returns the aggregated points. `on_point` sees each run as it lands."""
    from cbkit.telemetry import cuda_peaks
    from cbkit.train.setup import set_up_run

    results = ResultsFile(out, cfg.fingerprint())
    todo = [(n, rep, b) for n_i, n in enumerate(cfg.ns) for rep in range(cfg.repeats)
            for b in _order(cfg.backends, n_i + rep) if not results.done(b, n, rep)]
    if not todo:
        return aggregate(results.runs)

    # A full step trains the weights it rolls out from, and the loop trains fp32 weights (cfg.dtype is its autocast).
    setup = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed,
                       dtype="float32" if cfg.full_step else cfg.dtype, policy=policy)
    model, prompts = setup.model, setup.prompts
    sampling = setup.sampling(cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              seed=cfg.seed)
    dtype_bytes = model.dtype.itemsize
    workload = cfg.workload
    # The limit beside the number: probed at the start and again before every N (a shared machine's roofs move),
    # each probe recorded as its own line; a run carries the probe taken next to it.
    probe = _probe_line(results, model, workload.describe(cfg.max_new_tokens), point=None)
    params = matmul_params(model)
    # Each backend is warmed up with one short call: first calls pay one-off costs, not what we compare.
    backends = {b: setup.backend(b, cb_config=cfg.cb_config, cpu_attention=cfg.cpu_attention,
                                 engine_loop=cfg.engine_loop) for b in cfg.backends if b != ASYNC_BACKEND}

    # A trainer's state, held for the whole sweep where asked (`trainer_state`): allocated before the free memory is
    # read, so the engine's share and the planner's budget are of what it leaves. torch.empty on a CPU commits no
    # pages: there it is a placeholder of the right size.
    held = (torch.empty(trainer_state_bytes(model), dtype=torch.uint8, device=model.device)
            if cfg.trainer_state else None)
    budget = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else None  # free after the weights
    probed_at = None
    for n, rep, b in tqdm(todo, desc="sweep runs"):
        if probed_at is not None and probed_at != n:
            probe = _probe_line(results, model, workload.describe(cfg.max_new_tokens), point=n)
        probed_at = n
        run_sampling = dataclasses.replace(sampling, seed=cfg.seed + rep)
        # Drawn from (seed, rows) only: both backends at this point get the same targets.
        targets = workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=run_sampling.seed)
        if b == ASYNC_BACKEND:
            measured = measure_async_steps(cfg, setup, n, rep, targets, probe)
        elif cfg.full_step:
            measured = measure_full_step(cfg, setup, backends[b], n, rep, targets, probe)
        else:
            measured = measure_run(backends[b], prompts, n, run_sampling, model.config, dtype_bytes, targets)
        run = {"backend": b, "N": n, "repeat": rep, "num_prompts": len(prompts), "time": time.time(),
               "lengths": cfg.lengths, **measured, **cuda_peaks(model.device)}
        if measured["status"] == "ok":
            seconds = measured.get("rollout_s")
            run.update(matmul_params=params, peak_flops=probe["peak_flops"],
                       mfu=mfu(params, measured["completion_tokens"], seconds, probe["peak_flops"])
                       if not cfg.full_step and probe["peak_flops"] else None)
            if not cfg.full_step:
                run.update(roof_record(model.config, prompts, measured, probe, dtype_bytes))
        planned = _planned(cfg, model, prompts, n, b, dtype_bytes, budget, run, targets)
        run.update(_planned_step(cfg, model, prompts, n, run, planned, targets) if cfg.full_step
                   else planned)
        if held is not None:
            run["trainer_state_bytes"] = held.numel()
        results.add(run)
        if on_point is not None:
            on_point(run)
    del held
    return aggregate(results.runs)


def trainer_state_bytes(model) -> int:
    """What a training step keeps on the device between updates beside the weights: fp32 gradients and AdamW's
    two fp32 moments (`planner.GRAD_BYTES_PER_PARAM`, `ADAM_BYTES_PER_PARAM`)."""
    from cbkit.measure.planner import ADAM_BYTES_PER_PARAM, GRAD_BYTES_PER_PARAM

    return (GRAD_BYTES_PER_PARAM + ADAM_BYTES_PER_PARAM) * sum(p.numel() for p in model.parameters())


def _probe_line(results: ResultsFile, model, lengths: str, point: int | None) -> dict[str, Any]:
    probe = machine_probe(model)
    results.add_line({"kind": "probe", "time": time.time(), "lengths": lengths, "before_N": point, **probe})
    for name, why in probe["probe_missing"].items():
        print(f"probe: no {name} ({why}); the columns that need it stay empty", flush=True)
    return probe


def roof_record(config, prompts, measured: dict[str, Any], probe: dict[str, Any], dtype_bytes: int) -> dict[str, Any]:
    """A run's roofline fields: the attainable tokens/s of its shape (its prompts, its completions' lengths) on
    the probed machine, the share of it the run reached, and which roof bound most decode steps. Without both
    peaks the fields are None and ``roof_missing`` says which probe failed and why."""
    from cbkit.measure.roofline import rollout_roofline

    empty = {"roof_tokens_per_s": None, "roof_share": None, "roof_bound": None, "bytes_per_s": probe.get("bytes_per_s")}
    missing = {k: v for k, v in (probe.get("probe_missing") or {}).items()}
    for key in ("peak_flops", "bytes_per_s"):
        if not probe.get(key) and key not in missing:
            missing[key] = "not probed"
    if missing:
        return {**empty, "roof_missing": "; ".join(f"{k}: {v}" for k, v in sorted(missing.items()))}
    roof = rollout_roofline(config, prompt_lens=[len(p) for p in prompts],
                            completion_lengths=measured["completion_lengths"], dtype_bytes=dtype_bytes,
                            peak_flops=probe["peak_flops"], bytes_per_s=probe["bytes_per_s"])
    attainable = roof["attainable_tokens_per_s"]
    share = measured["tokens_per_s"] / attainable if attainable and measured.get("tokens_per_s") else None
    bound = "compute" if roof["compute_bound_steps"] * 2 > roof["decode_steps"] else "bandwidth"
    return {**empty, "roof_tokens_per_s": attainable, "roof_share": share, "roof_bound": bound,
            "roof_seconds": roof["roof_seconds"], "roof_compute_bound_steps": roof["compute_bound_steps"],
            "roof_decode_steps": roof["decode_steps"], "peak_flops_spread": probe.get("peak_flops_spread"),
            "bytes_per_s_spread": probe.get("bytes_per_s_spread")}


def _planned(cfg, model, prompts, n, backend, dtype_bytes, budget, run, targets=None) -> dict[str, Any]:
    """The planner's prediction for this point, and its error against what was measured. With replayed
    targets the static batch runs to the longest one; the continuous backend's pool is sized from the
    generation limit as always (it cannot know the lengths in advance), which the planner does by itself."""
    from cbkit.measure.planner import plan

    impl = str((run.get("engine_config") or {}).get("attn_implementation", "sdpa"))
    device = model.device.type if model.device.type == "cuda" else "cpu"
    cb_config = dict(cfg.cb_config)
    if targets and device == "cpu" and "num_blocks" not in cb_config:
        from cbkit.rollout.engine_config import make_cb_config

        rows = [x for x in prompts for _ in range(n)]
        resolved = make_cb_config(cb_config, device=model.device, rows=rows, max_new_tokens=cfg.max_new_tokens,
                                  warn=False)
        cb_config["num_blocks"] = resolved.num_blocks
    p = plan(model.config, num_prompts=len(prompts), num_generations=n, prompt_len=[len(x) for x in prompts],
             max_new_tokens=max(targets) if targets else cfg.max_new_tokens, dtype_bytes=dtype_bytes,
             budget_bytes=budget, cb_config=cb_config, device=device,
             attn_implementation="flash" if "flash" in impl else "sdpa")
    planned = p.generate.peak_bytes if backend == "generate" else p.continuous.peak_bytes
    measured = run.get("peak_mem_bytes")
    error = measured / planned - 1 if measured and planned else None
    return {"planned_peak_bytes": planned, "plan_error": error, **plan_terms(p, backend)}


def plan_terms(p, backend: str) -> dict[str, int | None]:
    """The planned peak's terms for one backend, flat, so `cbkit report` can print each beside the measurement: the
    cache (generate()'s KV at the end, the CB engine's pool tensor), the transients at the peak, the engine's buffers
    and, on a CPU, the heap slack glibc keeps beside generate()'s growing cache (`planner.CPU_HEAP_SLACK`)."""
    if backend == "generate":
        g = p.generate
        decode_peak = g.kv_bytes + g.cpu_heap_slack_bytes + g.decode_transient_bytes >= g.prefill_bytes
        return {"plan_cache_bytes": g.kv_bytes if decode_peak else 0,
                "plan_transient_bytes": g.decode_transient_bytes if decode_peak else g.prefill_bytes,
                "plan_buffer_bytes": 0, "plan_heap_slack_bytes": g.cpu_heap_slack_bytes if decode_peak else 0}
    c = p.continuous
    return {"plan_cache_bytes": c.cache_tensor_bytes, "plan_transient_bytes": c.transient_bytes,
            "plan_buffer_bytes": c.buffer_bytes, "plan_heap_slack_bytes": 0}


def _planned_step(cfg, model, prompts, n, run, planned, targets=None) -> dict[str, Any]:
    """The planner's peak for a whole GRPO step (`planner.step_peak_bytes`: the rollout's planned peak, one
    chunk's backward beside the gradients, the optimizer step; the sweep's trainer is fresh, so AdamW's moments
    appear at the update), the phase that sets it, and its error against the step's measured peak.

    The async row's phases overlap instead of following each other: its later steps hold AdamW's moments
    throughout and the next rollout's KV beside the training's own peak, so the peak is their sum (phase
    ``overlapped``). The engine's copy of the weights is made with the trainer, before the step's baseline; the
    copy `AsyncRollouts.after_step` keeps for a checkpoint is not made here (the sweep's trainer has no output_dir)."""
    from cbkit.measure.planner import step_peak_bytes

    rows = len(prompts) * n
    longest = max(targets) if targets and cfg.workload.kind != "natural" else cfg.max_new_tokens
    params = sum(p.numel() for p in model.parameters())
    overlapped = run.get("backend") == ASYNC_BACKEND
    later = {}
    if targets and cfg.workload.kind != "natural" and cfg.forward_chunk_rows and rows > cfg.forward_chunk_rows:
        # the trainer's chunks take the rows longest first: past the first chunk, none is wider than these
        by_length = sorted(((len(prompts[i // n]) + t, t) for i, t in enumerate(targets)), reverse=True)
        rest = by_length[cfg.forward_chunk_rows:]
        later = {"later_tokens_per_row": rest[0][0], "later_completion_len": max(t for _, t in rest)}
    step = step_peak_bytes(params, rollout_peak_bytes=planned["planned_peak_bytes"],
                           micro_batch_rows=rows, chunk_rows=cfg.forward_chunk_rows,
                           tokens_per_row=max(map(len, prompts)) + longest, completion_len=longest,
                           config=model.config, autocast=False, optimizer_state_resident=overlapped,
                           device="cuda" if model.device.type == "cuda" else "cpu", **later)
    phase = max(("rollout", "backward", "optimizer_step"), key=step.__getitem__)
    peak = step["peak"]
    if overlapped:
        peak = planned["planned_peak_bytes"] + max(step["backward"], step["optimizer_step"])
        phase = "overlapped"
    measured = run.get("peak_mem_bytes")
    return {"planned_peak_bytes": peak, "planned_rollout_peak_bytes": planned["planned_peak_bytes"],
            "planned_phase": phase, "plan_error": measured / peak - 1 if measured and peak else None}


def _order(backends: Sequence[str], k: int) -> list[str]:
    return list(backends) if k % 2 == 0 else list(reversed(backends))


# --- TRL's benchmark: TRL PR #5765 beside this run ----------------------------------------------------------------

# huggingface/trl PR #5765 (A100-80GB, Llama-3.2-1B-Instruct, GSM8K, up to 2048 new tokens): seconds per
# generation with generate() and with CB, and CB's VRAM minus generate()'s, in GB.
TRL_PR_5765: dict[int, tuple[float, float, float]] = {8: (18.24, 18.16, 17.86), 32: (37.06, 29.91, 7.39),
                                                      64: (41.12, 32.84, -16.66)}
