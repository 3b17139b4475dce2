"""Where the live chart draws, its throttle and batching, and the static figures built from sample data."""

from __future__ import annotations

import io
import sys
import types

import plotly.graph_objects as go
import pytest

from cbkit.teach import figures
from cbkit.viz import figures as plots
from cbkit.viz import live as display
from cbkit.viz.live import LiveChart

GiB = 1024**3


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeHandle:
    def __init__(self, shown: list) -> None:
        self.shown = shown

    def update(self, obj, raw=False) -> None:
        self.shown.append(obj)


class FakeDisplay:
    """Stands in for IPython's display(obj, display_id=True): records what was shown and updated."""

    def __init__(self) -> None:
        self.shown: list = []

    def __call__(self, obj):
        self.shown.append(obj)
        return FakeHandle(self.shown)


@pytest.fixture
def no_kernel(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(display, "in_kernel", lambda: False)


def _kernel(monkeypatch, *, colab: bool = False, ci: bool = False) -> None:
    monkeypatch.setattr(display, "in_kernel", lambda: True)
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    for var in ("CBKIT_PROFILE", "CI", "PYTEST_CURRENT_TEST"):
        monkeypatch.delenv(var, raising=False)
    if ci:
        monkeypatch.setenv("CI", "true")


# --- where the chart draws ------------------------------------------------------------------------------------


def test_in_kernel_needs_an_ipython_shell_with_a_kernel(monkeypatch):
    shell = types.SimpleNamespace(kernel=object())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert display.in_kernel()
    terminal = types.SimpleNamespace()  # terminal IPython: a shell, no kernel
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: terminal))
    assert not display.in_kernel()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))
    assert not display.in_kernel()
    monkeypatch.delitem(sys.modules, "IPython")  # a script that never imported IPython
    assert not display.in_kernel()


@pytest.mark.parametrize("colab", [False, True])
def test_a_kernel_updates_a_display_handle_and_leaves_a_figure(monkeypatch, colab):
    _kernel(monkeypatch, colab=colab)
    display, clock = FakeDisplay(), FakeClock()
    chart = LiveChart("h", x_title="N", clock=clock, display=display)
    assert chart.live
    for i in range(5):
        clock.t = 2.0 * i
        chart.add("generate", i, float(i))
    assert len(display.shown) == 5  # one display, then four handle updates
    html = display.shown[-1]["text/html"]
    assert "Plotly.newPlot" in html and "generate" in html
    fig = chart.close()
    # The executed notebook keeps the final figure itself, in place of the last HTML snapshot: a bundle the
    # handle can update (a plotly figure would display itself beside it and leave the snapshot).
    bundle = display.shown[-1]
    assert bundle["application/vnd.plotly.v1+json"]["data"][0]["y"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert "Plotly.newPlot" in bundle["text/html"] and "text/plain" in bundle
    assert list(fig.data[0].y) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_without_a_kernel_nothing_is_shown_until_close(no_kernel):
    display = FakeDisplay()
    chart = LiveChart("s", display=display, clock=FakeClock())
    assert not chart.live
    for i in range(20):
        chart.add("a", i, i * i)
    assert display.shown == []
    fig = chart.close()
    assert display.shown == []  # no kernel: close only returns the figure
    assert list(fig.data[0].x) == list(range(20))
    with pytest.raises(RuntimeError, match="closed"):
        chart.add("a", 21, 0)


# --- throttle and batching ----------------------------------------------------------------------------------


def test_throttle_at_most_one_update_per_interval(monkeypatch):
    _kernel(monkeypatch, colab=True)
    display, clock = FakeDisplay(), FakeClock()
    chart = LiveChart("t", min_interval_s=1.0, clock=clock, display=display)
    for i in range(100):  # 100 points within one second
        clock.t = i * 0.0099
        chart.add("a", i, i)
    assert len(display.shown) <= 2
    before = len(display.shown)
    chart.flush()
    assert len(display.shown) == before + 1  # flush forces one
    chart.flush()
    assert len(display.shown) == before + 1  # nothing new: nothing sent


def test_batched_points_all_arrive(monkeypatch):
    _kernel(monkeypatch, colab=True)
    display, clock = FakeDisplay(), FakeClock()
    chart = LiveChart("b", panels=("x", "y"), clock=clock, display=display)
    chart.add("a", 0, 0, panel="x")  # first point draws at once
    for i in range(1, 50):
        chart.add("a", i, i, panel="x")
        chart.add("b", i, -i, panel="y")
    assert len(display.shown) == 1
    fig = chart.close()
    assert [len(t.x) for t in fig.data] == [50, 49]
    assert fig.layout.yaxis.title.text == "x" and fig.layout.yaxis2.title.text == "y"
    assert fig.layout.xaxis2.title.text == "step"


def test_live_chart_rejects_an_unknown_panel():
    chart = LiveChart("p", panels=("a",))
    with pytest.raises(ValueError, match="Unknown panel 'b'"):
        chart.add("s", 1, 1, panel="b")


# --- sweep figures ------------------------------------------------------------------------------------------


def _point(backend, n, status="ok", **kw):
    base = dict(backend=backend, N=n, status=status, tokens_per_s=None, rollout_s=None, peak_mem_bytes=None,
                peak_mem_kind="cuda_allocated", kv_bytes=None, kv_padding_share=None, speed_vs_generate=None,
                mem_vs_generate=None, planned_peak_bytes=None)
    return {**base, **kw}


POINTS = [
    _point("generate", 8, tokens_per_s=1000.0, rollout_s=2.0, peak_mem_bytes=3 * GiB, kv_bytes=2 * GiB,
           kv_padding_share=0.3, planned_peak_bytes=3 * GiB),
    _point("continuous", 8, tokens_per_s=1000.0, rollout_s=2.0, peak_mem_bytes=20 * GiB, kv_bytes=19 * GiB,
           speed_vs_generate=1.0, mem_vs_generate=6.67, planned_peak_bytes=21 * GiB),
    _point("generate", 32, tokens_per_s=3000.0, rollout_s=3.0, peak_mem_bytes=12 * GiB, kv_bytes=10 * GiB,
           kv_padding_share=0.4, planned_peak_bytes=12 * GiB),
    _point("continuous", 32, tokens_per_s=3750.0, rollout_s=2.4, peak_mem_bytes=21 * GiB, kv_bytes=19 * GiB,
           speed_vs_generate=1.25, mem_vs_generate=1.75, planned_peak_bytes=21 * GiB),
    _point("generate", 64, status="oom", kv_bytes=20 * GiB, planned_peak_bytes=24 * GiB),
    _point("continuous", 64, tokens_per_s=5000.0, rollout_s=3.6, peak_mem_bytes=21 * GiB, kv_bytes=19 * GiB,
           planned_peak_bytes=21 * GiB),
]


def _trace(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return t


def test_throughput_vs_n_marks_oom_without_plotting_zero():
    fig = plots.throughput_vs_n(POINTS)
    assert [t.name for t in fig.data] == ["generate", "continuous"]
    gen = _trace(fig, "generate")
    assert list(gen.x) == [8, 32, 64] and list(gen.y) == [1000.0, 3000.0, None]
    assert 0 not in [y for t in fig.data for y in t.y]
    texts = [a.text for a in fig.layout.annotations]
    assert "generate: OOM" in texts and not any("x" in t for t in texts if "OOM" not in t)  # no label on a marker
    # The ratio sits under its N, in CB's colour; N=64 has no ratio (generate() ran out of memory).
    ticks = list(fig.layout.xaxis.ticktext)
    assert ticks[1] == f"32<br><span style='color:{plots.BACKEND_COLORS['continuous']}'>1.25x</span>"
    assert ticks[2] == "64"
    assert fig.layout.xaxis.title.text.startswith("N") and "tokens" in fig.layout.yaxis.title.text


def test_memory_vs_n_measured_analytic_and_planner():
    fig = plots.memory_vs_n(POINTS)
    assert len(fig.data) == 6  # per backend: measured, analytic KV, planner
    gen = _trace(fig, "generate: measured peak")
    assert list(gen.y) == [3.0, 12.0, None]  # GiB; the OOM point is a gap
    assert list(_trace(fig, "generate: KV (analytic)").y) == [2.0, 10.0, 20.0]  # what it would need
    assert _trace(fig, "generate: KV (analytic)").line.dash == "dash"
    assert _trace(fig, "continuous: planner").mode == "markers"
    assert "generate: OOM" in [a.text for a in fig.layout.annotations]
    assert "GiB" in fig.layout.yaxis.title.text and "CUDA allocated" in fig.layout.title.text


def test_memory_vs_n_without_planner_has_no_planner_traces():
    pts = [{**p, "planned_peak_bytes": None} for p in POINTS]
    assert len(plots.memory_vs_n(pts).data) == 4


def test_report_is_self_contained_and_names_everything(tmp_path):
    path = plots.write_report(POINTS, tmp_path / "sub" / "report.html", {"model": "tiny", "device": "cpu"})
    html = path.read_text()
    assert "<script src=" not in html  # no CDN: plotly's JS is inline
    assert "Plotly.newPlot" in html and len(html) > 1_000_000
    for word in ("generate", "continuous", "OOM", "1.25x", "tiny"):
        assert word in html
    rows = [[c.strip() for c in line.split("|")[1:3]] for line in html.splitlines() if line.startswith("|")]
    for n in (8, 32, 64):  # every point in the table `cbkit report` prints
        assert [str(n), "generate"] in rows and [str(n), "continuous"] in rows


# --- timeline and padding -----------------------------------------------------------------------------------


def test_padding_figure_from_a_real_generate_rollout(tiny):
    from cbkit.rollout.base import SamplingParams
    from cbkit.rollout.generate import GenerateBackend
    from cbkit.telemetry import kv_accounting

    tok = tiny.tokenizer
    prompts = [tok("What is 2+2?").input_ids, tok("Hi").input_ids]
    rollout = GenerateBackend(tiny.model).generate(
        prompts, 3, SamplingParams(max_new_tokens=12, eos_token_id=tok.eos_token_id, seed=0))
    fig = figures.padding_figure(rollout)
    (heat,) = fig.data
    z = [list(row) for row in heat.z]
    cfg = rollout.engine_config
    assert len(z) == 6 and all(len(row) == cfg["padded_prompt_len"] + cfg["steps"] for row in z)
    for row, c in zip(z, rollout.completions, strict=True):
        assert row.count(1) == len(c.prompt_ids) and row.count(2) == len(c.completion_ids)
        assert row[cfg["padded_prompt_len"] - 1] == 1  # every prompt ends where generation starts
    share = kv_accounting(rollout, tiny.model.config, 4)["kv_padding_share"]
    assert f"{share:.0%} of all KV slots are padding" in fig.layout.title.text


def test_padding_figure_refuses_a_cb_rollout():
    from cbkit.rollout.base import Completion, Rollout

    r = Rollout([Completion(0, (1,), (2,), (0.0,), "eos")], 1, "continuous", 0.1)
    with pytest.raises(ValueError, match="generate"):
        figures.padding_figure(r)


# --- plotly.js once per notebook --------------------------------------------------------------------------------


def test_embed_plotlyjs_puts_the_library_in_the_page_once_and_figures_use_it(monkeypatch):
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    shown: list[str] = []
    monkeypatch.setattr("IPython.display.display_html", lambda html, raw=False: shown.append(html))
    monkeypatch.setattr(display, "_PLOTLYJS_IN_PAGE", False)
    monkeypatch.setattr(pio.renderers, "default", pio.renderers.default)
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    _kernel(monkeypatch, colab=True)
    assert not display.embed_plotlyjs() and shown == []  # Colab: every output is its own iframe
    assert 'src="https://cdn.plot.ly' in display.figure_html(fig)
    _kernel(monkeypatch)
    assert display.embed_plotlyjs() and not display.embed_plotlyjs()  # once per kernel
    library = get_plotlyjs()
    assert len(shown) == 1 and library in shown[0]
    assert pio.renderers.default == "plotly_mimetype+cbkit_notebook"
    html = display.figure_html(fig)
    assert "Plotly.newPlot" in html and "cdn" not in html and len(html) < len(library) / 100
    # What a figure cell saves: the JSON mimetype and HTML that draws with the page's copy.
    bundle = pio.renderers._build_mime_bundle(fig.to_dict(), renderers_string=pio.renderers.default)
    assert "application/vnd.plotly.v1+json" in bundle and "<script src=" not in bundle["text/html"]


def test_progress_bars_are_text_under_ci_and_widgets_in_front_of_a_person(monkeypatch):
    import tqdm.asyncio
    import tqdm.auto
    import tqdm.autonotebook

    widget_bar = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", widget_bar)  # both restored after the test
    monkeypatch.setattr(tqdm.autonotebook, "tqdm", tqdm.autonotebook.tqdm)
    _kernel(monkeypatch)
    assert not display.text_progress_bars() and tqdm.auto.tqdm is widget_bar
    _kernel(monkeypatch, ci=True)
    assert display.text_progress_bars() and issubclass(tqdm.auto.tqdm, tqdm.asyncio.tqdm)
    out = io.StringIO()
    for _ in tqdm.auto.tqdm(range(3), desc="runs", file=out):
        pass
    assert out.getvalue().count("runs:") == 1 and " 100%|" in out.getvalue()  # one line: the last frame


def test_one_legend_entry_a_group_and_a_minimum_span_for_flat_panels(no_kernel):
    chart = LiveChart("t", ["reward", "IS ratio"], y_min_span={"IS ratio": 0.1},
                      style=lambda s: {"color": "#000000", "group": s.split(": ")[0]})
    for step, (reward, ratio) in enumerate([(0.1, 1.00001), (0.4, 0.99998), (0.3, 1.00002)], start=1):
        chart.add("cb: mean", step, reward, panel="reward")
        chart.add("cb: ratio mean", step, ratio, panel="IS ratio")
    fig = chart.figure()
    assert [(t.name, t.showlegend) for t in fig.data] == [("cb", True), ("cb", False)]
    # 1e-5 noise around 1 is drawn inside 1 +- 0.05, not stretched over the panel; reward keeps autorange.
    assert list(fig.layout.yaxis2.range) == pytest.approx([0.99998 + 0.00002 - 0.05, 1.00002 - 0.00002 + 0.05])
    assert fig.layout.yaxis.range is None
    chart.add("cb: ratio mean", 4, 1.3, panel="IS ratio")  # a real move: autorange again
    assert chart.figure().layout.yaxis2.range is None


def test_ticks_are_plain_numbers_not_si_prefixes(no_kernel):
    """A drift of 2e-6 nats: plotly's default tick labels would read "2µ" (an SI prefix), the chart's read 0.000002."""
    chart = LiveChart("t", ["logprob drift (nats)", "tokens/s"])
    for step, (drift, speed) in enumerate([(2e-6, 12000.0), (3e-6, 15000.0)], start=1):
        chart.add("max |diff|", step, drift, panel="logprob drift (nats)")
        chart.add("tokens/s", step, speed, panel="tokens/s")
    fig = chart.figure()
    assert fig.layout.yaxis.exponentformat == fig.layout.yaxis2.exponentformat == "none"


def test_live_sweep_titles_its_chart_by_workload(monkeypatch):
    import cbkit.teach.live as live

    titles = []

    class Chart:
        def __init__(self, title, *a, **k):
            titles.append(title)

        def add(self, *a, **k):
            pass

        def close(self):
            pass

    monkeypatch.setattr(live, "LiveChart", Chart)
    monkeypatch.setattr("cbkit.measure.sweep.run_sweep", lambda cfg, out, **k: [])

    class Cfg:
        lengths = "replay:gsm8k"

    live.live_sweep(Cfg(), "/nonexistent/x.jsonl")
    assert titles == ["N-sweep, live, workload replay:gsm8k: each point is one run"]


STEP_POINTS = [
    _point("generate", 8, step_s=30.0, rollout_s=10.0, old_logprob_s=4.0, update_s=15.0, other_s=1.0,
           rollout_share=1 / 3, roof_share=0.05,
           step_speedup=1.0, amdahl_ceiling=1.0),
    _point("continuous", 8, step_s=25.0, rollout_s=5.0, old_logprob_s=4.0, update_s=15.0, other_s=1.0,
           rollout_share=0.2, step_speedup=1.2, amdahl_ceiling=1.2),
    _point("generate", 32, status="oom"),
]


def test_step_split_stacks_the_phases_and_names_the_ceiling(tmp_path):
    fig = plots.step_split_figure(STEP_POINTS)
    assert [t.name for t in fig.data] == ["rollout", "old-logprob forward", "update", "other"]
    assert list(fig.data[0].y) == ["N=8 generate", "N=8 continuous", "N=32 generate"]
    assert list(_trace(fig, "update").x) == [15.0, 15.0, None]  # the OOM point is an empty bar, not a zero
    assert fig.data[0].text[0] == "10.0 s (5% of roof)" and fig.data[0].text[1] == "5.0 s"
    notes = [a.text for a in fig.layout.annotations]
    assert notes == ["step 30 s, rollout 33% of it", "step 1.20x vs Amdahl ceiling 1.20x", "OOM"]
    assert fig.layout.barmode == "stack"
    html = plots.write_report(STEP_POINTS, tmp_path / "r.html").read_text()
    assert "One GRPO step, split by phase" in html
    html = plots.write_report(POINTS, tmp_path / "p.html").read_text()
    assert "split by phase" not in html  # a rollout-only sweep has no step to split
