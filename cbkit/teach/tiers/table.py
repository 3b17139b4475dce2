"""The tier table: each notebook's sizes per tier (its parameters cell reads its row as ``env.sizes``); GPU constants."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 2**30
GPU_TIERS = ("t4", "a100")
# The GPUs `cbkit tiers` checks: tier and rollout dtype, total memory as CUDA reports it, compute capability.
MACHINES: dict[str, tuple[str, str]] = {"t4": ("t4", "float16"), "a100-40": ("a100", "bfloat16"),
                                        "a100-80": ("a100", "bfloat16")}
DEVICE_BYTES = {"t4": int(14.74 * GiB), "a100-40": 40 * GiB, "a100-80": 80 * GiB}
CAPABILITY = {"t4": (7, 5), "a100-40": (8, 0), "a100-80": (8, 0)}
TIER_MEMORY = {"t4": DEVICE_BYTES["t4"], "a100": DEVICE_BYTES["a100-40"]}  # each tier's smallest GPU: its pool's basis
COLAB_RAM_BYTES = int(12.7e9)  # a standard Colab runtime's RAM: the weight copies kept on the host must fit it
CUDA_CONTEXT_BYTES = GiB // 2  # held before the first tensor: an assumption until scripts/gpu_check.sh reads it
LESSON_PAGE_SIZE = 32  # the lessons' KV pages: a GSM8K chat prompt fills four, which its group's completions share
POOL_SHARE = 0.4  # TRL's example: max_memory_percent=0.4 with the trainer resident
# Notebook 01's pool (PAGE_SIZE, POOL_ROWS, TOKEN_BUDGET): a quarter of its rows at full length, so that requests wait.
NB01_POOL = (16, 0.25, 64)
PROMPT_LEN = 132  # a GSM8K chat prompt with cbkit's system prompt, in SmolLM2's tokens
DRY_MODEL = "llama-tiny-random"
GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
LOGITS_BUDGET_BYTES = {"ci": 2 * GiB, "cpu": 2 * GiB, "t4": GiB, "a100": 8 * GiB}  # the loss's logits a micro-batch


@dataclass(frozen=True)
class Sizes:  # one notebook's sizes at one tier; a notebook reads the fields it uses
    model: str
    prompts: int  # prompts per rollout (per step where the notebook trains)
    n: int  # completions per prompt
    max_new_tokens: int
    steps: int = 1  # training steps per run
    sweep_ns: tuple[int, ...] = ()  # 03: the N it sweeps, `prompts` each
    repeats: int = 1
    workloads: tuple[str, ...] = ("fixed", "replay:gsm8k")
    # The CB pool (`plan.pool_config`): on a GPU tier a share of what training leaves free; on a CPU sequences.
    pool_share: float | None = None
    pool_sequences: int | None = None
    learning_rate: float = 5e-6
    eval_every: int = 0
    eval_prompts: int = 0
    eval_n: int = 0  # held-out evaluation: every `eval_every` steps, `eval_prompts` x `eval_n` completions
    dry_steps: int = 1  # steps at dry-run size (05 needs 5 to reach staleness 4)

    def dry(self) -> Sizes:
        """The same code path at CI size on a CPU: a 2-layer random model, two prompts, a few tokens."""
        ns = tuple(sorted({min(n, 2 * (i + 1)) for i, n in enumerate(self.sweep_ns)}))
        return dataclasses.replace(self, model=DRY_MODEL, prompts=min(self.prompts, 2), n=min(self.n, 4),
                                   max_new_tokens=min(self.max_new_tokens, 12), steps=self.dry_steps, sweep_ns=ns,
                                   repeats=1, eval_every=min(self.eval_every, self.dry_steps),
                                   eval_prompts=min(self.eval_prompts, 4))


@dataclass(frozen=True)
class NotebookSpec:  # a notebook's sizes and what it holds, as `plan.plan_notebook` adds it up
    name: str
    kind: str  # "train", "rollout" (01), "logprobs" (02) or "sweep" (03)
    sizes: dict[str, Sizes]
    train_runs: tuple[str, ...] = ("continuous",)  # one training run per entry, on that backend
    # fp32 weight copies at the fullest point (`place_for_tier`), an async run's snapshot, state dicts on the CPU.
    weight_copies: int = 0
    async_run: bool = False
    host_copies: int = 0


_SMOL = "smollm2-offline"
_1B = "llama-1b-random"
NOTEBOOKS: dict[str, NotebookSpec] = {spec.name: spec for spec in (
    NotebookSpec("00_quickstart", "train", {"ci": Sizes(_SMOL, 2, 8, 32), "cpu": Sizes(_SMOL, 2, 8, 96),
                                             "t4": Sizes(GPU_MODEL, 4, 8, 256, learning_rate=1e-6),
                                             "a100": Sizes(GPU_MODEL, 8, 16, 256, learning_rate=1e-6)}),
    NotebookSpec("01_kv_slot_recycling", "rollout", {"ci": Sizes(_SMOL, 2, 8, 40), "cpu": Sizes(_SMOL, 2, 16, 128),
                                                     "t4": Sizes(_SMOL, 4, 16, 512), "a100": Sizes(_1B, 4, 16, 512)}),
    NotebookSpec("02_logprob_correctness", "logprobs", {"ci": Sizes(_SMOL, 2, 4, 32), "cpu": Sizes(_SMOL, 3, 8, 96),
                                                        "t4": Sizes(GPU_MODEL, 4, 8, 256),
                                                        "a100": Sizes(GPU_MODEL, 8, 16, 256)}),
    # GRPO's shape at every tier: completions longer than the prompts, a pool smaller than the rollout, three N or more.
    NotebookSpec("03_n_sweep", "sweep", {
        "ci": Sizes(DRY_MODEL, 2, 8, 256, sweep_ns=(2, 4, 8), pool_sequences=6),
        "cpu": Sizes(_SMOL, 4, 8, 256, sweep_ns=(4, 8, 16), pool_sequences=32),
        "t4": Sizes(_SMOL, 8, 8, 1024, sweep_ns=(8, 16, 32), pool_share=POOL_SHARE),
        "a100": Sizes(_1B, 6, 8, 2048, sweep_ns=(8, 16, 32), workloads=("replay:gsm8k",), pool_share=POOL_SHARE)}),
    # CI: a dozen steps of the 2-layer model at a rate only a model this small takes, so the chart shows a trend.
    NotebookSpec("04_grpo_live", "train", train_runs=("continuous", "generate"), weight_copies=1, sizes={
        "ci": Sizes(DRY_MODEL, 2, 8, 24, steps=12, learning_rate=1e-2, eval_prompts=8, eval_n=2),
        "cpu": Sizes(_SMOL, 2, 4, 32, steps=3, learning_rate=5e-5, eval_every=3, eval_prompts=8, eval_n=2),
        "t4": Sizes(GPU_MODEL, 4, 8, 256, steps=6, learning_rate=3e-6, eval_every=6, eval_prompts=64, eval_n=2),
        "a100": Sizes(GPU_MODEL, 8, 16, 256, steps=8, learning_rate=3e-6, eval_every=8, eval_prompts=64, eval_n=2)}),
    # Runs: one per staleness (3), the uncorrected one, one async. Copies: the first weights, k=4's ring, the last ones.
    NotebookSpec("05_off_policy", "train", train_runs=("continuous",) * 5, weight_copies=1 + 5 + 1, async_run=True,
                 host_copies=3, sizes={
        "ci": Sizes(DRY_MODEL, 2, 4, 16, steps=10, learning_rate=1e-4),
        "cpu": Sizes(_SMOL, 2, 4, 16, steps=5, learning_rate=5e-5),
        "t4": Sizes(GPU_MODEL, 2, 8, 128, steps=6, learning_rate=3e-6, dry_steps=5),
        "a100": Sizes(GPU_MODEL, 8, 8, 128, steps=6, learning_rate=3e-6, dry_steps=5)}),
)}


def notebook_spec(name: str) -> NotebookSpec:
    if name not in NOTEBOOKS:
        raise ValueError(f"no notebook {name!r}; the notebooks are {', '.join(NOTEBOOKS)}.")
    return NOTEBOOKS[name]
