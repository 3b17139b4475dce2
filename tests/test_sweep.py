"""The N-sweep's bookkeeping on the tiny model: resume, refusal to mix, OOM and Ctrl-C, aggregation."""

from __future__ import annotations

import json

import pytest
import torch

from cbkit.measure import results, roofline
from cbkit.measure.results import ResultsFile, aggregate
from cbkit.measure.sweep import run_sweep
from cbkit.measure.sweep_config import SweepConfig


def _row(table: str, backend: str) -> list[str]:
    """The cells of a markdown table's row for ``backend``."""
    return [c.strip() for c in next(r for r in table.splitlines() if f" {backend} |" in r).split("|")[1:-1]]


def _cfg(**kw):
    base = dict(model="tiny", ns=(1, 2), repeats=2, max_new_tokens=6, num_prompts=1)
    return SweepConfig(**{**base, **kw})


@pytest.fixture
def counting(monkeypatch):
    """Count (and optionally sabotage) the rollouts the sweep asks for."""
    calls: list[tuple[str, int]] = []
    sabotage: dict[int, BaseException] = {}
    import cbkit.rollout

    real = cbkit.rollout.make_backend

    def make(name, model, **kw):
        backend = real(name, model, **kw)
        inner = backend.generate

        def generate(prompts, n, sampling, **k):
            calls.append((name, n))
            if len(calls) in sabotage:
                raise sabotage[len(calls)]
            return inner(prompts, n, sampling, **k)

        backend.generate = generate
        return backend

    monkeypatch.setattr(cbkit.rollout, "make_backend", make)  # where the run set-up builds backends
    return calls, sabotage


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sweep_writes_header_and_one_line_per_run_then_resumes(tiny, tmp_path, counting):
    calls, _ = counting
    out = tmp_path / "s.jsonl"
    points = run_sweep(_cfg(), out, policy=tiny)
    lines = _lines(out)
    assert lines[0]["kind"] == "header" and lines[0]["fingerprint"]["model"] == "tiny"
    runs = [x for x in lines if x["kind"] == "run"]
    assert len(runs) == 2 * 2 * 2  # ns x repeats x backends
    assert all(r["planned_peak_bytes"] > 0 and r["plan_error"] is not None for r in runs)
    assert {(p["backend"], p["N"]) for p in points} == {(b, n) for b in ("generate", "continuous") for n in (1, 2)}
    # backend order alternates between repeats: neither always runs first
    firsts = {runs[i]["backend"] for i in range(0, len(runs), 2)}
    assert firsts == {"generate", "continuous"}

    n_calls = len(calls)
    again = run_sweep(_cfg(), out, policy=tiny)
    assert len(calls) == n_calls, "a finished sweep must not rerun anything"
    assert again == points

    more = run_sweep(_cfg(ns=(1, 2, 3)), out, policy=tiny)  # growing ns is allowed and runs only what is new
    assert {c[1] for c in calls[n_calls:]} - {1} == {3}
    assert {p["N"] for p in more} == {1, 2, 3}


def test_refuses_to_mix_configurations(tiny, tmp_path):
    out = tmp_path / "s.jsonl"
    run_sweep(_cfg(ns=(1,), repeats=1), out, policy=tiny)
    with pytest.raises(ValueError, match=r"different configuration \(max_new_tokens: file has 6, now 7\)"):
        run_sweep(_cfg(ns=(1,), repeats=1, max_new_tokens=7), out, policy=tiny)
    bad = tmp_path / "other.jsonl"
    bad.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a cbkit sweep results file"):
        ResultsFile(bad, {})


def test_oom_is_recorded_and_the_sweep_goes_on(tiny, tmp_path, counting):
    calls, sabotage = counting
    sabotage[3] = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # 1-2 are warm-ups
    out = tmp_path / "s.jsonl"
    points = run_sweep(_cfg(ns=(1, 2), repeats=1), out, policy=tiny)
    runs = [x for x in _lines(out) if x["kind"] == "run"]
    assert [r["status"] for r in runs].count("oom") == 1 and len(runs) == 4
    oom = next(r for r in runs if r["status"] == "oom")
    assert "out of memory" in oom["error"] and "peak_mem_bytes" in oom
    assert any(p["status"] == "oom" for p in points)
    assert "oom" in results.points_table(points)


def test_ctrl_c_keeps_finished_runs_and_rerun_resumes(tiny, tmp_path, counting):
    calls, sabotage = counting
    sabotage[5] = KeyboardInterrupt()  # warm-ups are calls 1-2, so two runs finish before it
    out = tmp_path / "s.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(_cfg(), out, policy=tiny)
    assert len([x for x in _lines(out) if x["kind"] == "run"]) == 2
    run_sweep(_cfg(), out, policy=tiny)
    runs = [x for x in _lines(out) if x["kind"] == "run"]
    assert len(runs) == 8 and len({(r["backend"], r["N"], r["repeat"]) for r in runs}) == 8


def test_aggregate_takes_medians_and_ratios():
    def run(b, n, rep, tps, mem):
        return {"backend": b, "N": n, "repeat": rep, "status": "ok", "tokens_per_s": tps, "rollout_s": 1.0,
                "peak_mem_bytes": mem, "kv_bytes": 10, "kv_padding_share": 0.1}

    runs = [run("generate", 8, r, t, 100) for r, t in enumerate([10, 30, 20])]
    runs += [run("continuous", 8, r, t, 50) for r, t in enumerate([25, 5, 30])]
    pts = {p["backend"]: p for p in aggregate(runs)}
    assert pts["generate"]["tokens_per_s"] == 20 and pts["continuous"]["tokens_per_s"] == 25
    assert pts["continuous"]["speed_vs_generate"] == pytest.approx(1.25)
    assert pts["continuous"]["mem_vs_generate"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kw, msg",
    [(dict(ns=(0, 8)), "ns must be positive"), (dict(backends=("generate", "vllm")), "Unknown backend"),
     (dict(backends=("continuous",)), "keep 'generate'"), (dict(repeats=0), "repeats")],
)
def test_bad_sweep_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**kw)


def test_cli_rejects_bad_ns(capsys):
    from cbkit.cli import main

    assert main(["sweep", "--ns", "8,x", "--no-live", "--model", "tiny"]) == 2
    assert "--ns takes comma-separated integers" in capsys.readouterr().err


def test_full_step_times_a_grpo_step_and_restores_the_weights(tiny, tmp_path):
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    points = run_sweep(_cfg(ns=(2,), repeats=1, full_step=True, lengths="natural"), tmp_path / "s.jsonl",
                       policy=tiny)
    runs = [x for x in _lines(tmp_path / "s.jsonl") if x["kind"] == "run"]
    assert len(runs) == 2 and all(r["status"] == "ok" for r in runs)
    for r in runs:
        assert 0 < r["rollout_s"] < r["step_s"] and r["train_s"] > 0
        # the phases are disjoint parts of the step: what is left for "other" is the rewards and the bookkeeping
        assert r["old_logprob_s"] > 0 and r["update_s"] > 0 and r["other_s"] >= 0
        assert r["rollout_s"] + r["old_logprob_s"] + r["update_s"] + r["other_s"] == pytest.approx(r["step_s"])
        assert r["train_s"] >= r["old_logprob_s"] + r["update_s"]
        assert r["completion_tokens"] == sum(r["completion_lengths"])  # natural: EOS decided each length
    assert {p["backend"] for p in points} == {"generate", "continuous"}
    for k, v in tiny.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_full_step_collects_the_last_points_garbage_before_its_baseline(tiny, tmp_path, monkeypatch):
    """A full-step point reads its memory baseline only after the cyclic garbage collector has run. What the last
    point left in reference cycles (its trainer, with AdamW's moments) would otherwise sit in the baseline and be
    freed at whatever moment the collector runs inside the step, taking up to its size off the measured peak
    (lab/full_step.md: CB's N=8 step on SmolLM2 measured 1.46 GB that way and 2.40 GB collected first)."""
    import gc
    import weakref

    import cbkit.measure.sweep as sweep

    class Cycle:
        pass

    alive_at_baseline = []

    class Watched(sweep.PeakMemory):
        def __enter__(self):
            alive_at_baseline.append(left() is not None)
            return super().__enter__()

    monkeypatch.setattr(sweep, "PeakMemory", Watched)
    gc.disable()  # as in a long step: the cycle has outlived the young generations' collections
    try:
        garbage = Cycle()
        garbage.itself = garbage
        left = weakref.ref(garbage)
        del garbage
        run_sweep(_cfg(ns=(2,), repeats=1, full_step=True, lengths="natural", backends=("generate",)),
                  tmp_path / "s.jsonl", policy=tiny)
    finally:
        gc.enable()
    assert alive_at_baseline == [False]


def test_full_step_replays_the_workload_and_splits_the_step(tiny, tmp_path):
    """--full-step --lengths replay:gsm8k: every completion of the step stops at the target the workload drew for
    its row (the same targets for both backends), the rollout gets its share of its roof, and each point the
    Amdahl ceiling its rollout speed-up predicts."""
    from cbkit.measure.results import amdahl_ceiling
    from cbkit.measure.workload import parse_lengths

    cfg = _cfg(ns=(3,), repeats=1, full_step=True, max_new_tokens=10, num_prompts=2, forward_chunk_rows=2)
    points = run_sweep(cfg, tmp_path / "s.jsonl", policy=tiny)
    runs = _runs(tmp_path / "s.jsonl")
    want = parse_lengths("replay:gsm8k").targets(6, 10, seed=cfg.seed)
    assert len(set(want)) > 1  # a spread, not one length
    for r in runs:
        assert r["status"] == "ok" and r["lengths"] == "replay:gsm8k" and r["forward_chunk_rows"] == 2
        # the trainer visits the prompts in its own seeded order: the same targets, per row of that order
        assert sorted(r["completion_lengths"]) == sorted(want) and r["truncated_share"] == 1.0
        assert r["completion_tokens"] == sum(want)
        assert 0 < r["roof_share"] < 1  # the rollout does not beat its roof
        assert r["rollout_share"] == pytest.approx(r["rollout_s"] / r["step_s"])
    assert runs[0]["completion_lengths"] == runs[1]["completion_lengths"]
    by = {p["backend"]: p for p in points}
    g, c = by["generate"], by["continuous"]
    assert c["step_speedup"] == pytest.approx(g["step_s"] / c["step_s"])
    assert c["amdahl_ceiling"] == pytest.approx(amdahl_ceiling(g["rollout_share"], g["rollout_s"] / c["rollout_s"]))
    assert g["amdahl_ceiling"] == pytest.approx(1.0)
    table = results.step_split_table(points)
    assert table.count("\n") == 3 and "Amdahl ceiling" in table
    assert _row(table, "continuous")[:3] == ["3", "continuous", f"{c['step_s']:.2f}"]


def test_amdahl_ceiling_by_hand():
    from cbkit.measure.results import amdahl_ceiling

    # a rollout a quarter of the step, made twice as fast: the step takes 0.75 + 0.125 of its time
    assert amdahl_ceiling(0.25, 2.0) == pytest.approx(1 / 0.875)
    assert amdahl_ceiling(1.0, 3.0) == pytest.approx(3.0) and amdahl_ceiling(0.0, 3.0) == 1.0
    assert amdahl_ceiling(0.8, 1e9) == pytest.approx(5.0)  # the update's fifth bounds any rollout speed-up
    with pytest.raises(ValueError, match="rollout share"):
        amdahl_ceiling(1.5, 2.0)


def _old_full_step_runs() -> list[dict]:
    """Full-step run lines without the length columns and phases: a mean length and no CV, max or padding share."""
    return [{"kind": "run", "backend": b, "N": 8, "repeat": 0, "status": "ok", "step_s": step, "rollout_s": roll,
             "train_s": step - roll, "rollout_share": roll / step, "completion_tokens": 700.0, "tokens_per_s": 700.0 / step,
             "peak_mem_bytes": 3 * 2**30, "peak_mem_kind": "cpu_rss", "length_mean": 87.5, "reward_mean": 0.1,
             "lengths": "natural"}
            for b, step, roll in (("generate", 29.1, 10.9), ("continuous", 32.5, 16.1))]


def test_full_step_tables_on_results_without_lengths(tmp_path, capsys):
    """The tables `cbkit sweep --full-step` prints, on runs lacking the length columns: no TypeError (it used to
    end the command in a traceback), a dash where a column is missing, and the split of what there is."""
    from cbkit.cli import main

    points = aggregate(_old_full_step_runs())
    split = results.step_split_table(points)
    assert _row(split, "continuous")[:7] == ["8", "continuous", "32.50", "16.10 (—)", "—", "—", "—"]
    # generate()'s rollout was 10.9 / 29.1 of its step; CB's rollout 10.9 / 16.1 as fast
    ceiling = 1 / ((1 - 10.9 / 29.1) + (10.9 / 29.1) * 16.1 / 10.9)
    assert _row(split, "continuous")[9] == f"{ceiling:.2f}x"
    results.points_table(points)
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [{"kind": "header", "fingerprint": {"model": "tiny",
                                                                                           "full_step": True}},
                                                      *_old_full_step_runs()]) + "\n")
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "Amdahl ceiling" in out


def test_cli_full_step_replay_runs_end_to_end(tmp_path, capsys):
    """`cbkit sweep --full-step --lengths replay:gsm8k` on the tiny model: every table and the split printed, the
    report written with the split figure, no traceback."""
    from cbkit.cli import main

    out = tmp_path / "s.jsonl"
    assert main(["sweep", "--full-step", "--lengths", "replay:gsm8k", "--model", "tiny", "--ns", "2",
                 "--repeats", "1", "--max-new-tokens", "6", "--no-live", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Traceback" not in printed and "One GRPO step split by phase" in printed
    assert "| 2 | continuous |" in printed
    assert "One GRPO step, split by phase" in out.with_suffix(".html").read_text()


# --- length workloads and MFU -------------------------------------------------------------------------------


def _runs(path):
    return [x for x in _lines(path) if x["kind"] == "run"]


def test_replay_gives_both_backends_the_same_targets_and_records_the_spread(tiny, tmp_path):
    from cbkit.measure.workload import parse_lengths

    cfg = _cfg(ns=(3, 5), repeats=2, max_new_tokens=12, num_prompts=2)  # default: replay:gsm8k
    out = tmp_path / "s.jsonl"
    points = run_sweep(cfg, out, policy=tiny)
    assert _lines(out)[0]["fingerprint"]["lengths"] == "replay:gsm8k"
    runs = _runs(out)
    gsm = parse_lengths("replay:gsm8k")
    for r in runs:
        lengths = r["completion_lengths"]
        assert r["lengths"] == "replay:gsm8k" and len(lengths) == 2 * r["N"]
        # the targets the workload draws for this point, recomputed independently of the sweep
        assert lengths == gsm.targets(2 * r["N"], 12, seed=cfg.seed + r["repeat"])
        assert r["length_max"] == max(lengths) and r["length_mean"] == pytest.approx(sum(lengths) / len(lengths))
        # the static batch runs every row to the longest: its padding, from the recorded lengths
        assert r["decode_padding_share"] == pytest.approx(1 - sum(lengths) / (len(lengths) * max(lengths)))
        assert r["completion_tokens"] == sum(lengths)
        if r["backend"] == "continuous":
            # the CPU pool follows the targets: the engine's own block count, next to the per-row sizing
            assert r["engine_config"]["num_blocks"] == _blocks(tiny, lengths, r["N"], r["engine_config"]["page_size"])
    by_point = {}
    for r in runs:
        by_point.setdefault((r["N"], r["repeat"]), []).append(r["completion_lengths"])
    assert all(a == b for a, b in by_point.values())  # identical targets per request for both backends
    assert any(len(set(r["completion_lengths"])) > 1 for r in runs)  # a spread, not one length
    table = results.points_table(points)
    assert "len" in table and "MFU" in table


def _blocks(tiny, lengths, n, page):
    """Blocks the planner predicts for the run's prompts at these per-row lengths (sector-rounded as the engine)."""
    from cbkit.measure.planner import plan
    from cbkit.tasks.data import chat_prompt_ids, load_problems

    prompts = [chat_prompt_ids(tiny.tokenizer, p) for p in load_problems("synthetic", n=2, seed=0)]
    rows = [x for x in prompts for _ in range(n)]
    need = sum(-(-(len(r) + t) // page) for r, t in zip(rows, lengths, strict=True)) + 1
    p = plan(tiny.model.config, num_prompts=2, num_generations=n, prompt_len=[len(x) for x in prompts],
             max_new_tokens=max(lengths), dtype_bytes=4, device="cpu", cb_config={"num_blocks": need})
    return p.continuous.num_blocks


def test_mfu_is_computed_from_the_recorded_numbers(tiny, tmp_path):
    out = tmp_path / "s.jsonl"
    run_sweep(_cfg(ns=(2,), repeats=1, lengths="fixed"), out, policy=tiny)
    # tiny: per layer q 64x64, k and v 64x32, o 64x64, gate/up/down 64x128 each; 2 layers; lm_head vocab x 64
    params = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) + tiny.model.config.vocab_size * 64
    probe = next(x for x in _lines(out) if x["kind"] == "probe")
    assert 0 < probe["peak_flops"] < float("inf")
    for r in _runs(out):
        assert r["completion_lengths"] == [6, 6]  # fixed: every completion runs to the limit
        assert r["matmul_params"] == params and r["peak_flops"] == probe["peak_flops"]
        assert r["mfu"] == pytest.approx(2 * params * r["completion_tokens"] / r["rollout_s"] / probe["peak_flops"])
    assert "matmul probe:" in results.results_summary(out) and "lengths: fixed" in results.results_summary(out)


def test_matmul_probe_is_positive_and_takes_the_best(tiny):
    measured = roofline.matmul_probe(tiny.model, rows=(8, 64), min_seconds=0.01, rounds=2)
    assert measured["probe_shape"] == [64, 128] and measured["probe_dtype"] == "float32"
    assert 0 < measured["peak_flops"] < float("inf")
    assert measured["peak_flops"] == max(measured["probe_flops_by_rows"].values())


def test_resuming_with_another_workload_is_refused(tiny, tmp_path):
    out = tmp_path / "s.jsonl"
    run_sweep(_cfg(ns=(1,), repeats=1), out, policy=tiny)
    with pytest.raises(ValueError, match=r"lengths: file has 'replay:gsm8k', now 'fixed'"):
        run_sweep(_cfg(ns=(1,), repeats=1, lengths="fixed"), out, policy=tiny)


def test_bad_workloads_fail_before_model_time():
    with pytest.raises(ValueError, match="Unknown length workload"):
        _cfg(lengths="uniform:3")
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        _cfg(max_new_tokens=0)
    with pytest.raises(ValueError, match="forward_chunk_rows"):
        _cfg(full_step=True, forward_chunk_rows=0)


def test_cli_says_which_workload_ran(tmp_path, capsys):
    from cbkit.cli import main

    assert main(["sweep", "--lengths", "uniform", "--no-live", "--model", "tiny"]) == 2
    assert "Unknown length workload" in capsys.readouterr().err
    out = tmp_path / "s.jsonl"
    assert main(["sweep", "--model", "tiny", "--ns", "1", "--repeats", "1", "--max-new-tokens", "8", "--no-live",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "lengths: replay:gsm8k" in printed and "scaled x8/232" in printed and "matmul probe:" in printed


def test_a_probe_that_cannot_run_leaves_its_columns_empty_and_says_why(tiny, tmp_path, monkeypatch, capsys):
    def no_bandwidth(*a, **k):
        raise RuntimeError("no bandwidth here")

    monkeypatch.setattr(roofline, "bandwidth_probe", no_bandwidth)
    out = tmp_path / "s.jsonl"
    points = run_sweep(_cfg(ns=(2,), repeats=1, lengths="fixed"), out, policy=tiny)
    runs = _runs(out)
    assert len(runs) == 2 and all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in runs)  # still measured
    for r in runs:
        assert r["roof_tokens_per_s"] is None and r["roof_share"] is None and r["bytes_per_s"] is None
        assert "bytes_per_s: bandwidth probe failed: RuntimeError: no bandwidth here" in r["roof_missing"]
        assert r["mfu"] is not None  # the matmul roof was probed: MFU stands without the other one
    assert all(p["roof_share"] is None and "no bandwidth here" in p["roof_missing"] for p in points)
    assert "no bytes_per_s (bandwidth probe failed" in capsys.readouterr().out
    summary = results.results_summary(out)
    assert "read bandwidth: missing (bandwidth probe failed: RuntimeError: no bandwidth here)" in summary
    # roof and share of it: empty, not zero
    assert _row(results.points_table(points), "generate")[-3:-1] == ["—", "—"]


def test_without_a_matmul_probe_there_is_no_mfu_and_no_roof(tiny, tmp_path, monkeypatch):
    def no_matmul(*a, **k):
        raise torch.OutOfMemoryError("probe did not fit")

    monkeypatch.setattr(roofline, "matmul_probe", no_matmul)
    out = tmp_path / "s.jsonl"
    run_sweep(_cfg(ns=(1,), repeats=1, lengths="fixed"), out, policy=tiny)
    for r in _runs(out):
        assert r["status"] == "ok" and r["peak_flops"] is None and r["mfu"] is None
        assert r["roof_tokens_per_s"] is None and "peak_flops: matmul probe failed: OutOfMemoryError" in r["roof_missing"]
        assert r["bytes_per_s"] > 0  # the probe that ran is kept


def test_each_n_is_probed_again_and_its_runs_carry_that_probe(tiny, tmp_path, monkeypatch):
    import cbkit.measure.sweep as sweep_module
    from cbkit.measure.roofline import rollout_roofline

    probes = iter([(5e8, 1e12), (1e15, 2e6)])  # start: compute binds; before N=2: bandwidth binds

    def fake(model, **k):
        flops, bw = next(probes)
        return {"peak_flops": flops, "bytes_per_s": bw, "probe_missing": {}}

    monkeypatch.setattr(sweep_module, "machine_probe", fake)
    out = tmp_path / "s.jsonl"
    run_sweep(_cfg(ns=(1, 2), repeats=1, lengths="fixed"), out, policy=tiny)
    lines = [x for x in _lines(out) if x["kind"] == "probe"]
    assert [x["before_N"] for x in lines] == [None, 2]
    for r in _runs(out):
        flops, bw = (5e8, 1e12) if r["N"] == 1 else (1e15, 2e6)
        assert r["peak_flops"] == flops and r["bytes_per_s"] == bw
        assert r["roof_bound"] == ("compute" if r["N"] == 1 else "bandwidth")
        roof = rollout_roofline(tiny.model.config, prompt_lens=[len(r_) for r_ in _prompt_ids(tiny)],
                                completion_lengths=r["completion_lengths"], dtype_bytes=4, peak_flops=flops,
                                bytes_per_s=bw)
        assert r["roof_tokens_per_s"] == pytest.approx(roof["attainable_tokens_per_s"])
        assert r["roof_share"] == pytest.approx(r["tokens_per_s"] / roof["attainable_tokens_per_s"])


def _prompt_ids(tiny):
    from cbkit.train.setup import set_up_run

    return set_up_run("tiny", "synthetic", 1, seed=0, policy=tiny).prompts


def test_bandwidth_probe_keeps_every_round_and_takes_the_best():
    measured = roofline.bandwidth_probe("cpu", nbytes=8 * 2**20, min_seconds=0.01, rounds=3)
    assert len(measured["bandwidth_rounds"]) == 3 and measured["bytes_per_s"] == max(measured["bandwidth_rounds"])
    assert 1e7 < measured["bytes_per_s"] < 1e13  # 10 MB/s .. 10 TB/s: a CPU reads somewhere in between
