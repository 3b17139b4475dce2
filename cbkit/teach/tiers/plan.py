"""`cbkit tiers`: one notebook on one GPU (`plan_notebook`): its peak by part, every CB engine start it makes with
transformers' own verdict on it (`EngineStart`), the copies of the weights it holds in host memory against a Colab
runtime's RAM, and each memory sweep's crossover (`TierPlan`); every notebook, recipe and
sweep preset checked (`plan_all`, `plan_recipes`, `plan_presets`, `tiers_report`). The pool a notebook fixes
(`pool_config`) is the one it runs and the one planned; the pool's size and what it keeps running come from the one
pool model (`cbkit.rollout.admission`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbkit.measure import roofline
from cbkit.measure.planner import crossover_n, plan, training_bytes
from cbkit.rollout.admission import Admission, admission, blocks_needed, pool_blocks
from cbkit.teach.tiers.table import (
    CAPABILITY,
    COLAB_RAM_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDA_TOTAL_BYTES,
    GPU_MODEL,
    GPU_TIERS,
    LESSON_PAGE_SIZE,
    LOGITS_BUDGET_BYTES,
    MACHINES,
    NOTEBOOKS,
    POOL_SHARE,
    PROMPT_LEN,
    RECIPES,
    TIER_MEMORY,
    GiB,
    Sizes,
    notebook_spec,
)
from cbkit.telemetry import fmt_bytes
from cbkit.train.snapshots import place_for_tier

# The hub models' config.json numbers, so that planning needs no download (Llama-3.2-1B has `llama-1b-random`'s shape).
_PLAN_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    GPU_MODEL: ("Qwen2Config", dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                                    num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                                    tie_word_embeddings=True)),
    "HuggingFaceTB/SmolLM2-360M-Instruct": ("LlamaConfig", dict(
        num_hidden_layers=32, hidden_size=960, intermediate_size=2560, num_attention_heads=15, num_key_value_heads=5,
        head_dim=64, vocab_size=49152, tie_word_embeddings=True)),
}
_SAME_SHAPE = {"meta-llama/Llama-3.2-1B-Instruct": "llama-1b-random"}


@functools.cache
def plan_config(model: str) -> Any:
    """The config a plan reads, without weights: a real transformers config, which the admission check builds on."""
    if model in _PLAN_CONFIGS:
        import transformers

        kind, values = _PLAN_CONFIGS[model]
        return getattr(transformers, kind)(**values)
    from cbkit.models.load import load_config

    return load_config(_SAME_SHAPE.get(model, model))


def device_bytes(machine: str) -> int:
    """A checked GPU's total memory as CUDA reports it where known (`CUDA_TOTAL_BYTES`), else roofline's datasheet."""
    return CUDA_TOTAL_BYTES.get(machine) or roofline.GPUS[machine].total_memory()


def parameter_count(config: Any) -> int:
    """Weights of a config: its matmul weights, plus the embedding where untied (norms and biases left out)."""
    shape = roofline.Shape.of(config)
    tied = getattr(config, "tie_word_embeddings", True)
    return shape.matmul_params + (0 if tied else shape.vocab * shape.hidden)


def pool_bytes(config: Any, tier: str, share: float, *, memory_bytes: int | None = None) -> int:
    """``share`` x what a training step of this model (16 bytes a parameter) leaves free on the tier's smallest GPU;
    for a model too large to train there, x what its 2-byte weights leave."""
    memory = memory_bytes or TIER_MEMORY[tier]
    params = parameter_count(config)
    state = training_bytes(params, micro_batch_rows=0, tokens_per_row=0, completion_len=1, config=config,
                           autocast=True)["optimizer_state"]
    left = memory - state if state < memory / 2 else memory - 2 * params
    if not 0 < share <= 1:
        raise ValueError(f"pool_share is a share of free memory in (0, 1], got {share}.")
    return int(share * left)


def pool_config(config: Any, sizes: Sizes, tier: str, *, dtype_bytes: int, rows: Sequence[Sequence[int]] = (),
                max_new_tokens: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """The CB engine settings that fix a notebook's pool (``{}``: cbkit's default): the notebook runs it
    (`NotebookEnv.pool_config`) and `plan_notebook` plans with it. GPU tiers: `pool_bytes` as ``num_blocks`` of
    ``LESSON_PAGE_SIZE`` tokens (on a dry run capped to half the ``rows`` at full length, so a CPU allocates no
    gigabytes and the waiting still happens), or without a ``pool_share`` every request at full length, a prompt of
    twice the mean each. CPU: ``pool_sequences`` sequences of the first row at full length."""
    from cbkit.rollout.engine_config import workload_blocks

    page = LESSON_PAGE_SIZE
    if sizes.pool_share is not None and tier in GPU_TIERS:
        blocks = pool_blocks(config, pool_bytes(config, tier, sizes.pool_share), page_size=page,
                             dtype_bytes=dtype_bytes)
        if dry_run and rows:
            blocks = min(blocks, workload_blocks(rows[: max(1, len(rows) // 2)], max_new_tokens or 1, page))
        return {"page_size": page, "num_blocks": blocks}
    if tier in GPU_TIERS:  # the plan, which has no prompts, sizes the very pool the notebook allocates
        requests = len(rows) or sizes.prompts * sizes.n
        return {"page_size": page, "num_blocks": workload_blocks([range(2 * PROMPT_LEN)] * requests,
                                                                 max_new_tokens or sizes.max_new_tokens, page)}
    if sizes.pool_sequences is not None and rows:
        return {"page_size": page, "num_blocks": workload_blocks([rows[0]] * sizes.pool_sequences,
                                                                 max_new_tokens or sizes.max_new_tokens, page)}
    return {}


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
    def shows_phenomenon(self) -> bool:
        return all(x is not None and min(ns) < x <= max(ns) for _, x, ns in self.crossovers)

    @property
    def ok(self) -> bool:
        return self.fits and self.admitted and self.shows_phenomenon

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
                f"{fmt_bytes(self.host_memory_bytes)} | {engine} | {cross} | {status}")


def plan_notebook(name: str, machine: str) -> TierPlan:
    """The planned peak, engine starts and crossovers of one notebook on one GPU of ``MACHINES``."""
    if machine not in MACHINES:
        raise ValueError(f"unknown GPU {machine!r}; the GPUs checked are {', '.join(MACHINES)}.")
    tier, dtype = MACHINES[machine]
    spec = notebook_spec(name)
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
    # Copies of the weights on the GPU: in the tier's place (`snapshots.place_for_tier`), the async engine's snapshot.
    place = place_for_tier(tier)
    on_gpu = spec.weight_copies if place == "device" else 0
    if on_gpu:
        parts[f"copies of the weights on the GPU ({on_gpu})"] = on_gpu * 4 * params
    # In host memory: the tier's copies kept there and those the notebook holds on the CPU (summed: an upper bound).
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
    rollout_peak = 0

    def rollout(prompts: int, n: int, new: int, backend: str, *, resident: int = 0,
                what: str = "a rollout", dtype_bytes: int = weight_bytes) -> None:
        """One rollout of the notebook; a CB one is an engine start with `resident` bytes on the GPU beside it."""
        nonlocal rollout_peak
        p = plan(config, num_prompts=prompts, num_generations=n, max_new_tokens=new, **common)
        rollout_peak = max(rollout_peak, (p.generate if backend == "generate" else p.continuous).peak_bytes)
        key = (prompts * n, new, dtype_bytes)
        if backend != "generate" and resident >= starts.get(key, ("", -1))[1]:
            starts[key] = (what, resident)

    loaded = weight_bytes * params + copies
    if spec.kind in ("step", "train"):
        rows = s.prompts * s.n
        ga = _micro_batches(rows, s.max_new_tokens, config, tier)
        train = training_bytes(params, micro_batch_rows=rows // ga, tokens_per_row=PROMPT_LEN + s.max_new_tokens,
                               completion_len=s.max_new_tokens, config=config, autocast=tier == "a100")
        # From the second step on, the trainer's gradients and AdamW's moments stay on the GPU between updates.
        trainer = train["optimizer_state"] - 4 * params
        for backend in spec.train_runs:
            for step in range(1, s.steps + 1):
                rollout(s.prompts, s.n, s.max_new_tokens, backend, resident=loaded + (trainer if step > 1 else 0),
                        what=f"step {step}'s rollout" + (" (the trainer's state resident)" if step > 1 else ""))
            if s.eval_every:  # the held-out evaluation, through the CB engine
                rollout(s.eval_prompts, s.eval_n, s.max_new_tokens, "continuous", resident=loaded + trainer,
                        what="the held-out evaluation after training")
        if spec.trl_step:  # one TRL step: its rollout and update
            rollout(s.prompts, s.n, s.max_new_tokens, "continuous", resident=loaded, what="TRL's rollout")
        parts.update({"rollout": rollout_peak, "optimizer state (weights counted above)": trainer,
                      "loss logits": train["logits"], "activations": train["activations"]})
        notes.append(f"gradient_accumulation_steps={ga}: micro-batches of {rows // ga} completions")
    elif spec.kind == "logprobs":
        rows = s.prompts * s.n
        bf16_copy = 2 * params  # section 2 samples from a bf16 copy, beside the fp32 policy
        for what, dtype_bytes in (("the fp32 rollout", 4), ("the bf16 copy's rollout", 2), ("the top-p rollout", 4)):
            rollout(s.prompts, s.n, s.max_new_tokens, "continuous", resident=loaded + bf16_copy, what=what,
                    dtype_bytes=dtype_bytes)
        from cbkit.train.batch import logits_bytes

        parts.update({"bf16 copy of the policy": bf16_copy, "rollout pools (two engines)": 2 * rollout_peak,
                      "teacher-forced logits (16 rows)": 3 * logits_bytes(min(16, rows), s.max_new_tokens,
                                                                          config.vocab_size) // 4})
    else:  # the memory sweeps of 01 and 03
        if spec.kind == "recycling":
            rollout(s.prompts, s.n, s.max_new_tokens, "generate")
            rollout(s.prompts, s.n, s.max_new_tokens, "continuous", resident=loaded, what="section 2's rollout")
        sweep = dict(num_prompts=s.sweep_prompts, max_new_tokens=s.sweep_new_tokens, **common)
        for n in s.sweep_ns:
            rollout(s.sweep_prompts, n, s.sweep_new_tokens, "generate")
            rollout(s.sweep_prompts, n, s.sweep_new_tokens, "continuous", resident=loaded, what=f"the sweep's N={n}")
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
    return TierPlan(name, tier, machine, compute, sum(parts.values()), memory, crossovers, parts, notes, pool, checked,
                    host_parts)


def engine_admission(config: Any, pool: dict[str, Any], *, rows: int, new: int, dtype_bytes: int, machine: str,
                     resident: int, flash: Sequence[int] = ()) -> Admission:
    """transformers' own verdict (`admission`) on a CB engine start of `rows` requests of `PROMPT_LEN` + `new` tokens
    with `pool` on `machine`, `resident` bytes (and the CUDA context) beside it; without flash-attn, as on Colab."""
    import torch

    return admission(config, pool, dtype={4: torch.float32, 2: torch.float16 if machine == "t4" else torch.bfloat16}[
        dtype_bytes], rows=[range(PROMPT_LEN)] * rows, max_new_tokens=new, total_bytes=device_bytes(machine),
        used_bytes=CUDA_CONTEXT_BYTES + resident, capability=CAPABILITY[machine], flash=flash)


def _micro_batches(rows: int, new_tokens: int, config: Any, tier: str) -> int:
    from cbkit.train.batch import micro_batches_for

    return micro_batches_for(rows, new_tokens, config.vocab_size, LOGITS_BUDGET_BYTES[tier])


def _kv(config: Any, dtype_bytes: int) -> int:
    return roofline.Shape.of(config).kv_bytes_per_token(dtype_bytes)


def plan_all(notebooks: Sequence[str] | None = None, machines: Sequence[str] | None = None) -> list[TierPlan]:
    return [plan_notebook(nb, m) for nb in (notebooks or list(NOTEBOOKS)) for m in (machines or list(MACHINES))]


def plan_recipes(machines: Sequence[str] | None = None) -> list[TierPlan]:
    """The learning recipes (``RECIPES``) on every GPU."""
    return [plan_notebook(r, m) for r in RECIPES for m in (machines or list(MACHINES))]


# --- the sweep's GPU presets -------------------------------------------------------------------------------------

# The GPUs each `cbkit sweep --preset` is meant for (cbkit.measure.presets.PRESET_NEEDS), checked on the smallest.
PRESET_MACHINES = {"trl-benchmark": "a100-40", "a100": "a100-40", "t4": "t4"}


@dataclass
class PresetPlan:
    preset: str
    machine: str
    admission: Admission
    requests: int  # the largest point's requests
    per_request: int  # blocks one request holds at full length
    generate_bytes: int  # generate()'s planned peak at the largest point, above the weights (`planner.plan`)
    free_bytes: int  # what the GPU has left for it: total less the CUDA context, the weights and the trainer's state

    @property
    def ok(self) -> bool:
        return self.admission.fits and self.generate_bytes <= self.free_bytes

    def line(self) -> str:
        a = self.admission
        held = min(self.requests, (a.num_blocks or 0) // self.per_request)
        return (f"--preset {self.preset:14} {self.machine:8} {a.line()}; its pool holds {held} of the largest point's "
                f"{self.requests} requests at full length; generate() needs {fmt_bytes(self.generate_bytes)} of "
                f"{fmt_bytes(self.free_bytes)} | {'ok' if self.ok else 'FAIL'}")


def plan_presets() -> list[PresetPlan]:
    """Each sweep preset's largest point on its GPU, through both backends: the CB engine's admission with the preset's
    CB settings, and `generate()`'s planned peak in what the GPU has left; a preset that holds a trainer's state
    (`presets.trainer_state_bytes`) has it resident beside the weights."""
    import torch

    from cbkit.measure.planner import plan
    from cbkit.measure.presets import PRESETS, TRAINER_STATE_COPIES
    from cbkit.measure.sweep_config import DEFAULT_NS

    out = []
    for name, preset in PRESETS.items():
        machine = PRESET_MACHINES[name]
        config = plan_config(preset["model"])
        params = parameter_count(config)
        dtype = getattr(torch, preset["dtype"])
        resident = dtype.itemsize * params
        if preset.get("trainer_state"):
            resident += TRAINER_STATE_COPIES * dtype.itemsize * params
        n = max(preset.get("ns", DEFAULT_NS))
        requests, new = preset["num_prompts"] * n, preset["max_new_tokens"]
        pool = dict(preset.get("cb_config", {}))
        total = device_bytes(machine)
        a = admission(config, pool, dtype=dtype, rows=[range(PROMPT_LEN)] * requests, max_new_tokens=new,
                      total_bytes=total, used_bytes=CUDA_CONTEXT_BYTES + resident, capability=CAPABILITY[machine])
        free = total - CUDA_CONTEXT_BYTES - resident
        generate = plan(config, num_prompts=preset["num_prompts"], num_generations=n, prompt_len=PROMPT_LEN,
                        max_new_tokens=new, dtype_bytes=dtype.itemsize, budget_bytes=free, device="cuda").generate
        out.append(PresetPlan(name, machine, a, requests, blocks_needed(PROMPT_LEN, new, a.page_size, share_prompt=False),
                              generate.peak_bytes, free))
    return out


def tiers_report(plans: Sequence[TierPlan]) -> str:
    """One line a notebook and GPU, then what is wrong with each failing one and the assumptions."""
    lines = [p.line() for p in plans]
    for p in plans:
        lines += [f"  {p.notebook} on {p.machine}: {problem}" for problem in p.problems()]
    lines += ["", f"Memory: the planner's peak of every rollout, prompts of {PROMPT_LEN} tokens, plus the weights and, "
              "where the notebook trains, the optimizer state, one micro-batch's logits and activations."]
    return "\n".join(lines)
