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
* speed and memory are reported as ratios to `generate()` at the same N, measured in the same process.
"""

from __future__ import annotations

import dataclasses
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

from cbkit.rollout import BACKENDS, SamplingParams, make_backend
from cbkit.rollout.base import stop_token_ids

DEFAULT_NS = (8, 16, 32, 64)

PRESETS: dict[str, dict[str, Any]] = {
    # The seed's setting; sized for an A100-80GB (about 10 minutes).
    "a100": dict(model="meta-llama/Llama-3.2-1B-Instruct", data="gsm8k:test", num_prompts=8,
                 max_new_tokens=512, repeats=3, dtype="bfloat16"),
    # A Colab T4 (16 GB, no bf16): a smaller model in fp16.
    "t4": dict(model="HuggingFaceTB/SmolLM2-360M-Instruct", data="gsm8k:test", num_prompts=4,
               max_new_tokens=256, repeats=3, dtype="float16"),
}


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
    # False runs the engine's own dense-mask attention on CPU: the "before" of cbkit's CPU tuning.
    cpu_varlen_attention: bool = True
    # Time a whole GRPO step (rollout + old-logprob forward + forward/backward/update) instead of the rollout
    # alone, through cbkit.grpo; the weights are restored after every step so each point starts the same.
    full_step: bool = False

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
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}.")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}.")

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs comparable. ns, backends and repeats may grow between reruns; nothing else."""
        import transformers

        import cbkit

        keep = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ns", "backends", "repeats")}
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        return {**keep, "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                "cbkit": cbkit.__version__}


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


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def measure_run(backend, prompts, n: int, sampling: SamplingParams, config, dtype_bytes: int) -> dict[str, Any]:
    """One timed rollout and what it cost; an OOM becomes a record, not a crash."""
    from cbkit.telemetry import kv_accounting, nvml_process_bytes

    try:
        rollout = backend.generate(prompts, n, sampling)
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
        "engine_config": rollout.engine_config,
        **kv_accounting(rollout, config, dtype_bytes),
    }


def measure_full_step(cfg: SweepConfig, policy, problems, backend, n: int, rep: int) -> dict[str, Any]:
    """One GRPO step through cbkit's loop with this backend; rollout and training seconds come from its
    StepRecord, peak memory covers the whole step. The weights are put back afterwards."""
    from cbkit.config import CBGRPOConfig
    from cbkit.grpo import GRPOTrainer
    from cbkit.telemetry import PeakMemory

    model = policy.model
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = CBGRPOConfig(
        model=cfg.model, data=cfg.data, num_generations=n, prompts_per_step=len(problems),
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        use_transformers_continuous_batching=backend.name == "continuous", seed=cfg.seed + rep,
        output_dir=None, disable_tqdm=True, max_steps=1,
    )
    trainer = GRPOTrainer(config, policy=policy, backend=backend, problems=problems)
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
    from cbkit.data import chat_prompt_ids, load_problems
    from cbkit.models import load_policy

    results = ResultsFile(out, cfg.fingerprint())
    todo = [(n, rep, b) for n_i, n in enumerate(cfg.ns) for rep in range(cfg.repeats)
            for b in _order(cfg.backends, n_i + rep) if not results.done(b, n, rep)]
    if not todo:
        return aggregate(results.runs)

    policy = policy or load_policy(cfg.model, dtype=cfg.dtype)
    tok, model = policy.tokenizer, policy.model
    problems = load_problems(cfg.data, n=cfg.num_prompts, seed=cfg.seed)
    prompts = [chat_prompt_ids(tok, p) for p in problems]
    sampling = SamplingParams(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        eos_token_id=stop_token_ids(tok, model), pad_token_id=tok.pad_token_id, seed=cfg.seed,
    )
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    backends = {b: make_backend(b, model, cb_config=cfg.cb_config, pad_token_id=tok.pad_token_id,
                                cpu_varlen_attention=cfg.cpu_varlen_attention) for b in cfg.backends}
    warm = dataclasses.replace(sampling, max_new_tokens=min(8, cfg.max_new_tokens))
    for b in backends.values():  # first calls pay one-off costs (allocator, kernels); not what we compare
        b.generate(prompts[:1], 1, warm)

    budget = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else None  # free after the weights
    for n, rep, b in tqdm(todo, desc="sweep runs"):
        run_sampling = dataclasses.replace(sampling, seed=cfg.seed + rep)
        if cfg.full_step:
            measured = measure_full_step(cfg, policy, problems, backends[b], n, rep)
        else:
            measured = measure_run(backends[b], prompts, n, run_sampling, model.config, dtype_bytes)
        run = {"backend": b, "N": n, "repeat": rep, "num_prompts": len(prompts), "time": time.time(), **measured}
        if not cfg.full_step:  # the planner predicts a rollout, not a training step
            run.update(_planned(cfg, model, prompts, n, b, dtype_bytes, budget, run))
        results.add(run)
        if on_point is not None:
            on_point(run)
    return aggregate(results.runs)


def _planned(cfg, model, prompts, n, backend, dtype_bytes, budget, run) -> dict[str, Any]:
    """The planner's prediction for this point, and its error against what was measured."""
    from cbkit.advise import plan

    impl = str((run.get("engine_config") or {}).get("attn_implementation", "sdpa"))
    p = plan(model.config, num_prompts=len(prompts), num_generations=n, prompt_len=[len(x) for x in prompts],
             max_new_tokens=cfg.max_new_tokens, dtype_bytes=dtype_bytes, budget_bytes=budget,
             cb_config=cfg.cb_config, device=model.device.type if model.device.type == "cuda" else "cpu",
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
                    "mean_completion_len", "completion_tokens", "planned_peak_bytes", "plan_error"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            point[key] = statistics.median(vals) if vals else None
        if not ok:
            point["peak_mem_bytes"] = max((r["peak_mem_bytes"] or 0 for r in rs), default=None)
        point["peak_mem_kind"] = next((r.get("peak_mem_kind") for r in rs if r.get("peak_mem_kind")), None)
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
    """The seed's table: N | speed vs generate | memory behaviour, for one backend against generate()."""
    rows = ["| N | speed vs generate | memory behaviour |", "| --- | --- | --- |"]
    for p in (p for p in points if p["backend"] == backend):
        if p["status"] != "ok":
            rows.append(f"| {p['N']} | {p['status'].upper()} | — |")
            continue
        speed = f"{p['speed_vs_generate']:.2f}x" if p["speed_vs_generate"] is not None else "n/a"
        mem = p["mem_vs_generate"]
        if mem is None:
            behaviour = "n/a"
        else:
            word = "less than" if mem < 0.95 else "more than" if mem > 1.05 else "about the same as"
            behaviour = f"{word} generate ({mem:.2f}x peak)"
        rows.append(f"| {p['N']} | {speed} | {behaviour} |")
    return "\n".join(rows)


def points_table(points: list[dict[str, Any]]) -> str:
    head = f"{'N':>4} {'backend':<11} {'status':<6} {'tok/s':>8} {'rollout s':>9} {'peak MiB':>9} " \
           f"{'KV MiB':>8} {'pad':>5} {'speed x':>7} {'mem x':>6} {'plan err':>8}"
    lines = [head, "-" * len(head)]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    for p in points:
        lines.append(
            f"{p['N']:>4} {p['backend']:<11} {p['status']:<6} {f(p['tokens_per_s'], '8.1f'):>8} "
            f"{f(p['rollout_s'], '9.1f'):>9} {f(p['peak_mem_bytes'] and p['peak_mem_bytes'] / 2**20, '9.0f'):>9} "
            f"{f(p['kv_bytes'] and p['kv_bytes'] / 2**20, '8.1f'):>8} {f(p['padding_share'], '5.2f'):>5} "
            f"{f(p['speed_vs_generate'], '7.2f'):>7} {f(p['mem_vs_generate'], '6.2f'):>6} "
            f"{f(p.get('plan_error'), '+8.0%'):>8}"
        )
    return "\n".join(lines)


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
            "mem_vs_generate", "planned_peak_bytes", "plan_error"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(points)
