"""The tier table: every size of every notebook and recipe, per tier (``NOTEBOOKS``, ``RECIPES``), and the constants
of the GPUs they are checked on. A notebook's parameters cell reads its row (``env.sizes``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 2**30
TIERS = ("ci", "cpu", "t4", "a100")
GPU_TIERS = ("t4", "a100")
# The GPUs each tier is checked on: the roofline's datasheet machine and the rollout dtype (a T4 has no bf16).
MACHINES: dict[str, tuple[str, str]] = {"t4": ("t4", "float16"), "a100-40": ("a100", "bfloat16"),
                                        "a100-80": ("a100", "bfloat16")}
# What CUDA reports as a Colab T4's total (torch.cuda.mem_get_info), less than its datasheet's 15 GiB.
CUDA_TOTAL_BYTES = {"t4": int(14.74 * GiB)}
TIER_MEMORY = {"t4": CUDA_TOTAL_BYTES["t4"], "a100": 40 * GiB}  # the smallest GPU of each tier: its pool's basis
# Host RAM of a standard Colab runtime, as Colab advertises it: every copy of the weights kept on the host is planned
# against it.
COLAB_RAM_BYTES = int(12.7e9)
# The compute capability of each GPU checked: it decides the attention the engine runs (`engine_attention`).
CAPABILITY = {"t4": (7, 5), "a100-40": (8, 0), "a100-80": (8, 0), "h200": (9, 0)}
# What a process holds on a GPU before its first tensor (CUDA context, cuBLAS workspace): an assumption until a GPU
# run reads it (scripts/gpu_check.sh records torch.cuda.mem_get_info() after start-up).
CUDA_CONTEXT_BYTES = GiB // 2
# KV pages of the notebooks' pools: a GSM8K chat prompt (~130 tokens) fills four, so a group's N completions share
# its prompt's pages (prefix sharing); the engine's GPU default, 256 tokens, is never filled by one.
LESSON_PAGE_SIZE = 32
POOL_SHARE = 0.4  # TRL's example: max_memory_percent=0.4 with the trainer resident
# A chat prompt's length: GSM8K test questions with cbkit's system prompt, in SmolLM2's tokens (131.6 on average).
PROMPT_LEN = 132
DRY_MODEL = "llama-tiny-random"
GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# Per tier: the loss's logits budget a micro-batch. On a T4 a 0.5B model's fp32 training state takes 8 of ~14.7 GiB.
LOGITS_BUDGET_BYTES = {"ci": 2 * GiB, "cpu": 2 * GiB, "t4": GiB, "a100": 8 * GiB}


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
    # GPU (the package's docstring). CPU: ``pool_sequences`` sequences at full length, else sized to the workload.
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
    # Copies of the training weights the notebook keeps at its fullest point, beside the policy, where the tier keeps
    # them (`cbkit.train.snapshots.place_for_tier`; 04: the initial weights; 05: the initial weights, staleness 4's
    # k + 1 ring and a run's kept final weights), and whether one of its runs is async (the engine's own weight
    # snapshot, always on the GPU).
    weight_copies: int = 0
    async_run: bool = False
    # Copies of the weights it holds in host memory wherever the tier keeps the others (05's section 2 compares three
    # state dicts on the CPU), planned against `COLAB_RAM_BYTES` with those the tier keeps on the host.
    host_copies: int = 0

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
        # GRPO's shape at every tier: several prompts, completions longer than the ~110-token prompts (the replay's
        # mean is 0.53 of its limit), a pool that holds half the largest rollout (CPU tiers), three N or more.
        # CI: the 2-layer random model (lengths are replayed, EOS ignored: the workload is the same), so that GRPO's
        # shape (completions longer than the prompts, a pool smaller than the rollout) fits CI's minutes on 2 cores.
        "ci": Sizes(DRY_MODEL, 2, 8, 256, sweep_ns=(2, 4, 8), sweep_prompts=2, sweep_new_tokens=256, pool_sequences=6,
                    workloads=("fixed", "replay:gsm8k")),
        "cpu": Sizes(_SMOL, 4, 8, 256, sweep_ns=(4, 8, 16), sweep_prompts=4, sweep_new_tokens=256,
                     pool_sequences=32, workloads=("fixed", "replay:gsm8k")),
        "t4": Sizes(_SMOL, 8, 8, 1024, sweep_ns=(8, 16, 32), sweep_prompts=8, sweep_new_tokens=1024,
                    workloads=("fixed", "replay:gsm8k"), pool_share=POOL_SHARE),
        "a100": Sizes(_1B, 6, 8, 2048, sweep_ns=(8, 16, 32), sweep_prompts=6, sweep_new_tokens=2048,
                      workloads=("replay:gsm8k",), pool_share=POOL_SHARE)}),
    NotebookSpec("04_grpo_live", "train", train_runs=("continuous", "generate"), trl_step=True, weight_copies=1,
                 sizes={
        # CI: a dozen steps of the 2-layer random model on the lowercase reward (the notebook's parameters cell), so
        # the chart shows a trend in a few seconds a run. 1e-2 is a rate only a model this small takes: SmolLM2
        # learns at 1e-5 to 3e-5, at 26 s a step of 4 prompts x 8 on a 2-core CPU (recipes/smollm2_arith.yaml).
        "ci": Sizes(DRY_MODEL, 2, 8, 24, steps=12, learning_rate=1e-2, eval_prompts=8, eval_n=2),  # no held-out set
        # CPU: within 5 minutes and 4 GiB on a 2-core laptop with the step split and the TRL step (docs/workshop.md).
        "cpu": Sizes(_SMOL, 2, 4, 32, steps=3, learning_rate=5e-5, eval_every=3, eval_prompts=8, eval_n=2),
        "t4": Sizes(GPU_MODEL, 4, 8, 256, steps=6, learning_rate=3e-6, eval_every=6, eval_prompts=64, eval_n=2),
        "a100": Sizes(GPU_MODEL, 8, 16, 256, steps=8, learning_rate=3e-6, eval_every=8, eval_prompts=64,
                      eval_n=2)}),
    # Off-policy: one run per staleness (3), the uncorrected one at the correction's staleness (the corrected one is
    # the staleness run's), one async: five training runs. The CI size trains the 2-layer random model, whose
    # word-piece tokens decode to text, at a learning rate a real run uses: it shows the mechanics (drift, ratios,
    # versions) at a real run's scale, not learning. Its 10 steps at staleness 4 sample steps 6-10 from versions 1-5:
    # from version 2 on (the first update whose rollout was stale) the runs with and without the correction roll
    # out from different weights. 5 steps would sample every rollout from the initial weights in both.
    NotebookSpec("05_off_policy", "train", train_runs=("continuous",) * 5, weight_copies=1 + 5 + 1, async_run=True,
                 host_copies=3, sizes={
        "ci": Sizes(DRY_MODEL, 2, 4, 16, steps=10, learning_rate=1e-4),
        # CPU: 5 steps reach staleness 4 (as at CI size); N=4 x 16 tokens and no system prompt (05 rewards lowercase
        # there) keep the notebook within 5 minutes, and it keeps its weight snapshots on disk (lab/memory.md: in
        # memory they alone need 3 GB).
        "cpu": Sizes(_SMOL, 2, 4, 16, steps=5, learning_rate=5e-5),
        "t4": Sizes(GPU_MODEL, 2, 8, 128, steps=6, learning_rate=3e-6, dry_steps=5),
        "a100": Sizes(GPU_MODEL, 8, 8, 128, steps=6, learning_rate=3e-6, dry_steps=5)}),
)}


# The learning recipe (recipes/smollm2_arith.yaml) on the GPU tiers, planned like a notebook that trains: one CB run
# of `steps` steps with its held-out evaluations. A GPU trains the hub model, on which one-digit sums are too easy: its
# difficulty (data_options) is chosen by the same base-model measurement as on the CPU (docs/learning.md).
RECIPES: dict[str, NotebookSpec] = {spec.name: spec for spec in (
    NotebookSpec("recipe smollm2_arith", "train", train_runs=("continuous",), sizes={
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

