"""Live charts fed by the notebooks' runs: the loop's metrics as steps finish (`LiveMetricsHook`, notebook 04)
and the sweep's points as runs finish (`live_sweep`, notebook 03), both on `cbkit.viz.live.LiveChart`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cbkit.train.hooks import StepHooks, StepRecord, TrainState
from cbkit.viz.figures import backend_color
from cbkit.viz.live import LiveChart

__all__ = ["LiveMetricsHook", "TRAINING_PANELS", "live_sweep", "run_style", "tint"]

# (panel title, [(series label, metric key, scale)]): what the live training chart draws, six panels in a grid of
# two columns, so that the chart reads without scrolling. Train reward and held-out accuracy share a panel (both
# are scores in [0, 1]: the second is the evidence that the run learns); reward's parts are in each record's metrics.
# Labels are unique across panels: a series' style is found by its label.
TRAINING_PANELS: tuple[tuple[str, tuple[tuple[str, str, float], ...]], ...] = (
    ("reward", (("train reward", "reward/mean", 1.0), ("held-out accuracy", "eval/accuracy", 1.0))),
    ("completion length (tokens)", (("mean length", "completion/mean_length", 1.0),)),
    ("rollout tokens/s", (("tokens/s", "rollout/tokens_per_s", 1.0),)),
    ("rollout peak memory (MiB)", (("peak memory", "rollout/peak_mem_bytes", 2.0**-20),)),
    ("logprob drift (nats)", (("max |diff|", "logprob/max_abs_diff", 1.0), ("mean |diff|", "logprob/mean_abs_diff", 1.0))),
    ("IS ratio", (("ratio mean", "is/ratio_mean", 1.0), ("ratio min", "is/ratio_min", 1.0),
                  ("ratio max", "is/ratio_max", 1.0))),
)
TRAINING_COLUMNS = 2
# A quantity's place within its panel: its dash, its marker and how far its run's colour is lightened, so that two
# series of one run differ in colour too, not by dash alone (a dash cannot be seen on a chart of two points).
_DASHES = ("solid", "dash", "dot")
_SYMBOLS = ("circle", "diamond", "square")
_TINTS = (0.0, 0.45, 0.65)


def tint(color: str, share: float) -> str:
    """``color`` (``#rrggbb``) moved ``share`` of the way to white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * share):02x}" for c in rgb)


def run_style(series: str) -> dict[str, Any]:
    """Style of a "run: quantity" series: the run's colour (a backend's own), its legend group (one legend entry a
    run), and, for a panel's second and third quantities, a lighter tint, a dash and a marker of their own, with the
    quantity written beside the last point wherever a panel draws more than one."""
    run, _, name = series.rpartition(": ")
    color = backend_color(run or name)  # generate / continuous keep their colours from every other cbkit chart
    panel = next((qs for _, qs in TRAINING_PANELS if any(label == name for label, _, _ in qs)), ())
    position = next((i for i, (label, _, _) in enumerate(panel) if label == name), 0)
    style = {"color": tint(color, _TINTS[position % 3]), "dash": _DASHES[position % 3],
             "symbol": _SYMBOLS[position % 3], "group": run or name}
    if len(panel) > 1:
        style["label"] = name
    return style


class LiveMetricsHook(StepHooks):
    """A live chart of the loop's metrics, one panel per quantity, redrawn as steps finish (throttled).

    ``label`` prefixes every series, so two runs drawn into one chart (``chart=`` the same LiveChart) stay
    apart, e.g. "continuous" and "generate". The chart is closed when training ends, which keeps its final
    figure in an executed notebook; ``records`` holds every step's metrics for a later comparison.
    """

    def __init__(self, label: str = "", *, chart: Any = None, title: str = "GRPO, live",
                 panels: Sequence[tuple[str, Sequence[tuple[str, str, float]]]] = TRAINING_PANELS,
                 close_on_end: bool = True, **chart_kwargs: Any) -> None:
        self.label = label
        self.panels = tuple(panels)
        chart_kwargs.setdefault("y_min_span", {"IS ratio": 0.1})  # 1 +- 0.05: bf16-sized mismatches show
        chart_kwargs.setdefault("columns", TRAINING_COLUMNS)
        chart_kwargs.setdefault("panel_height", 200)
        self.chart = chart or LiveChart(title, [p for p, _ in self.panels], x_title="step", style=run_style,
                                        **chart_kwargs)
        self.close_on_end = close_on_end
        self.records: list[StepRecord] = []  # every training step's record (not the step-0 evaluation)

    def on_step_end(self, record: StepRecord) -> None:
        if record.step > 0:  # step 0 is the held-out evaluation before training: drawn, not a training step
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


def live_sweep(cfg: Any, out: str | os.PathLike[str], *, policy: Any = None, mode: str = "auto",
               on_point: Callable[[dict[str, Any]], None] | None = None,
               title: str | None = None) -> list[dict[str, Any]]:
    """`cbkit.measure.sweep.run_sweep` with a live chart: every finished run becomes a point (tokens/s and peak memory
    against N, one series per backend) the moment it lands. Returns the aggregated points. Runs already in
    ``out`` are drawn first, so a resumed sweep shows everything it has."""
    from cbkit.measure.results import load_runs
    from cbkit.measure.sweep import run_sweep

    workload = getattr(cfg, "lengths", None)
    title = title or ("N-sweep, live" + (f", workload {workload}" if workload else "") + ": each point is one run")
    chart = LiveChart(title, ["tokens/s", "peak memory (MiB)"],
                      x_title="N (completions per prompt)", mode=mode, x_log=True,  # type: ignore[arg-type]
                      style=lambda backend: {"color": backend_color(backend)})

    def add(run: dict[str, Any]) -> None:
        if run.get("status", "ok") != "ok":
            return
        chart.add(run["backend"], run["N"], run["tokens_per_s"], panel="tokens/s")
        if run.get("peak_mem_bytes") is not None:
            chart.add(run["backend"], run["N"], run["peak_mem_bytes"] / 2**20, panel="peak memory (MiB)")
        if on_point is not None:
            on_point(run)

    path = Path(out)
    if path.exists():
        for run in load_runs(path):
            add(run)
    try:
        points = run_sweep(cfg, path, on_point=add, policy=policy)
    finally:
        chart.close()
    return points
