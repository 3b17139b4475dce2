"""The notebooks on the GPUs their users have: every size of every notebook, per tier, in one table, and the
plan that checks each one without a GPU (`cbkit tiers`).

A notebook's parameters cell reads its sizes from ``NOTEBOOKS`` (``env.sizes``), so what a facilitator checks
before a workshop is what the notebook will run. For every notebook and GPU (a T4's 15 GiB in fp16, an A100's
40 and 80 GiB in bf16) the check asks three questions, each answered by arithmetic, never by a run:

* **does it fit?** The planner's peak (`cbkit.measure.planner`) of every rollout the notebook makes, plus the
  weights, plus, where the notebook trains, what the training step holds (`planner.training_bytes`);
* **does it finish in time?** ~10 minutes on a T4, ~5 on an A100, by the roofline (`cbkit.measure.roofline`'s
  ``estimated_*_seconds``: the roof slowed to an assumed efficiency, never under a per-step launch floor), plus
  ``OVERHEAD_S`` for imports and loading (downloads excluded). An estimate until a GPU run replaces it;
* **does it show its phenomenon?** Each memory sweep's crossover (the first N at which the CB engine's peak is
  below ``generate()``'s, ``planner.crossover_n``) must lie inside the swept N, or the figure teaches the
  opposite of its text.

**The pool is a fixed price.** On a GPU the CB engine's default pool is half the free memory, 7 to 35 GiB,
which no notebook-sized ``generate()`` batch outgrows. TRL's benchmark shows the inversion because its pool is a
share (``max_memory_percent=0.4``) of what the *training step* leaves free. So on a GPU tier the notebooks fix
the pool in bytes: ``pool_share`` x (the tier's smallest GPU - the optimizer state a training step of the
rolled-out model holds), the same pool on a 40 and an 80 GiB A100, and the same crossover.

``CBKIT_TIER=t4|a100`` with ``CBKIT_PROFILE=ci`` runs a notebook's tier on a CPU at dry-run sizes
(``Sizes.dry``): every tier branch, preset and TRL config executes in CI, on a 2-layer random model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbkit.measure import roofline
from cbkit.measure.planner import crossover_n, plan, pool_blocks, training_bytes
from cbkit.rollout.engine import Admission, admission
from cbkit.telemetry import fmt_bytes
from cbkit.train.snapshots import place_for_tier

GiB = 2**30
TIERS = ("ci", "cpu", "t4", "a100")
GPU_TIERS = ("t4", "a100")
# The GPUs each tier is checked on: the roofline's datasheet machine and the rollout dtype (a T4 has no bf16).
MACHINES: dict[str, tuple[str, str]] = {"t4": ("t4", "float16"), "a100-40": ("a100", "bfloat16"),
                                        "a100-80": ("a100", "bfloat16")}
TIER_MEMORY = {"t4": 15 * GiB, "a100": 40 * GiB}  # the smallest GPU of each tier: what its pool is sized for
# What a process holds on a GPU before its first tensor: the CUDA context, cuBLAS's workspace, the allocator's
# rounding. An assumption (PyTorch's CUDA context is commonly 0.3-0.5 GiB) until a GPU run reads it
# (scripts/gpu_check.py records torch.cuda.mem_get_info() after start-up).
CUDA_CONTEXT_BYTES = GiB // 2
# KV pages of the notebooks' pools, on every device: a GSM8K chat prompt (~130 tokens) fills four, so the N
# completions of a group share its prompt's pages (prefix sharing), as on a CPU. The engine's GPU default, 256
# tokens, is never filled by one, and nothing would be shared. Pages under 256 tokens turn the engine's
# block-table decode path off (`engine_config.KERNEL_PAGE_MULTIPLE`).
LESSON_PAGE_SIZE = 32
BUDGET_S = {"t4": 600, "a100": 300}
OVERHEAD_S = 30  # imports, model build or load from the local cache, the engine's start; downloads excluded
POOL_SHARE = 0.4  # TRL's example: max_memory_percent=0.4 with the trainer resident
# A chat prompt's length: GSM8K test questions with cbkit's system prompt average 122.5 tokens with the piece
# tokenizer of llama-1b-random and 131.6 with SmolLM2's BPE (cbkit.models.synthetic).
PROMPT_LEN = 132
DRY_MODEL = "llama-tiny-random"
GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# Per tier: the loss's logits budget. A T4 has 15 GiB: fp32 weights, gradients and AdamW's two moments of a
# 0.5B model take 8 GiB, activations and the rollout's KV pool most of the rest. An A100 (40 or 80 GB) has room.
LOGITS_BUDGET_BYTES = {"ci": 2 * GiB, "cpu": 2 * GiB, "t4": 2 * GiB, "a100": 8 * GiB}

# The hub models' config.json (the numbers the plan reads), so that planning needs no download: Qwen2.5-0.5B-Instruct
# (the notebooks' GPU model) and SmolLM2-360M-Instruct (the sweep's t4 preset). Llama-3.2-1B-Instruct (the a100
# preset) has the shape of `llama-1b-random`, which cbkit builds in code.
_PLAN_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    GPU_MODEL: ("Qwen2Config", dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                                    num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                                    tie_word_embeddings=True)),
    "HuggingFaceTB/SmolLM2-360M-Instruct": ("LlamaConfig", dict(
        num_hidden_layers=32, hidden_size=960, intermediate_size=2560, num_attention_heads=15, num_key_value_heads=5,
        head_dim=64, vocab_size=49152, tie_word_embeddings=True)),
}
_SAME_SHAPE = {"meta-llama/Llama-3.2-1B-Instruct": "llama-1b-random"}


@dataclass(frozen=True)
class Sizes:
    """One notebook's sizes at one tier. A notebook reads the fields it uses; `cbkit tiers` plans them all."""

    model: str
    prompts: int  # prompts per rollout (per step where the notebook trains)
    n: int  # completions per prompt
    max_new_tokens: int
    steps: int = 1  # training steps per run (00, 04)
    sweep_ns: tuple[int, ...] = ()
    sweep_prompts: int = 1
    sweep_new_tokens: int = 0
    repeats: int = 1
    workloads: tuple[str, ...] = ("replay:gsm8k",)
    # The CB pool. GPU tiers: this share of what a training step of the model leaves free on the tier's smallest
    # GPU (the module docstring). CPU: ``pool_sequences`` sequences at full length, else sized to the workload.
    pool_share: float | None = None
    pool_sequences: int | None = None
    learning_rate: float = 5e-6
    # Held-out evaluation (a recipe's eval_steps): every `eval_every` steps and before the first, `eval_prompts` x
    # `eval_n` completions through the CB engine. 0: none.
    eval_every: int = 0
    eval_prompts: int = 0
    eval_n: int = 0
    # Steps at dry-run size: one shows every branch, but 05 needs staleness 4 reached (5 steps, as at CI size).
    dry_steps: int = 1

    def dry(self) -> Sizes:
        """The same code path at CI size on a CPU: a 2-layer random model, two prompts, a few tokens."""
        ns = tuple(sorted({min(n, 2 * (i + 1)) for i, n in enumerate(self.sweep_ns)}))
        return dataclasses.replace(self, model=DRY_MODEL, prompts=min(self.prompts, 2), n=min(self.n, 4),
                                   max_new_tokens=min(self.max_new_tokens, 12), steps=self.dry_steps, sweep_ns=ns,
                                   sweep_prompts=min(self.sweep_prompts, 2),
                                   sweep_new_tokens=min(self.sweep_new_tokens, 8), repeats=1,
                                   eval_every=min(self.eval_every, self.dry_steps), eval_prompts=min(self.eval_prompts, 4))


@dataclass(frozen=True)
class NotebookSpec:
    name: str
    kind: str  # "step", "recycling", "logprobs", "sweep", "train": what `plan_notebook` adds up
    sizes: dict[str, Sizes]
    # Where it trains: one training run per entry, on that rollout backend, of `Sizes.steps` steps each, and
    # whether a TRL step follows them (04 runs CB, then generate(), then one TRL step).
    train_runs: tuple[str, ...] = ("continuous",)
    trl_step: bool = False
    budget_s: dict[str, float] | None = None  # per tier; None: BUDGET_S (a notebook's slot in a workshop)
    # Copies of the training weights the notebook keeps at its fullest point, beside the policy, where the tier keeps
    # them (`cbkit.train.snapshots.place_for_tier`; 04: the initial weights; 05: the initial weights, staleness 4's k + 1 ring and a run's kept
    # final weights), and whether one of its runs is async (the engine's own weight snapshot, always on the GPU).
    weight_copies: int = 0
    async_run: bool = False

    @property
    def trains(self) -> bool:
        return self.kind in ("step", "train")


_SMOL = "smollm2-offline"
_1B = "llama-1b-random"
NOTEBOOKS: dict[str, NotebookSpec] = {spec.name: spec for spec in (
    NotebookSpec("00_quickstart", "step", {
        "ci": Sizes(_SMOL, 2, 8, 32), "cpu": Sizes(_SMOL, 2, 8, 96),
        "t4": Sizes(GPU_MODEL, 4, 8, 256, learning_rate=1e-6),
        "a100": Sizes(GPU_MODEL, 8, 16, 256, learning_rate=1e-6)}),
    NotebookSpec("01_kv_slot_recycling", "recycling", {
        "ci": Sizes(_SMOL, 2, 8, 40, sweep_ns=(4, 8, 16), sweep_new_tokens=24, pool_sequences=12),
        "cpu": Sizes(_SMOL, 2, 16, 128, sweep_ns=(8, 16, 32, 64), sweep_new_tokens=64, pool_sequences=48),
        "t4": Sizes(_SMOL, 4, 16, 512, sweep_ns=(16, 32, 56), sweep_prompts=8, sweep_new_tokens=1024,
                    pool_share=POOL_SHARE),
        "a100": Sizes(_1B, 4, 16, 512, sweep_ns=(16, 48), sweep_prompts=6, sweep_new_tokens=2048,
                      pool_share=POOL_SHARE)}),
    NotebookSpec("02_logprob_correctness", "logprobs", {
        "ci": Sizes(_SMOL, 2, 4, 32), "cpu": Sizes(_SMOL, 3, 8, 96),  # CPU: 24 completions, within 5 minutes
        "t4": Sizes(GPU_MODEL, 4, 8, 256),
        "a100": Sizes(GPU_MODEL, 8, 16, 256)}),
    NotebookSpec("03_n_sweep", "sweep", {
        "ci": Sizes(_SMOL, 1, 8, 16, sweep_ns=(8, 32), workloads=("fixed", "replay:gsm8k")),
        "cpu": Sizes(_SMOL, 1, 8, 96, sweep_ns=(8, 16, 32, 64), workloads=("fixed", "replay:gsm8k")),
        "t4": Sizes(_SMOL, 8, 8, 1024, sweep_ns=(16, 56), sweep_prompts=8, sweep_new_tokens=1024,
                    workloads=("fixed", "replay:gsm8k"), pool_share=POOL_SHARE),
        "a100": Sizes(_1B, 6, 8, 2048, sweep_ns=(16, 64), sweep_prompts=6, sweep_new_tokens=2048,
                      workloads=("replay:gsm8k",), pool_share=POOL_SHARE)}),
    NotebookSpec("04_grpo_live", "train", train_runs=("continuous", "generate"), trl_step=True, weight_copies=1, sizes={
        "ci": Sizes(_SMOL, 2, 6, 24, steps=2, learning_rate=5e-5, eval_every=2, eval_prompts=8, eval_n=2),
        # CPU: within 5 minutes and 4 GiB on a 2-core laptop with the step split and the TRL step (docs/workshop.md).
        "cpu": Sizes(_SMOL, 2, 4, 32, steps=3, learning_rate=5e-5, eval_every=3, eval_prompts=8, eval_n=2),
        "t4": Sizes(GPU_MODEL, 4, 8, 256, steps=6, learning_rate=3e-6, eval_every=6, eval_prompts=64, eval_n=2),
        "a100": Sizes(GPU_MODEL, 8, 16, 256, steps=8, learning_rate=3e-6, eval_every=8, eval_prompts=64,
                      eval_n=2)}),
    # Off-policy: one run per staleness (3), the uncorrected one at the correction's staleness (the corrected one is
    # the staleness run's), one async: five training runs. The CI size trains the random tiny model, which shows the
    # mechanics (drift, ratios, versions), not learning.
    NotebookSpec("05_off_policy", "train", train_runs=("continuous",) * 5, weight_copies=1 + 5 + 1, async_run=True,
                 sizes={
        "ci": Sizes("tiny", 2, 4, 12, steps=5, learning_rate=1e-2),
        # CPU: 5 steps reach staleness 4 (as at CI size); N=4 x 16 tokens and no system prompt (05 rewards lowercase
        # there) keep the notebook within 5 minutes, and it keeps its weight snapshots on disk (docs/memory.md: in
        # memory they alone need 3 GB).
        "cpu": Sizes(_SMOL, 2, 4, 16, steps=5, learning_rate=5e-5),
        "t4": Sizes(GPU_MODEL, 2, 8, 128, steps=6, learning_rate=3e-6, dry_steps=5),
        "a100": Sizes(GPU_MODEL, 8, 8, 128, steps=6, learning_rate=3e-6, dry_steps=5)}),
)}


# The learning recipe (recipes/smollm2_arith.yaml) on the GPU tiers, planned like a notebook that trains: one CB run
# of `steps` steps with its held-out evaluations, in the 15 minutes the CPU recipe may take. A GPU trains the hub model, on which one-digit sums are too easy: its difficulty (data_options) is chosen
# by the same base-model measurement as on the CPU (docs/learning.md). An estimate until a GPU runs it.
RECIPE_BUDGET_S = 15 * 60
RECIPES: dict[str, NotebookSpec] = {spec.name: spec for spec in (
    NotebookSpec("recipe smollm2_arith", "train", train_runs=("continuous",),
                 budget_s={"t4": RECIPE_BUDGET_S, "a100": RECIPE_BUDGET_S}, sizes={
                     "cpu": Sizes(_SMOL, 2, 8, 32, steps=40, learning_rate=3e-5, eval_every=8, eval_prompts=64,
                                  eval_n=2),
                     "t4": Sizes(GPU_MODEL, 4, 8, 128, steps=40, learning_rate=1e-6, eval_every=8, eval_prompts=64,
                                 eval_n=4),
                     "a100": Sizes(GPU_MODEL, 8, 16, 256, steps=40, learning_rate=1e-6, eval_every=8,
                                   eval_prompts=64, eval_n=4)}),
)}


def notebook_spec(name: str) -> NotebookSpec:
    if name in RECIPES:
        return RECIPES[name]
    if name not in NOTEBOOKS:
        raise ValueError(f"no notebook {name!r}; the notebooks are {', '.join(NOTEBOOKS)}.")
    return NOTEBOOKS[name]


def sizes_for(name: str, tier: str, *, dry_run: bool = False) -> Sizes:
    """A notebook's sizes at a tier (``dry_run``: the same tier at CI size, for a CPU)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; the tiers are {', '.join(TIERS)}.")
    sizes = notebook_spec(name).sizes[tier]
    return sizes.dry() if dry_run else sizes


# --- configs, parameters and the pool --------------------------------------------------------------------------


@functools.cache
def plan_config(model: str) -> Any:
    """The config a plan reads, without weights: written out for the GPU model (a real transformers config, which
    the engine's admission check builds its cache from), else `models.load.load_config`."""
    if model in _PLAN_CONFIGS:
        import transformers

        kind, values = _PLAN_CONFIGS[model]
        return getattr(transformers, kind)(**values)
    from cbkit.models.load import load_config

    return load_config(_SAME_SHAPE.get(model, model))


def parameter_count(config: Any) -> int:
    """Weights of a config: its matmul weights plus the embedding where it is not tied to the LM head (norms and
    biases, well under 1%, left out)."""
    shape = roofline.Shape.of(config)
    tied = getattr(config, "tie_word_embeddings", True)
    return shape.matmul_params + (0 if tied else shape.vocab * shape.hidden)


def pool_bytes(config: Any, tier: str, share: float, *, memory_bytes: int | None = None) -> int:
    """``share`` x what a training step of this model leaves free on the tier's smallest GPU: its memory less the
    optimizer state (16 bytes a parameter, `planner.training_bytes`). A model too large to train there (a 1B on a
    T4) gets the share of what its bf16/fp16 weights leave."""
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
    """The CB engine settings that fix a notebook's pool: ``{}`` (cbkit's default) where the sizes fix none. The one
    rule for it: the notebook runs it (`NotebookEnv.pool_config`) and `plan_notebook` plans with it.

    GPU tiers: `pool_bytes` as ``num_blocks`` of ``LESSON_PAGE_SIZE`` tokens, or without a ``pool_share`` every request
    (``rows``, else prompts x n of the sizes) at full length. On a dry run the pool is the same share
    of a tier's GPU, capped to hold half the requests ``rows`` at full length, so that a CPU does not allocate
    gigabytes and the waiting still happens. CPU: ``pool_sequences`` sequences of the first row at full length."""
    from cbkit.rollout.engine_config import workload_blocks

    page = LESSON_PAGE_SIZE
    if sizes.pool_share is not None and tier in GPU_TIERS:
        blocks = pool_blocks(config, pool_bytes(config, tier, sizes.pool_share), page_size=page,
                             dtype_bytes=dtype_bytes)
        if dry_run and rows:
            blocks = min(blocks, workload_blocks(rows[: max(1, len(rows) // 2)], max_new_tokens or 1, page))
        return {"page_size": page, "num_blocks": blocks}
    if tier in GPU_TIERS:  # every request at full length: a share of free memory would be gigabytes
        # Each request gets room for a prompt twice the mean, whatever the rows' own lengths: the plan, which has no
        # prompts, then sizes the very pool the notebook allocates. A longer prompt waits for a request to end.
        requests = len(rows) or sizes.prompts * sizes.n
        return {"page_size": page, "num_blocks": workload_blocks([range(2 * PROMPT_LEN)] * requests,
                                                                 max_new_tokens or sizes.max_new_tokens, page)}
    if sizes.pool_sequences is not None and rows:
        return {"page_size": page, "num_blocks": workload_blocks([rows[0]] * sizes.pool_sequences,
                                                                 max_new_tokens or sizes.max_new_tokens, page)}
    return {}


# --- the plan of one notebook on one GPU -----------------------------------------------------------------------


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

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.memory_bytes

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
        if not self.fits:
            big = max(self.parts, key=self.parts.get)
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
                f"{fmt_bytes(self.memory_bytes):>9} | {engine} | ~{self.seconds / 60:4.1f} of "
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
    memory = gpu.memory_bytes - CUDA_CONTEXT_BYTES
    budget = memory - weight_bytes * params
    common = dict(prompt_len=PROMPT_LEN, dtype_bytes=weight_bytes, device="cuda", budget_bytes=budget,
                  cb_config=pool)
    parts: dict[str, int] = {"weights": weight_bytes * params}
    # Copies of the weights the notebook keeps on the GPU: in the tier's place, and the async engine's own snapshot.
    on_gpu = spec.weight_copies if place_for_tier(tier) == "device" else 0
    if on_gpu:
        parts[f"copies of the weights on the GPU ({on_gpu})"] = on_gpu * 4 * params
    if spec.async_run:
        parts["the async engine's weight snapshot"] = 4 * params
    copies = sum(v for k, v in parts.items() if k != "weights")
    crossovers: list[tuple[str, int | None, tuple[int, ...]]] = []
    notes: list[str] = []
    starts: dict[tuple, tuple[str, int]] = {}  # (rows, new tokens, dtype bytes) -> (what, most resident bytes)
    seconds = OVERHEAD_S
    rollout_peak = 0

    def rollout(prompts: int, n: int, new: int, backend: str, lengths: str = "replay:gsm8k", *, resident: int = 0,
                what: str = "a rollout", dtype_bytes: int = weight_bytes) -> None:
        """One rollout of the notebook; a CB one is an engine start with `resident` bytes on the GPU beside it."""
        nonlocal seconds, rollout_peak
        p = plan(config, num_prompts=prompts, num_generations=n, max_new_tokens=new, **common)
        rollout_peak = max(rollout_peak, (p.generate if backend == "generate" else p.continuous).peak_bytes)
        seconds += _rollout_seconds(config, prompts, n, new, backend, lengths, pool, gpu, compute, weight_bytes)
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
                     f"({s.pool_share or POOL_SHARE:.0%} of what a training step leaves on {TIER_MEMORY[tier] // GiB}"
                     " GiB)")
    checked = [EngineStart(what, rows, new, dtype_bytes, resident,
                           engine_admission(config, pool, rows=rows, new=new, dtype_bytes=dtype_bytes, machine=machine,
                                            resident=resident))
               for (rows, new, dtype_bytes), (what, resident) in starts.items()]
    budget_s = (spec.budget_s or BUDGET_S)[tier]
    return TierPlan(name, tier, machine, compute, sum(parts.values()), memory, seconds,
                    budget_s, crossovers, parts, notes, pool, checked)


# The compute capability of each GPU checked: it decides the attention the engine runs (`cuda_attention`).
CAPABILITY = {"t4": (7, 5), "a100-40": (8, 0), "a100-80": (8, 0), "h200": (9, 0)}


def engine_admission(config: Any, pool: dict[str, Any], *, rows: int, new: int, dtype_bytes: int, machine: str,
                     resident: int, flash: Sequence[int] = ()) -> Admission:
    """transformers' own verdict (`cbkit.rollout.engine.admission`) on a CB engine start of `rows` requests of
    `PROMPT_LEN` + `new` tokens with `pool`, on `machine` with `resident` bytes already on it (plus the CUDA
    context). Without flash-attn (``flash=()``, as on Colab) the engine also reserves its attention mask: the
    tighter case, and the only one for fp32 weights."""
    import torch

    return admission(config, pool, dtype={4: torch.float32, 2: torch.float16 if machine == "t4" else torch.bfloat16}[
        dtype_bytes], rows=[range(PROMPT_LEN)] * rows, max_new_tokens=new, total_bytes=roofline.GPUS[machine].memory_bytes,
        used_bytes=CUDA_CONTEXT_BYTES + resident, capability=CAPABILITY[machine], flash=flash)


def estimated_train_step(config: Any, rows: int, new_tokens: int, gpu: roofline.Machine, dtype: str) -> float:
    """The old-logprob forward and the loss's forward and backward of one step, by the roofline."""
    return roofline.estimated_train_seconds(config, rows=rows, tokens_per_row=PROMPT_LEN + new_tokens,
                                            machine=gpu, dtype=dtype, forwards=2)


def _micro_batches(rows: int, new_tokens: int, config: Any, tier: str) -> int:
    from cbkit.train.batch import micro_batches_for

    return micro_batches_for(rows, new_tokens, config.vocab_size, LOGITS_BUDGET_BYTES[tier])


def _kv(config: Any, dtype_bytes: int) -> int:
    return roofline.Shape.of(config).kv_bytes_per_token(dtype_bytes)


def _rollout_seconds(config, prompts, n, new, backend, lengths, pool, gpu, dtype, dtype_bytes) -> float:
    running = _running(prompts * n, new, backend, lengths, pool["num_blocks"], pool["page_size"])
    return roofline.estimated_rollout_seconds(config, prompt_lens=[PROMPT_LEN] * prompts, running=running,
                                              context=PROMPT_LEN + new // 2, dtype_bytes=dtype_bytes, machine=gpu,
                                              dtype=dtype)


@functools.cache
def _running(rows: int, new: int, backend: str, lengths: str, num_blocks: int, page: int) -> tuple[int, ...]:
    """Sequences decoding at each step: a static batch runs every row until the longest ends; the pool admits
    what its blocks cover (`teach.recycling.paged_pool`, the same model the explorer draws)."""
    from cbkit.measure.workload import parse_lengths
    from cbkit.teach.recycling import paged_pool, static_batch

    targets = parse_lengths(lengths).targets(rows, new, seed=0) or [new] * rows
    if backend == "generate":
        return static_batch(PROMPT_LEN, targets).running
    worst = math.ceil((PROMPT_LEN + new) / page)
    return paged_pool(PROMPT_LEN, targets, page, pool_blocks=max(num_blocks, worst), max_len=new).running


# --- every notebook on every GPU --------------------------------------------------------------------------------


def plan_all(notebooks: Sequence[str] | None = None, machines: Sequence[str] | None = None) -> list[TierPlan]:
    return [plan_notebook(nb, m) for nb in (notebooks or list(NOTEBOOKS)) for m in (machines or list(MACHINES))]


def plan_recipes(machines: Sequence[str] | None = None) -> list[TierPlan]:
    """The learning recipes (``RECIPES``) on every GPU: an estimate until a GPU runs them."""
    return [plan_notebook(r, m) for r in RECIPES for m in (machines or list(MACHINES))]


# --- the sweep's GPU presets -------------------------------------------------------------------------------------

# The GPUs each `cbkit sweep --preset` is meant for (cbkit.measure.sweep.PRESET_NEEDS), checked on the smallest.
PRESET_MACHINES = {"trl-benchmark": "a100-40", "a100": "a100-40", "t4": "t4"}


@dataclass
class PresetPlan:
    preset: str
    machine: str
    admission: Admission
    requests: int  # the largest point's requests
    full_length: int  # tokens one request holds at full length
    page: int  # tokens per KV page

    @property
    def ok(self) -> bool:
        return self.admission.fits

    def line(self) -> str:
        a = self.admission
        held = min(self.requests, (a.num_blocks or 0) * self.page // self.full_length) if a.fits else 0
        return (f"--preset {self.preset:14} {self.machine:8} {a.line()}; its pool holds {held} of the largest point's "
                f"{self.requests} requests at full length | {'ok' if self.ok else 'FAIL'}")


def plan_presets() -> list[PresetPlan]:
    """Each sweep preset's largest point on its GPU: the engine's admission with the preset's own CB settings and, for
    a preset that holds a trainer's state (`trainer_state`, TRL's setting), that state resident beside the weights."""
    import torch

    from cbkit.measure.planner import ADAM_BYTES_PER_PARAM, GRAD_BYTES_PER_PARAM
    from cbkit.measure.sweep import DEFAULT_NS, PRESETS
    from cbkit.rollout.engine_config import page_size

    out = []
    for name, preset in PRESETS.items():
        machine = PRESET_MACHINES[name]
        config = plan_config(preset["model"])
        params = parameter_count(config)
        dtype = getattr(torch, preset["dtype"])
        resident = dtype.itemsize * params
        if preset.get("trainer_state"):
            resident += (GRAD_BYTES_PER_PARAM + ADAM_BYTES_PER_PARAM) * params
        requests = preset["num_prompts"] * max(preset.get("ns", DEFAULT_NS))
        new = preset["max_new_tokens"]
        pool = dict(preset.get("cb_config", {}))
        a = admission(config, pool, dtype=dtype, rows=[range(PROMPT_LEN)] * requests, max_new_tokens=new,
                      total_bytes=roofline.GPUS[machine].memory_bytes, used_bytes=CUDA_CONTEXT_BYTES + resident,
                      capability=CAPABILITY[machine])
        out.append(PresetPlan(name, machine, a, requests, PROMPT_LEN + new, page_size(pool)))
    return out


def tiers_report(plans: Sequence[TierPlan]) -> str:
    """One line a notebook and GPU, then what is wrong with each failing one and the assumptions."""
    lines = [p.line() for p in plans]
    for p in plans:
        lines += [f"  {p.notebook} on {p.machine}: {problem}" for problem in p.problems()]
    lines += [
        "",
        f"Runtime: an estimate, not a measurement. Each decode step at {roofline.DECODE_EFFICIENCY:.0%} of the "
        f"lower roof (datasheet peaks), never under {roofline.LAUNCH_S_PER_LAYER * 1e3:.2f} ms a layer (HF's eager "
        f"kernel launches, from TRL PR #5765's 41.12 s for 2048 steps of a 16-layer model on an A100); training at "
        f"{roofline.TRAIN_EFFICIENCY:.0%} of the matmul peak; plus {OVERHEAD_S} s of imports and loading; downloads "
        "excluded. Memory: the planner's peak of every rollout (generate() held until its longest row ends, the CB "
        f"pool fixed at its share of the tier's smallest GPU), prompts of {PROMPT_LEN} tokens, plus the weights "
        "and, where the notebook trains, the optimizer state, one micro-batch's logits and its activations.",
    ]
    return "\n".join(lines)
