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
* the length workload (`cbkit.workload`; default ``replay:gsm8k``) decides how long each completion runs.
  Both backends get the same targets at a point, and every run line records the workload, the
  per-completion lengths, their mean / CV / max and the share of a static batch's decode slots those
  lengths leave as padding: the spread CB has to win back, printed next to the speed it won;
* the limit beside the number: a short matmul probe at the sweep's start measures what this machine can
  do at the model's dtype and width, and each run reports its model FLOP utilisation (MFU) against it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cbkit.rollout import BACKENDS, SamplingParams
from cbkit.workload import LengthWorkload, length_stats, padding_share, parse_lengths

DEFAULT_NS = (8, 16, 32, 64)

PRESETS: dict[str, dict[str, Any]] = {
    # The seed's setting on a GPU machine with no network (scripts/gpu_sweep.sh): Llama-3.2-1B-Instruct's exact
    # shape with random weights, synthetic GSM-style prompts, GSM8K solution lengths replayed up to the seed's
    # 2048 new tokens. Sized for <= 8 minutes on one A100/H100/H200 (the estimate is in the script).
    "seed": dict(model="llama-1b-random", data="synthetic", num_prompts=4, ns=(8, 32, 64), max_new_tokens=2048,
                 repeats=1, dtype="bfloat16", lengths="replay:gsm8k"),
    # The seed's setting with the real model from the hub; sized for an A100-80GB (about 10 minutes).
    "a100": dict(model="meta-llama/Llama-3.2-1B-Instruct", data="gsm8k:test", num_prompts=8,
                 max_new_tokens=512, repeats=3, dtype="bfloat16"),
    # A Colab T4 (16 GB, no bf16): a smaller model in fp16.
    "t4": dict(model="HuggingFaceTB/SmolLM2-360M-Instruct", data="gsm8k:test", num_prompts=4,
               max_new_tokens=256, repeats=3, dtype="float16"),
}
# What a preset needs, said before any model is loaded.
PRESET_NEEDS = {
    "seed": "one CUDA GPU with bf16 and ~40 GB free (A100/H100/H200-class): Llama-3.2-1B's shape at N up to 64 "
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
    from cbkit.models import native_bf16

    if dry_run:
        return
    if torch.cuda.is_available():
        if (dtype or PRESETS[preset].get("dtype")) in ("bfloat16", "bf16") and not native_bf16():
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
    model: str = "smollm2-offline"
    data: str = "synthetic"
    num_prompts: int = 1
    ns: tuple[int, ...] = DEFAULT_NS
    backends: tuple[str, ...] = ("generate", "continuous")
    repeats: int = 2
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    dtype: str | None = None
    cb_config: dict[str, Any] = field(default_factory=dict)
    # The CB engine's attention on CPU: "batched" (cbkit's default), "per_sequence" (cbkit's loop before the
    # decode batching) or "engine" (its own dense-mask SDPA): the "befores" of the CPU tuning, side by side.
    cpu_attention: str = "batched"
    # Time a whole GRPO step (rollout + old-logprob forward + forward/backward/update) instead of the rollout
    # alone, through cbkit.grpo; the weights are restored after every step so each point starts the same.
    full_step: bool = False
    # How long each completion runs (cbkit.workload): natural | fixed | replay:gsm8k | replay:FILE. The default
    # replays GSM8K solution lengths, a spread like real math reasoning; natural lets EOS decide.
    lengths: str = "replay:gsm8k"

    def __post_init__(self) -> None:
        from cbkit.rollout.cpu_attention import CPU_ATTENTION

        if self.cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION)}; got {self.cpu_attention!r}.")
        self.ns = tuple(self.ns)
        self.backends = tuple(self.backends)
        if not self.ns or any(not isinstance(n, int) or n < 1 for n in self.ns):
            raise ValueError(f"ns must be positive integers, e.g. 8,16,32,64; got {list(self.ns)}.")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if not self.backends or unknown:
            raise ValueError(f"Unknown backend(s) {unknown or '(none given)'}; choose from {sorted(BACKENDS)}.")
        if "generate" not in self.backends:
            raise ValueError("The sweep reports ratios to generate(): keep 'generate' in the backends.")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}.")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}.")
        # Read and checked here, before any model time: a missing file or a too-long length fails now.
        self._workload = parse_lengths(self.lengths)
        self._workload.check(self.max_new_tokens)
        if self.full_step and self._workload.kind != "natural":
            raise ValueError(
                f"full_step times cbkit's GRPO loop, whose completions end at EOS; lengths={self.lengths!r} "
                "cannot be replayed there. Use lengths='natural' (--lengths natural) with full_step."
            )

    @property
    def workload(self) -> LengthWorkload:
        return self._workload

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs comparable. ns, backends and repeats may grow between reruns; nothing else."""
        import transformers

        import cbkit

        keep = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ns", "backends", "repeats")}
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        # A replayed file may change under the same name: its contents are part of what makes runs comparable.
        w = self._workload
        digest = (hashlib.sha256(json.dumps(w.source_lengths).encode()).hexdigest()[:16]
                  if w.kind == "replay" else None)
        return {**keep, "lengths_digest": digest, "device": device, "torch": torch.__version__,
                "transformers": transformers.__version__, "cbkit": cbkit.__version__}


class ResultsFile:
    """The sweep's JSONL: a header line with the fingerprint, then one line per finished run."""

    def __init__(self, path: str | Path, fingerprint: dict[str, Any]) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.runs: list[dict[str, Any]] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"kind": "header", "fingerprint": fingerprint})

    def _load(self) -> None:
        lines = _read_jsonl(self.path, repair=True)
        if not lines or lines[0].get("kind") != "header":
            raise ValueError(f"{self.path} is not a cbkit sweep results file (no header line); use another --out.")
        theirs = lines[0]["fingerprint"]
        diff = {k: (theirs.get(k), v) for k, v in self.fingerprint.items() if theirs.get(k) != v}
        if diff:
            listed = "; ".join(f"{k}: file has {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{self.path} holds results of a different configuration ({listed}). Mixing them would put "
                "incomparable numbers in one table: use another --out, or rerun with the file's settings."
            )
        self.runs = [line for line in lines[1:] if line.get("kind") == "run"]

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def done(self, backend: str, n: int, repeat: int) -> bool:
        return any(r["backend"] == backend and r["N"] == n and r["repeat"] == repeat for r in self.runs)

    def add(self, run: dict[str, Any]) -> None:
        run = {"kind": "run", **run}
        self._append(run)
        self.runs.append(run)

    def add_line(self, record: dict[str, Any]) -> None:
        """A line that is not a run (the matmul probe): kept in the file, skipped by `done` and `aggregate`."""
        self._append(record)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


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
        "mean_completion_len": statistics.mean(lengths),
        "max_completion_len": max(lengths),
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
            "length_max": stats["max"], "static_padding_share": padding_share(lengths)}


def measure_full_step(cfg: SweepConfig, setup, backend, n: int, rep: int) -> dict[str, Any]:
    """One GRPO step through cbkit's loop with this backend; rollout and training seconds come from its
    StepRecord, peak memory covers the whole step. The weights are put back afterwards."""
    from cbkit.config import CBGRPOConfig
    from cbkit.grpo import GRPOTrainer
    from cbkit.telemetry import PeakMemory

    model, problems = setup.model, setup.problems
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = CBGRPOConfig(
        model=cfg.model, data=cfg.data, num_generations=n, prompts_per_step=len(problems),
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        use_transformers_continuous_batching=backend.name == "continuous", seed=cfg.seed + rep,
        output_dir=None, disable_tqdm=True, max_steps=1,
    )
    trainer = GRPOTrainer(config, policy=(model, setup.tokenizer), backend=backend, problems=problems)
    try:
        with PeakMemory(model.device) as mem:
            record = trainer.step()
            mem.synchronize()
    except Exception as e:
        if not _is_oom(e):
            raise
        return {"status": "oom", "error": str(e).splitlines()[0][:300], "peak_mem_bytes": mem.peak_bytes,
                "peak_mem_kind": mem.kind}
    finally:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
    m = record.metrics
    tokens = m["completion/mean_length"] * n * len(problems)
    return {
        "status": "ok",
        "step_s": m["step/seconds"],
        "rollout_s": m["rollout/seconds"],
        "train_s": m["train/seconds"],
        "completion_tokens": tokens,
        "tokens_per_s": tokens / m["step/seconds"],  # completion tokens per second of whole step
        "peak_mem_bytes": mem.peak_bytes,
        "peak_mem_kind": mem.kind,
        "mean_completion_len": m["completion/mean_length"],
        "reward_mean": m.get("reward/mean"),
    }


def run_sweep(
    cfg: SweepConfig,
    out: str | Path,
    *,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    policy=None,
) -> list[dict[str, Any]]:
    """Run (or resume) the sweep; returns the aggregated points. `on_point` sees each run as it lands."""
    from cbkit.telemetry import cuda_peaks
    from cbkit.workload import set_up_run

    results = ResultsFile(out, cfg.fingerprint())
    todo = [(n, rep, b) for n_i, n in enumerate(cfg.ns) for rep in range(cfg.repeats)
            for b in _order(cfg.backends, n_i + rep) if not results.done(b, n, rep)]
    if not todo:
        return aggregate(results.runs)

    setup = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed, dtype=cfg.dtype, policy=policy)
    model, prompts = setup.model, setup.prompts
    sampling = setup.sampling(cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              seed=cfg.seed)
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    workload = cfg.workload
    # The limit beside the number: measured once per session, recorded as its own line and in every run.
    probe = matmul_probe(model)
    results.add_line({"kind": "probe", "time": time.time(), "lengths": workload.describe(cfg.max_new_tokens),
                      **probe})
    params = matmul_params(model)
    # Each backend is warmed up with one short call: first calls pay one-off costs, not what we compare.
    backends = {b: setup.backend(b, cb_config=cfg.cb_config, cpu_attention=cfg.cpu_attention) for b in cfg.backends}

    budget = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else None  # free after the weights
    for n, rep, b in tqdm(todo, desc="sweep runs"):
        run_sampling = dataclasses.replace(sampling, seed=cfg.seed + rep)
        # Drawn from (seed, rows) only: both backends at this point get the same targets.
        targets = workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=run_sampling.seed)
        if cfg.full_step:
            measured = measure_full_step(cfg, setup, backends[b], n, rep)
        else:
            measured = measure_run(backends[b], prompts, n, run_sampling, model.config, dtype_bytes, targets)
        run = {"backend": b, "N": n, "repeat": rep, "num_prompts": len(prompts), "time": time.time(),
               "lengths": cfg.lengths, **measured, **cuda_peaks(model.device)}
        if measured["status"] == "ok":
            seconds = measured.get("rollout_s")
            run.update(matmul_params=params, peak_flops=probe["peak_flops"],
                       mfu=mfu(params, measured["completion_tokens"], seconds, probe["peak_flops"])
                       if not cfg.full_step else None)
        if not cfg.full_step:  # the planner predicts a rollout, not a training step
            run.update(_planned(cfg, model, prompts, n, b, dtype_bytes, budget, run, targets))
        results.add(run)
        if on_point is not None:
            on_point(run)
    return aggregate(results.runs)


# --- the limit beside the number: a matmul probe and MFU ----------------------------------------------------

# Rows of the probe's [rows x hidden] @ [hidden x intermediate]: a decode step's MLP matmul at a few batch
# sizes (a decode step has one row per running sequence), the largest near what the hardware sustains.
PROBE_ROWS = (64, 512, 4096)


def matmul_probe(model, rows: Sequence[int] = PROBE_ROWS, min_seconds: float = 0.25, rounds: int = 3) -> dict[str, Any]:
    """This machine's matmul throughput at the model's dtype and width: the best FLOP/s of a
    [rows x hidden] @ [hidden x intermediate] ``torch.mm`` over ``rows``, each timed over repeated calls
    for at least ``min_seconds`` after one warm-up (CUDA synchronised before every clock read), the shapes
    taken in turn for ``rounds`` rounds. (One 0.1 s pass per shape read 86 and 154 GFLOP/s in two sweeps on the
    same quiet 2-core machine: a [4096 x 576] @ [576 x 1536] product runs twice in 0.1 s.)

    It is the ceiling MFU is measured against: a run at MFU 0.3 did 30% of the matmul work this machine
    can do per second. The same code runs on CUDA; on a shared CPU the probe is only as quiet as the machine.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = cfg.hidden_size
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    device, dtype = model.device, model.dtype
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, per_rows = 0.0, {}
    for r in [r for _ in range(rounds) for r in rows]:
        a = torch.randn(r, hidden, device=device, dtype=dtype)
        b = torch.randn(hidden, inter, device=device, dtype=dtype)
        with torch.no_grad():
            torch.mm(a, b)
            sync()
            calls, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                calls += 1
                if device.type != "cuda" or calls % 4 == 0:  # on CUDA, not a sync per small kernel
                    sync()
                    elapsed = time.perf_counter() - start
                    if elapsed >= min_seconds:
                        break
        flops = 2 * r * hidden * inter * calls / elapsed
        per_rows[str(r)] = max(flops, per_rows.get(str(r), 0.0))
        best = max(best, flops)
        del a, b
    return {"peak_flops": best, "probe_flops_by_rows": per_rows, "probe_shape": [hidden, inter],
            "probe_dtype": str(dtype).removeprefix("torch."), "probe_device": device.type}


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: every ``nn.Linear`` weight, the LM head included
    (tied to the embedding or not, it multiplies the hidden state by vocab x hidden). The input embedding is
    a lookup and not counted; attention's score and value products (which grow with context) are left out,
    as in the usual 2 x parameters per token estimate."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def mfu(params: int, completion_tokens: float, seconds: float | None, peak_flops: float) -> float | None:
    """Model FLOP utilisation: 2 x matmul params x useful completion tokens / seconds / probed peak FLOP/s.
    Useful tokens are the completion tokens (padding never counts, the prompt's prefill neither), so a
    static batch's padded slots lower its MFU, as they lower its throughput."""
    if not seconds or seconds <= 0 or not peak_flops:
        return None
    return 2 * params * completion_tokens / seconds / peak_flops


def _planned(cfg, model, prompts, n, backend, dtype_bytes, budget, run, targets=None) -> dict[str, Any]:
    """The planner's prediction for this point, and its error against what was measured. With replayed
    targets the static batch runs to the longest one; the continuous backend's pool is sized from the
    generation limit as always (it cannot know the lengths in advance), which the planner does by itself."""
    from cbkit.advise import plan

    impl = str((run.get("engine_config") or {}).get("attn_implementation", "sdpa"))
    device = model.device.type if model.device.type == "cuda" else "cpu"
    cb_config = dict(cfg.cb_config)
    if targets and device == "cpu" and "num_blocks" not in cb_config:
        from cbkit.rollout.continuous import make_cb_config

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
    return {"planned_peak_bytes": planned, "plan_error": error}


def _order(backends: Sequence[str], k: int) -> list[str]:
    return list(backends) if k % 2 == 0 else list(reversed(backends))


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats per (backend, N), then ratios to generate() at the same N."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["N"]), []).append(r)
    points = []
    for (backend, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rs if r["status"] == "ok"]
        point: dict[str, Any] = {"backend": backend, "N": n, "repeats": len(rs),
                                 "status": "ok" if ok else rs[0]["status"]}
        for key in ("tokens_per_s", "rollout_s", "step_s", "train_s", "peak_mem_bytes", "kv_bytes", "padding_share",
                    "mean_completion_len", "completion_tokens", "planned_peak_bytes", "plan_error", "length_mean",
                    "length_cv", "length_max", "static_padding_share", "mfu", "peak_flops", "peak_reserved_bytes",
                    "device_used_bytes", "nvml_bytes"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            point[key] = statistics.median(vals) if vals else None
        if not ok:
            point["peak_mem_bytes"] = max((r["peak_mem_bytes"] or 0 for r in rs), default=None)
        point["peak_mem_kind"] = next((r.get("peak_mem_kind") for r in rs if r.get("peak_mem_kind")), None)
        point["lengths"] = next((r.get("lengths") for r in rs if r.get("lengths")), None)
        points.append(point)
    by_key = {(p["backend"], p["N"]): p for p in points}
    for p in points:
        g = by_key.get(("generate", p["N"]))
        p["speed_vs_generate"] = _ratio(p["tokens_per_s"], g and g["tokens_per_s"])
        p["mem_vs_generate"] = _ratio(p["peak_mem_bytes"], g and g["peak_mem_bytes"])
    return points


def _ratio(a, b) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


def seed_table(points: list[dict[str, Any]], backend: str = "continuous") -> str:
    """The seed's table: N | speed vs generate | memory behaviour, for one backend against generate(), and the
    length spread of the point (generate()'s runs: the static batch is the one that pads)."""
    rows = ["| N | speed vs generate | memory behaviour | lengths: mean, CV, max; static batch padding |",
            "| --- | --- | --- | --- |"]
    gen = {p["N"]: p for p in points if p["backend"] == "generate"}
    for p in (p for p in points if p["backend"] == backend):
        spread = _spread_cell(gen.get(p["N"]) or p)
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['status'].upper()} | — | {spread} |")
            continue
        speed = f"{p['speed_vs_generate']:.2f}x" if p["speed_vs_generate"] is not None else "n/a"
        mem = p["mem_vs_generate"]
        if mem is None:
            behaviour = "n/a"
        else:
            word = "less than" if mem < 0.95 else "more than" if mem > 1.05 else "about the same as"
            behaviour = f"{word} generate ({mem:.2f}x peak)"
        rows.append(f"| {p['N']} | {speed} | {behaviour} | {spread} |")
    return "\n".join(rows)


def _spread_cell(p: dict[str, Any]) -> str:
    if p.get("length_mean") is None:
        return "—"
    return (f"{p['length_mean']:.1f}, {p['length_cv']:.2f}, {p['length_max']:.0f}; "
            f"{p['static_padding_share']:.0%} of decode slots")


def points_table(points: list[dict[str, Any]]) -> str:
    """Every point: speed, memory, the length spread it ran (mean, CV, max; pad = share of a static batch's
    decode slots those lengths leave as padding) and its MFU against the sweep's matmul probe."""
    head = f"{'N':>4} {'backend':<11} {'status':<6} {'tok/s':>8} {'rollout s':>9} {'peak MiB':>9} " \
           f"{'KV MiB':>8} {'len':>6} {'CV':>5} {'max':>4} {'pad':>5} {'speed x':>7} {'mem x':>6} {'MFU':>6} " \
           f"{'plan err':>8}"
    lines = [head, "-" * len(head)]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    for p in points:
        lines.append(
            f"{p['N']:>4} {p['backend']:<11} {p['status']:<6} {f(p['tokens_per_s'], '8.1f'):>8} "
            f"{f(p['rollout_s'], '9.1f'):>9} {f(p['peak_mem_bytes'] and p['peak_mem_bytes'] / 2**20, '9.0f'):>9} "
            f"{f(p['kv_bytes'] and p['kv_bytes'] / 2**20, '8.1f'):>8} {f(p.get('length_mean'), '6.1f'):>6} "
            f"{f(p.get('length_cv'), '5.2f'):>5} {f(p.get('length_max'), '4.0f'):>4} "
            f"{f(p.get('static_padding_share'), '5.2f'):>5} "
            f"{f(p['speed_vs_generate'], '7.2f'):>7} {f(p['mem_vs_generate'], '6.2f'):>6} "
            f"{f(p.get('mfu'), '6.1%'):>6} {f(p.get('plan_error'), '+8.0%'):>8}"
        )
    return "\n".join(lines)


def results_summary(path: str | Path) -> str:
    """What a results file ran: its length workload (and how lengths were made) and its latest matmul probe,
    for the lines printed above the tables."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    fp = lines[0].get("fingerprint", {}) if lines else {}
    spec = fp.get("lengths")
    if spec is None:
        out = ["lengths: natural (a results file from before length workloads were recorded)"]
    else:
        try:
            out = [parse_lengths(spec).describe(fp.get("max_new_tokens", 0))]
        except ValueError:  # a replayed file that has moved since: the spec is still what ran
            out = [f"lengths: {spec}"]
    probe = next((x for x in reversed(lines) if x.get("kind") == "probe"), None)
    if probe is not None:
        hidden, inter = probe["probe_shape"]
        out.append(f"matmul probe: {probe['peak_flops'] / 1e9:.1f} GFLOP/s ({probe['probe_device']}, "
                   f"{probe['probe_dtype']}, [rows x {hidden}] @ [{hidden} x {inter}], best of rows "
                   f"{', '.join(probe['probe_flops_by_rows'])}); MFU = 2 x matmul params x completion tokens / "
                   "rollout seconds / this peak")
    return "\n".join(out)


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    return [r for r in _read_jsonl(Path(path)) if r.get("kind") == "run"]


def _read_jsonl(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """The records of a results file. A torn *last* line (a sweep killed mid-write: the run in flight) is dropped
    with a warning, and with `repair` cut from the file, so the next append starts on a line of its own. Any other
    unreadable line is an error that names the file and the line."""
    text = path.read_text()
    records, offset, last_good_end = [], 0, 0
    lines = text.splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        offset += len(line)
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i != last:
                raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e}). Fix or delete that line.") from None
            warnings.warn(f"{path}, line {i + 1}: dropped a torn last line (a run interrupted while it was being "
                          "written); that run will be measured again.", UserWarning, stacklevel=3)
            if repair:
                with open(path, "r+") as f:
                    f.truncate(len(text[:last_good_end].encode()))
            break
        last_good_end = offset
    return records


def write_csv(points: list[dict[str, Any]], path: str | Path) -> None:
    import csv

    keys = ["N", "backend", "status", "repeats", "tokens_per_s", "rollout_s", "peak_mem_bytes", "peak_mem_kind",
            "kv_bytes", "padding_share", "mean_completion_len", "completion_tokens", "speed_vs_generate",
            "mem_vs_generate", "planned_peak_bytes", "plan_error", "lengths", "length_mean", "length_cv",
            "length_max", "static_padding_share", "mfu", "peak_flops", "peak_reserved_bytes", "device_used_bytes",
            "nvml_bytes"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(points)


# --- the seed's GPU comparison: TRL PR #5765 beside this run ---------------------------------------------------

# huggingface/trl PR #5765 (A100-80GB, Llama-3.2-1B-Instruct, GSM8K, up to 2048 new tokens): seconds per
# generation with generate() and with CB, and CB's VRAM minus generate()'s, in GB.
TRL_PR_5765: dict[int, tuple[float, float, float]] = {8: (18.24, 18.16, 17.86), 32: (37.06, 29.91, 7.39),
                                                      64: (41.12, 32.84, -16.66)}


def trl_comparison_table(points: list[dict[str, Any]]) -> str:
    """This run's seconds and memory next to TRL PR #5765's, per N: the seed's claim and what was measured here.

    Memory deltas are CB minus generate() at the same N, in GB (1e9 bytes, as the PR's table), for three
    counters: the allocator's peak allocated above the weights, its peak reserved (what PyTorch held from the
    driver) and the device's used memory after the call (cudaMemGetInfo: every process and the CUDA context,
    what nvidia-smi shows). The PR does not say which counter its VRAM column is; reserved is the closest.
    """
    by = {(p["backend"], p["N"]): p for p in points}
    head = ("| N | TRL generate s | TRL CB s | TRL CB speed-up | TRL CB VRAM delta GB | generate s | CB s | "
            "CB speed-up | CB delta allocated / reserved / device GB |")
    rows = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ns = sorted({p["N"] for p in points} | set(TRL_PR_5765))
    for n in ns:
        trl = TRL_PR_5765.get(n)
        trl_cells = (f"{trl[0]:.2f} | {trl[1]:.2f} | {trl[0] / trl[1]:.2f}x | {trl[2]:+.2f}" if trl
                     else "— | — | — | —")
        g, c = by.get(("generate", n)), by.get(("continuous", n))
        if g is None or c is None:
            rows.append(f"| {n} | {trl_cells} | not run | not run | — | — |")
            continue
        gs, cs = _seconds_cell(g), _seconds_cell(c)
        ok = g["status"] == "ok" and c["status"] == "ok"
        speed = f"{g['rollout_s'] / c['rollout_s']:.2f}x" if ok and g["rollout_s"] and c["rollout_s"] else "—"
        deltas = " / ".join(_delta_gb(g.get(k), c.get(k)) for k in ("peak_mem_bytes", "peak_reserved_bytes",
                                                                     "device_used_bytes"))
        rows.append(f"| {n} | {trl_cells} | {gs} | {cs} | {speed} | {deltas} |")
    return "\n".join(rows)


def memory_table(points: list[dict[str, Any]]) -> str:
    """The planner's prediction beside every memory counter measured, per point, in GiB."""
    rows = ["| N | backend | planned peak | allocated peak | plan error | reserved peak | device used | "
            "NVML process |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def gib(v) -> str:
        return f"{v / 2**30:.2f}" if v is not None else "—"

    for p in points:
        err = f"{p['plan_error']:+.0%}" if p.get("plan_error") is not None else "—"
        rows.append(f"| {p['N']} | {p['backend']} | {gib(p.get('planned_peak_bytes'))} | "
                    f"{gib(p.get('peak_mem_bytes'))} | {err} | {gib(p.get('peak_reserved_bytes'))} | "
                    f"{gib(p.get('device_used_bytes'))} | {gib(p.get('nvml_bytes'))} |")
    return "\n".join(rows)


def _seconds_cell(p: dict[str, Any]) -> str:
    if p["status"] != "ok":
        return p["status"].upper()
    return f"{p['rollout_s']:.2f}" if p.get("rollout_s") is not None else "—"


def _delta_gb(generate: float | None, continuous: float | None) -> str:
    if generate is None or continuous is None:
        return "—"
    return f"{(continuous - generate) / 1e9:+.2f}"
