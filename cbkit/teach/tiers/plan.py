"""The plan of one notebook on one GPU (`plan_notebook`): its peak by part, every CB engine start it makes with
transformers' own verdict on it (`EngineStart`, `engine_admission`), the copies of the weights it holds in host
memory against a Colab runtime's RAM, its runtime by the roofline, and each memory sweep's crossover (`TierPlan`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbkit.measure import roofline
from cbkit.measure.planner import crossover_n, plan, training_bytes
from cbkit.rollout.admission import Admission, admission
from cbkit.teach.tiers.pool import device_bytes, parameter_count, plan_config, pool_config
from cbkit.teach.tiers.runtime import estimated_train_step, rollout_seconds
from cbkit.teach.tiers.table import (
    BUDGET_S,
    CAPABILITY,
    COLAB_RAM_BYTES,
    CUDA_CONTEXT_BYTES,
    LOGITS_BUDGET_BYTES,
    MACHINES,
    OVERHEAD_S,
    POOL_SHARE,
    PROMPT_LEN,
    TIER_MEMORY,
    GiB,
    notebook_spec,
)
from cbkit.telemetry import fmt_bytes
from cbkit.train.snapshots import place_for_tier

# The part of a plan that is too large -> the sizes that shrink it.
_LOWER = {"rollout": "N (n, sweep_ns), the prompts or the new tokens", "weights": "the model",
          "optimizer": "the model", "loss logits": "max_new_tokens (or the tier's logits budget)",
          "activations": "N or the prompts per step", "teacher-forced": "max_new_tokens", "bf16": "the model"}


@dataclass(frozen=True)
class EngineStart:
    """One CB engine start of a notebook: its requests, what the GPU holds beside it, and the engine's verdict."""

    what: str
    requests: int  # of PROMPT_LEN prompt tokens each
    new_tokens: int
    dtype_bytes: int  # the weights the engine runs (its KV pool's dtype)
    resident_bytes: int  # on the GPU beside it, besides the CUDA context
    admission: Admission


@dataclass
class TierPlan:
    notebook: str
    tier: str
    machine: str
    dtype: str
    peak_bytes: int
    memory_bytes: int  # what tensors may use: CUDA's total less the context (`CUDA_CONTEXT_BYTES`)
    seconds: float
    budget_s: float
    crossovers: list[tuple[str, int | None, tuple[int, ...]]]  # (what, planned crossover N, swept N)
    parts: dict[str, int]  # the peak by part, bytes
    notes: list[str]
    pool: dict[str, int]  # the CB engine's pool settings planned: `pool_config`'s, which the notebook runs
    # Every CB engine start the notebook makes, with transformers' own verdict on the memory left at that point.
    starts: list[EngineStart] = dataclasses.field(default_factory=list)
    # The copies of the weights held in host memory, by part, against a Colab runtime's RAM (`COLAB_RAM_BYTES`).
    host_parts: dict[str, int] = dataclasses.field(default_factory=dict)
    host_memory_bytes: int = COLAB_RAM_BYTES

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts.values())

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.memory_bytes and self.host_bytes <= self.host_memory_bytes

    @property
    def admitted(self) -> bool:
        return all(s.admission.fits for s in self.starts)

    @property
    def in_budget(self) -> bool:
        return self.seconds <= self.budget_s

    @property
    def shows_phenomenon(self) -> bool:
        return all(x is not None and min(ns) < x <= max(ns) for _, x, ns in self.crossovers)

    @property
    def ok(self) -> bool:
        return self.fits and self.admitted and self.in_budget and self.shows_phenomenon

    def problems(self) -> list[str]:
        out = []
        if self.host_bytes > self.host_memory_bytes:
            out.append(f"does not fit in host RAM: {fmt_bytes(self.host_bytes)} of weight copies ("
                       + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.host_parts.items())
                       + f") > {fmt_bytes(self.host_memory_bytes)}; keep the tier's copies on disk "
                       "(cbkit.train.snapshots.TIER_PLACES) or lower the model")
        if self.peak_bytes > self.memory_bytes:
            big = max(self.parts, key=lambda k: self.parts[k])
            lower = next((v for k, v in _LOWER.items() if big.startswith(k)), "the model")
            out.append(f"does not fit: planned {fmt_bytes(self.peak_bytes)} > {fmt_bytes(self.memory_bytes)}; the "
                       f"largest part is {big} ({fmt_bytes(self.parts[big])}): lower {lower}")
        for start in self.starts:
            a = start.admission
            if not a.fits:
                out.append(f"the CB engine would not start for {start.what}: {a.error} (it may take "
                           f"{fmt_bytes(a.available_bytes)} and needs {fmt_bytes(a.footprint_bytes)}); shrink the "
                           "pool (pool_share, N) or what is resident beside it (the weights' copies, the model)")
        if not self.in_budget:
            out.append(f"over budget: ~{self.seconds / 60:.1f} min > {self.budget_s / 60:.0f} min; lower N, the "
                       "prompts, the steps or the new tokens")
        for what, x, ns in self.crossovers:
            if x is None or not min(ns) < x <= max(ns):
                where = "beyond" if x is None or x > max(ns) else "below"
                out.append(f"hides its phenomenon: {what}'s crossover N={x} lies {where} the swept N {ns}; move "
                           "the pool share or the prompts")
        return out

    def line(self) -> str:
        cross = "; ".join(f"{w} crossover N={x} in {ns}" for w, x, ns in self.crossovers) or "no memory sweep"
        status = "ok" if self.ok else "FAIL"
        tightest = min(self.starts, key=lambda s: s.admission.available_bytes - s.admission.footprint_bytes,
                       default=None)
        engine = (f"engine {fmt_bytes(tightest.admission.footprint_bytes)} of "
                  f"{fmt_bytes(tightest.admission.available_bytes)}" if tightest else "no engine")
        return (f"{self.notebook:24} {self.machine:8} {self.dtype:9} peak {fmt_bytes(self.peak_bytes):>10} of "
                f"{fmt_bytes(self.memory_bytes):>9} | host {fmt_bytes(self.host_bytes)} of "
                f"{fmt_bytes(self.host_memory_bytes)} | {engine} | ~{self.seconds / 60:4.1f} of "
                f"{self.budget_s / 60:.0f} min | {cross} | {status}")


def plan_notebook(name: str, machine: str) -> TierPlan:
    """The planned peak, engine starts, runtime and crossovers of one notebook on one GPU of ``MACHINES``."""
    if machine not in MACHINES:
        raise ValueError(f"unknown GPU {machine!r}; the GPUs checked are {', '.join(MACHINES)}.")
    tier, dtype = MACHINES[machine]
    spec, gpu = notebook_spec(name), roofline.GPUS[machine]
    s = spec.sizes[tier]
    config = plan_config(s.model)
    params = parameter_count(config)
    # The notebooks that train keep fp32 weights and roll out from them; the others load the rollout dtype.
    weight_bytes = 4 if spec.trains or spec.kind == "logprobs" else 2
    compute = "float32" if weight_bytes == 4 and (tier == "t4" or spec.trains) else dtype
    if spec.trains and tier == "a100":
        compute = "bfloat16"  # the training forwards under bf16 autocast; the rollout reads fp32 weights
    pool = pool_config(config, s, tier, dtype_bytes=weight_bytes)  # the pool the notebook allocates
    memory = device_bytes(machine) - CUDA_CONTEXT_BYTES
    budget = memory - weight_bytes * params
    common: dict[str, Any] = dict(prompt_len=PROMPT_LEN, dtype_bytes=weight_bytes, device="cuda", budget_bytes=budget,
                  cb_config=pool)
    parts: dict[str, int] = {"weights": weight_bytes * params}
    # Copies of the weights the notebook keeps on the GPU: in the tier's place, and the async engine's own snapshot.
    # A snapshot keeps a tied embedding once (`snapshots._aliases`), as `parameter_count` counts it.
    place = place_for_tier(tier)
    on_gpu = spec.weight_copies if place == "device" else 0
    if on_gpu:
        parts[f"copies of the weights on the GPU ({on_gpu})"] = on_gpu * 4 * params
    # In host memory: the tier's copies where it keeps them there, and those the notebook holds on the CPU anyway.
    # Summed, though they need not coexist: an upper bound.
    host_parts = {f"kept in host memory ({spec.weight_copies})": spec.weight_copies * 4 * params} if (
        place == "host" and spec.weight_copies) else {}
    if spec.host_copies:
        host_parts[f"state dicts on the CPU ({spec.host_copies})"] = spec.host_copies * 4 * params
    if spec.async_run:
        parts["the async engine's weight snapshot"] = 4 * params
    copies = sum(v for k, v in parts.items() if k != "weights")
    crossovers: list[tuple[str, int | None, tuple[int, ...]]] = []
    notes: list[str] = []
    starts: dict[tuple, tuple[str, int]] = {}  # (rows, new tokens, dtype bytes) -> (what, most resident bytes)
    seconds: float = OVERHEAD_S
    rollout_peak = 0

    def rollout(prompts: int, n: int, new: int, backend: str, lengths: str = "replay:gsm8k", *, resident: int = 0,
                what: str = "a rollout", dtype_bytes: int = weight_bytes) -> None:
        """One rollout of the notebook; a CB one is an engine start with `resident` bytes on the GPU beside it."""
        nonlocal seconds, rollout_peak
        p = plan(config, num_prompts=prompts, num_generations=n, max_new_tokens=new, **common)
        rollout_peak = max(rollout_peak, (p.generate if backend == "generate" else p.continuous).peak_bytes)
        seconds += rollout_seconds(config, prompts, n, new, backend, lengths, pool, gpu, compute, weight_bytes)
        key = (prompts * n, new, dtype_bytes)
        if backend != "generate" and resident >= starts.get(key, ("", -1))[1]:
            starts[key] = (what, resident)

    loaded = weight_bytes * params + copies
    if spec.kind in ("step", "train"):
        rows = s.prompts * s.n
        ga = _micro_batches(rows, s.max_new_tokens, config, tier)
        train = training_bytes(params, micro_batch_rows=rows // ga, tokens_per_row=PROMPT_LEN + s.max_new_tokens,
                               completion_len=s.max_new_tokens, config=config, autocast=tier == "a100")
        step_s = estimated_train_step(config, rows, s.max_new_tokens, gpu, compute)
        # From the second step on, the trainer's gradients and AdamW's moments stay on the GPU between updates.
        trainer = train["optimizer_state"] - 4 * params
        for backend in spec.train_runs:
            for step in range(1, s.steps + 1):
                rollout(s.prompts, s.n, s.max_new_tokens, backend, resident=loaded + (trainer if step > 1 else 0),
                        what=f"step {step}'s rollout" + (" (the trainer's state resident)" if step > 1 else ""))
                seconds += step_s
            for _ in range(s.steps // s.eval_every + 1 if s.eval_every else 0):  # held-out, through the CB engine
                rollout(s.eval_prompts, s.eval_n, s.max_new_tokens, "continuous", resident=loaded + trainer,
                        what="the held-out evaluation after training")
        if spec.trl_step:  # one TRL step: its rollout and update
            rollout(s.prompts, s.n, s.max_new_tokens, "continuous", resident=loaded, what="TRL's rollout")
            seconds += step_s
        parts.update({"rollout": rollout_peak, "optimizer state (weights counted above)": trainer,
                      "loss logits": train["logits"], "activations": train["activations"]})
        notes.append(f"gradient_accumulation_steps={ga}: micro-batches of {rows // ga} completions")
    elif spec.kind == "logprobs":
        rows = s.prompts * s.n
        bf16_copy = 2 * params  # section 2 samples from a bf16 copy, beside the fp32 policy
        for what, dtype_bytes in (("the fp32 rollout", 4), ("the bf16 copy's rollout", 2), ("the top-p rollout", 4)):
            rollout(s.prompts, s.n, s.max_new_tokens, "continuous", resident=loaded + bf16_copy, what=what,
                    dtype_bytes=dtype_bytes)
            seconds += 2 * roofline.estimated_train_seconds(config, rows=rows, tokens_per_row=PROMPT_LEN +
                                                            s.max_new_tokens, machine=gpu, dtype="float32",
                                                            forwards=1) / 3
        from cbkit.train.batch import logits_bytes

        parts.update({"bf16 copy of the policy": bf16_copy, "rollout pools (two engines)": 2 * rollout_peak,
                      "teacher-forced logits (16 rows)": 3 * logits_bytes(min(16, rows), s.max_new_tokens,
                                                                          config.vocab_size) // 4})
    else:  # the memory sweeps of 01 and 03
        if spec.kind == "recycling":
            rollout(s.prompts, s.n, s.max_new_tokens, "generate")
            rollout(s.prompts, s.n, s.max_new_tokens, "continuous", resident=loaded, what="section 2's rollout")
        sweep = dict(num_prompts=s.sweep_prompts, max_new_tokens=s.sweep_new_tokens, **common)
        for workload in s.workloads if spec.kind == "sweep" else ("replay:gsm8k",):
            for n in s.sweep_ns:
                for _ in range(s.repeats):
                    rollout(s.sweep_prompts, n, s.sweep_new_tokens, "generate", workload)
                    rollout(s.sweep_prompts, n, s.sweep_new_tokens, "continuous", workload, resident=loaded,
                            what=f"the sweep's N={n}")
        crossovers.append(("the memory sweep", crossover_n(config, max_n=2 * max(s.sweep_ns), **sweep),
                           s.sweep_ns))
        parts["rollout"] = rollout_peak
        notes.append(f"pool {fmt_bytes(pool['num_blocks'] * pool['page_size'] * _kv(config, weight_bytes))} "
                     f"({s.pool_share or POOL_SHARE:.0%} of what a training step leaves on {TIER_MEMORY[tier] / GiB:.2f}"
                     " GiB)")
    checked = [EngineStart(what, rows, new, dtype_bytes, resident,
                           engine_admission(config, pool, rows=rows, new=new, dtype_bytes=dtype_bytes, machine=machine,
                                            resident=resident))
               for (rows, new, dtype_bytes), (what, resident) in starts.items()]
    budget_s = (spec.budget_s or BUDGET_S)[tier]
    return TierPlan(name, tier, machine, compute, sum(parts.values()), memory, seconds,
                    budget_s, crossovers, parts, notes, pool, checked, host_parts)


def engine_admission(config: Any, pool: dict[str, Any], *, rows: int, new: int, dtype_bytes: int, machine: str,
                     resident: int, flash: Sequence[int] = ()) -> Admission:
    """transformers' own verdict (`cbkit.rollout.admission.admission`) on a CB engine start of `rows` requests of
    `PROMPT_LEN` + `new` tokens with `pool`, on `machine` with `resident` bytes already on it (plus the CUDA
    context). Without flash-attn (``flash=()``, as on Colab) the engine also reserves its attention mask: the
    tighter case, and the only one for fp32 weights."""
    import torch

    return admission(config, pool, dtype={4: torch.float32, 2: torch.float16 if machine == "t4" else torch.bfloat16}[
        dtype_bytes], rows=[range(PROMPT_LEN)] * rows, max_new_tokens=new, total_bytes=device_bytes(machine),
        used_bytes=CUDA_CONTEXT_BYTES + resident, capability=CAPABILITY[machine], flash=flash)


def _micro_batches(rows: int, new_tokens: int, config: Any, tier: str) -> int:
    from cbkit.train.batch import micro_batches_for

    return micro_batches_for(rows, new_tokens, config.vocab_size, LOGITS_BUDGET_BYTES[tier])


def _kv(config: Any, dtype_bytes: int) -> int:
    return roofline.Shape.of(config).kv_bytes_per_token(dtype_bytes)
