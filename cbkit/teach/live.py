"""Live charts of the notebooks' runs on `cbkit.viz.live.LiveChart`: the loop's metrics as steps finish
(`LiveMetricsHook`, 04) and the sweep's points as runs finish (`live_sweep`, 03)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cbkit.train.hooks import StepHooks, StepRecord, TrainState
from cbkit.viz.figures import backend_color
from cbkit.viz.live import LiveChart

# (panel, [(series label, metric key, scale)]): six panels in two columns; labels are unique (a style is by label).
TRAINING_PANELS: tuple[tuple[str, tuple[tuple[str, str, float], ...]], ...] = (
    ("reward", (("train reward", "reward/mean", 1.0), ("held-out accuracy", "eval/accuracy", 1.0))),
    ("completion length (tokens)", (("mean length", "completion/mean_length", 1.0),)),
    ("rollout tokens/s", (("tokens/s", "rollout/tokens_per_s", 1.0),)),
    ("rollout peak memory (MiB)", (("peak memory", "rollout/peak_mem_bytes", 2.0**-20),)),
    ("logprob drift (nats)", (("max |diff|", "logprob/max_abs_diff", 1.0),
                              ("mean |diff|", "logprob/mean_abs_diff", 1.0))),
    ("IS ratio", (("ratio mean", "is/ratio_mean", 1.0), ("ratio min", "is/ratio_min", 1.0),
                  ("ratio max", "is/ratio_max", 1.0))),
)
# A series' (place in its panel, series in that panel), by label.
_PLACE = {label: (i, len(series)) for _, series in TRAINING_PANELS for i, (label, _, _) in enumerate(series)}


def run_style(series: str) -> dict[str, Any]:
    """A "run: quantity" series: the run's colour and legend group; a panel's later quantities a lighter tint, a dash
    and a marker (a dash alone is invisible on two points)."""
    run, _, name = series.rpartition(": ")
    place, count = _PLACE.get(name, (0, 1))
    color = backend_color(run or name)
    share = (0.0, 0.45, 0.65)[place]  # how far the colour moves to white
    rgb = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    style = {"color": "#" + "".join(f"{round(c + (255 - c) * share):02x}" for c in rgb), "group": run or name,
             "dash": ("solid", "dash", "dot")[place], "symbol": ("circle", "diamond", "square")[place]}
    return {**style, "label": name} if count > 1 else style


class LiveMetricsHook(StepHooks):
    """A live chart of the loop's metrics, one panel per quantity; ``label`` prefixes every series, so two runs drawn
    into one chart (``chart=``) stay apart. ``records`` keeps every training step's record."""

    def __init__(self, label: str = "", *, chart: Any = None, title: str = "GRPO, live",
                 close_on_end: bool = True, **chart_kwargs: Any) -> None:
        self.label = label
        # The IS ratio's axis spans at least 1 +- 0.05, so that bf16-sized mismatches show.
        options = {"y_min_span": {"IS ratio": 0.1}, "columns": 2, "panel_height": 200, **chart_kwargs}
        panels = [p for p, _ in TRAINING_PANELS]
        self.chart = chart or LiveChart(title, panels, x_title="step", style=run_style, **options)
        self.close_on_end = close_on_end
        self.records: list[StepRecord] = []

    def on_step_end(self, record: StepRecord) -> None:
        if record.step > 0:  # step 0 is the held-out evaluation before training: drawn, not a training step
            self.records.append(record)
        for panel, series in TRAINING_PANELS:
            for name, key, scale in series:
                value = record.metrics.get(key)
                if isinstance(value, int | float) and value == value:  # NaN (no logprobs) is not a point
                    series_name = f"{self.label}: {name}" if self.label else name
                    self.chart.add(series_name, record.step, value * scale, panel=panel)

    def on_train_end(self, state: TrainState) -> None:
        if self.close_on_end:
            self.chart.close()
        else:
            self.chart.flush()


def live_sweep(cfg: Any, out: str | os.PathLike[str], *, policy: Any = None,
               on_point: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """`run_sweep` with a live chart of tokens/s and peak memory against N, a point per run (those in ``out`` first)."""
    from cbkit.measure.results import load_runs
    from cbkit.measure.sweep import run_sweep

    title = f"N-sweep, live, workload {cfg.lengths}: each point is one run"
    chart = LiveChart(title, ["tokens/s", "peak memory (MiB)"], x_title="N (completions per prompt)",
                      x_log=True,
                      style=lambda backend: {"color": backend_color(backend)})

    def add(run: dict[str, Any]) -> None:
        if run.get("status", "ok") != "ok":
            return
        chart.add(run["backend"], run["N"], run["tokens_per_s"], panel="tokens/s")
        if run.get("peak_mem_bytes") is not None:
            chart.add(run["backend"], run["N"], run["peak_mem_bytes"] / 2**20, panel="peak memory (MiB)")
        if on_point is not None:
            on_point(run)

    if Path(out).exists():
        for run in load_runs(Path(out)):
            add(run)
    try:
        return run_sweep(cfg, Path(out), on_point=add, policy=policy)
    finally:
        chart.close()
