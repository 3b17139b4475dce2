"""What the six notebooks share: ``env = setup("NN_name")`` decides profile, device, tier, dtypes, model, data
and sizes the same way in each, so one notebook serves Colab, a laptop and CI. ``CBKIT_TIER=t4|a100`` forces a
GPU tier: on a GPU to rehearse a smaller one; under the ci profile on a CPU, a dry run of it at CI sizes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.measure.planner import plan, training_bytes
from cbkit.models.load import native_bf16
from cbkit.tasks.data import gsm8k_local_candidates
from cbkit.teach.tiers import table
from cbkit.teach.tiers.plan import plan_notebook, pool_config
from cbkit.teach.tiers.table import GPU_MODEL, GPU_TIERS, GiB, Sizes
from cbkit.train.batch import micro_batches_for
from cbkit.train.config import CBGRPOConfig
from cbkit.train.order import seed_everything
from cbkit.train.snapshots import place_for_tier
from cbkit.viz.live import embed_plotlyjs, text_progress_bars

PROFILE_ENV = "CBKIT_PROFILE"
PROFILES = ("ci", "full")
TIER_ENV = "CBKIT_TIER"
CPU_MODEL = "smollm2-offline"
NO_GPU_HELP = ("On Colab: Runtime > Change runtime type > T4 GPU (or A100), then Runtime > Run all. "
               "Elsewhere: a machine with a CUDA GPU and a CUDA build of torch.")
A100_MIN_MEMORY = 35 * GiB  # the a100 tier: native bf16 and at least this much memory; other GPUs are t4
# Completions per training forward on a CPU: one row's fp32 activations keep an async step in a laptop's RAM.
CPU_FORWARD_CHUNK_ROWS = 1
PHENOMENA_MIME = "application/vnd.cbkit.phenomena+json"
# One worked example of the answer line, so that a CI-sized budget reaches "#### <number>" and rewards are not all 0.
SHORT_ANSWER_PROMPT = (
    "Answer with one short line of working, then the final line '#### <number>'.\n"
    "Example:\nQ: Sam has 3 bags of 4 apples. How many apples?\nA: 3 * 4 = 12\n#### 12"
)


@dataclass(frozen=True)
class NotebookEnv:  # the machine-dependent choices of one notebook run; `summary()` says what was chosen
    profile: str  # "ci" or "full"
    device: str  # "cuda" or "cpu"
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    colab: bool
    rollout_dtype: str
    train_dtype: str
    model: str
    data: str
    tier: str = "cpu"  # "ci", "cpu", "t4" or "a100"
    gpu_memory_bytes: int | None = None
    autocast_dtype: str | None = None  # the training forwards' autocast over fp32 weights (native bf16)
    notebook: str | None = None  # the notebook whose sizes `sizes` holds (cbkit.teach.tiers)
    sizes: Sizes | None = None
    dry_run: bool = False  # a GPU tier's code path on a CPU at CI sizes (CBKIT_TIER under the ci profile)
    trains: bool = False  # the notebook trains: it rolls out from the fp32 training weights

    @property
    def compute_dtype(self) -> str:  # the loop's `dtype`: not 'auto', since a forced t4 tier is fp32
        return self.autocast_dtype or self.train_dtype

    @property
    def on_cpu(self) -> bool:  # a CPU run, not a GPU tier's dry run: it trains in chunks of CPU_FORWARD_CHUNK_ROWS
        return self.device == "cpu" and not self.dry_run

    @property
    def forward_chunk_rows(self) -> int | None:
        return CPU_FORWARD_CHUNK_ROWS if self.on_cpu else CBGRPOConfig.forward_chunk_rows

    @property
    def weights_place(self) -> str:  # where a copy of the weights a notebook comes back to lives: disk, host, device
        return place_for_tier(self.tier, self.device)

    def trl_micro_batches(self, rows: int, gradient_accumulation_steps: int) -> int:
        return rows // CPU_FORWARD_CHUNK_ROWS if self.on_cpu else gradient_accumulation_steps

    def micro_batches(self, rows: int, completion_len: int, vocab_size: int) -> int:  # logits within the tier's budget
        return micro_batches_for(rows, completion_len, vocab_size, table.LOGITS_BUDGET_BYTES[self.tier])

    def pick(self, *, ci: Any, cpu: Any, gpu: Any) -> Any:  # gpu on a GPU tier (or its dry run), else by profile
        return gpu if self.tier in GPU_TIERS else ci if self.profile == "ci" else cpu

    def free_memory_bytes(self) -> int | None:  # on a dry run the tier's GPU: a CPU's RAM says nothing of a T4
        return torch.cuda.mem_get_info()[0] if self.device == "cuda" else self.gpu_memory_bytes if self.dry_run else None

    def pool_config(self, model: Any, rows: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None,
                    *, requests: int | None = None, **pool: Any) -> dict[str, Any]:
        """This notebook's CB pool at this tier (`tiers.plan.pool_config`) for ``rows`` (or ``requests`` prompts of the
        mean length); ``pool`` overrides the sizes' pool_share or pool_sequences."""
        if self.sizes is None:
            return {}
        if requests and not rows:
            rows = [range(table.PROMPT_LEN)] * requests
        return pool_config(model.config, dataclasses.replace(self.sizes, **pool), self.tier, rows=rows,
                           dtype_bytes=next(model.parameters()).element_size(),
                           max_new_tokens=max_new_tokens, dry_run=self.dry_run)

    def check_fits(self, model: Any, config: Any, prompt_ids: Sequence[Sequence[int]]) -> str:
        """The planned rollout peak beside what training ``config`` holds, as a line; on a GPU tier, refuses a misfit."""
        n, new, chunk = config.num_generations, config.max_completion_length, config.forward_chunk_rows
        micro_rows = len(prompt_ids) * n // config.gradient_accumulation_steps
        train = training_bytes(sum(p.numel() for p in model.parameters()), micro_batch_rows=micro_rows,
                               tokens_per_row=max(map(len, prompt_ids)) + new, completion_len=new,
                               chunk_rows=chunk, config=model.config, autocast=bool(self.autocast_dtype))
        free = self.free_memory_bytes()
        rollout = plan(model.config, num_prompts=len(prompt_ids), num_generations=n, max_new_tokens=new,
                       prompt_len=[len(p) for p in prompt_ids], budget_bytes=free,
                       dtype_bytes=next(model.parameters()).element_size(), device="cpu" if self.on_cpu else "cuda",
                       cb_config=config.transformers_continuous_batching_config).continuous
        gib = {k: f"{v / GiB:.2f}" for k, v in train.items()}
        rows, budget = min(chunk or micro_rows, micro_rows), table.LOGITS_BUDGET_BYTES[self.tier]
        line = (f"planned: rollout peak {rollout.peak_bytes / GiB:.2f} GiB (continuous), training {gib['total']} GiB "
                f"(weights, gradients, AdamW: {gib['optimizer_state']}; logits of one forward of {rows} rows: "
                f"{gib['logits']}, budget {budget / GiB:.0f}; its activations: {gib['activations']})")
        if not self.on_cpu:
            total = self.gpu_memory_bytes or torch.cuda.get_device_properties(0).total_memory
            if free is not None and rollout.fits is False:  # (fits is None without a budget)
                raise MemoryError(f"{line}: the rollout does not fit the {free / GiB:.1f} GiB free on this "
                                  "GPU. Lower N, the prompts per step or max_completion_length.")
            if train["total"] + rollout.peak_bytes > total:
                raise MemoryError(f"{line}: training next to the rollout needs more than this GPU's {total / GiB:.1f} "
                                  "GiB. Lower N or the prompts per step, or raise gradient_accumulation_steps.")
        return line

    @property
    def precision(self) -> str:  # what the rollout samples in, what the logprobs are computed in, the drift
        def eps(dtype: str) -> str:
            return f"{torch.finfo(getattr(torch, dtype)).eps:.1e} relative resolution"

        if self.trains:
            low = self.compute_dtype
            logprobs = f"under {low} autocast over those weights" if self.autocast_dtype else f"in {low}"
            return (f"rollout samples from the {self.train_dtype} training weights; old and policy logprobs "
                    f"{logprobs}; drift to expect: {low}'s {eps(low)} per logit (logprob/*, is/* every step)")
        if self.notebook is not None and table.notebook_spec(self.notebook).kind == "logprobs":
            return (f"the policy keeps {self.train_dtype} weights and scores every rollout teacher-forced in "
                    f"{self.train_dtype}; sections 1 and 4 sample from those weights, section 2 from a "
                    f"bfloat16 copy ({eps('bfloat16')}, fp32's {eps('float32')})")
        return f"rollouts sample from {self.rollout_dtype} weights ({eps(self.rollout_dtype)}); no training"

    def summary(self) -> str:
        if self.dry_run:
            hw = f"CPU, dry run of tier {self.tier!r} at CI sizes (the tier's branches, not its speed)"
        elif self.device == "cuda":
            major, minor = self.compute_capability or (0, 0)
            bf16 = "bf16" if major >= 8 else f"no native bf16 (compute capability {major}.{minor} < 8.0)"
            hw = f"GPU {self.gpu_name}, {(self.gpu_memory_bytes or 0) / GiB:.0f} GiB, {bf16}, tier {self.tier!r}"
        else:
            hw = f"CPU ({os.cpu_count()} cores), no GPU"
        colab = "Colab, " if self.colab else ""
        return (f"profile {self.profile!r} | {colab}{hw} | model {self.model} | data {self.data}\n"
                f"precision: {self.precision}")


def setup(notebook: str | None = None, profile: str | None = None, *, verbose: bool = True) -> NotebookEnv:
    """Decide profile, device, tier, dtypes, model, data and (with ``notebook``) its sizes; seed every RNG with 0;
    print it. On a GPU tier, refuses before any model time a plan that does not fit."""
    profile = resolve_profile(profile)
    forced = os.environ.get(TIER_ENV) or None
    if forced is not None and forced not in GPU_TIERS:
        raise ValueError(f"{TIER_ENV}={forced!r} is not a GPU tier; use one of {GPU_TIERS} (t4: 15 GiB, "
                         "fp16; a100: 40 or 80 GiB, bf16), or unset it to follow the GPU found.")
    colab, gpu = "google.colab" in sys.modules, torch.cuda.is_available()
    cc: tuple[int, int] | None = None
    if gpu:
        cc, memory = torch.cuda.get_device_capability(0), torch.cuda.get_device_properties(0).total_memory
        big = cc >= (8, 0) and memory >= A100_MIN_MEMORY
        tier = forced or ("ci" if profile == "ci" else "a100" if big else "t4")
        bf16 = native_bf16(0) and forced != "t4"  # a forced t4 tier rehearses a T4: no bf16
    elif forced:
        if profile != "ci":
            raise RuntimeError(f"{TIER_ENV}={forced} asks for a GPU tier, but torch sees no CUDA device "
                               f"here. {NO_GPU_HELP} Or add {PROFILE_ENV}=ci for a dry run of its code here.")
        memory, tier, bf16 = table.TIER_MEMORY[forced], forced, forced == "a100"
    else:
        if colab and profile != "ci":
            print(f"This Colab runtime has no GPU, so the notebook runs at CPU sizes (slow). {NO_GPU_HELP}")
        memory, tier, bf16 = None, "ci" if profile == "ci" else "cpu", False
    hub = gpu and tier != "ci"  # a GPU tier: the hub model on GSM8K; elsewhere the offline model and data
    local = any(p.is_file() for p in gsm8k_local_candidates("train"))
    dry_run = not gpu and forced is not None
    sizes = table.notebook_spec(notebook).sizes[tier] if notebook is not None else None
    sizes = sizes.dry() if sizes and dry_run else sizes
    env = NotebookEnv(
        profile=profile, device="cuda" if gpu else "cpu", compute_capability=cc, colab=colab,
        gpu_name=torch.cuda.get_device_name(0) if gpu else None, train_dtype="float32",
        rollout_dtype="bfloat16" if bf16 else "float16" if gpu or forced else "float32",
        model=sizes.model if sizes else GPU_MODEL if hub else CPU_MODEL, tier=tier, gpu_memory_bytes=memory,
        data="gsm8k:train" if hub else "gsm8k-local:train" if local else "synthetic",
        autocast_dtype="bfloat16" if bf16 else None, dry_run=dry_run, notebook=notebook, sizes=sizes,
        trains=notebook is not None and table.notebook_spec(notebook).kind == "train")
    seed_everything(0)
    embed_plotlyjs()  # once per notebook, so every figure draws wherever the executed notebook is opened
    text_progress_bars()  # under CI: bars saved at their last frame, not as a widget's "0%"
    if verbose:
        print(env.summary())
    if notebook is not None and tier in GPU_TIERS:
        machine = "t4" if tier == "t4" else "a100-80" if (memory or 0) > 60 * GiB else "a100-40"
        p = plan_notebook(notebook, machine)
        if p.problems():
            raise MemoryError(f"{notebook} at tier {tier!r}: " + "; ".join(p.problems()) +
                              f". The sizes are in cbkit.teach.tiers.table.NOTEBOOKS[{notebook!r}].")
        if verbose:
            dry = " (at the tier's sizes; this dry run's are smaller)" if dry_run else ""
            print(f"plan for {machine} (`cbkit tiers`): peak {p.peak_bytes / GiB:.1f} of "
                  f"{p.memory_bytes / GiB:.0f} GiB{dry}")
    return env


def resolve_profile(profile: str | None = None) -> str:
    """An explicit argument, else $CBKIT_PROFILE, else "ci" under pytest (nbmake), else "full"."""
    if profile is None:
        profile = os.environ.get(PROFILE_ENV) or ("ci" if "PYTEST_CURRENT_TEST" in os.environ else "full")
    if profile not in PROFILES:
        raise ValueError(f"{PROFILE_ENV}={profile!r} is not a profile; use one of {PROFILES} "
                         f"(ci: small and offline, as CI runs the notebooks; full: sized for this machine).")
    return profile


def record_phenomena(**values: float | int | bool | str) -> None:
    """Display the measured numbers a notebook's text relies on as one output: JSON the guards read
    (``PHENOMENA_MIME``) and a line a reader sees. Numbers only, never thresholds: those are the guards'."""
    from IPython.display import display

    clean = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
    for key, value in clean.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"record_phenomena: {key} is {value}; a phenomenon needs a measured number.")
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in clean.items())
    display({PHENOMENA_MIME: json.loads(json.dumps(clean)), "text/plain": f"recorded for the checks: {text}"},
            raw=True)
