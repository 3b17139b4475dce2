"""KV accounting, the engine timeline and the memory probe."""

from __future__ import annotations

import math

import pytest

from cbkit.rollout import SamplingParams, make_backend
from cbkit.telemetry import PeakMemory, kv_accounting, kv_bytes_per_token, occupancy


def test_kv_bytes_per_token_by_hand(tiny):
    # tiny: 2 layers x (K and V) x 2 kv heads x head_dim 16 x 4 bytes
    assert kv_bytes_per_token(tiny.model.config, 4) == 2 * 2 * 2 * 16 * 4

    class Llama1B:  # Llama-3.2-1B's shape
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_size = 16, 32, 8, 64, 2048

    assert kv_bytes_per_token(Llama1B(), 2) == 32768


@pytest.fixture(scope="module")
def rollouts(tiny):
    tok = tiny.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "x" * k}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for k in (3, 30)]
    sp = SamplingParams(max_new_tokens=20, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=1,
                        temperature=1.5)
    g = make_backend("generate", tiny.model).generate(prompts, 3, sp)
    c = make_backend("continuous", tiny.model, record_timestamps=True, cb_config={"page_size": 8}).generate(
        prompts, 3, sp)
    return g, c


def test_static_batch_accounting(tiny, rollouts):
    g, _ = rollouts
    acc = kv_accounting(g, tiny.model.config, 4)
    rows, width, steps = 6, g.engine_config["padded_prompt_len"], g.engine_config["steps"]
    assert acc["token_slots"] == rows * (width + steps)
    assert acc["kv_bytes"] == acc["token_slots"] * 512
    useful = sum(len(c.prompt_ids) + len(c.completion_ids) for c in g.completions)
    assert acc["kv_padding_share"] == pytest.approx(1 - useful / (rows * (width + steps)))
    assert acc["kv_padding_share"] > 0.2  # prompts of very different lengths: a third of the rows is left pad


def test_pool_accounting_and_timeline(tiny, rollouts):
    _, c = rollouts
    acc = kv_accounting(c, tiny.model.config, 4)
    assert acc["kv_bytes"] == c.engine_config["num_blocks"] * 8 * 512
    occ = occupancy(c.timeline)
    assert len(c.timeline["requests"]) == 6
    assert max(occ["running"]) <= 6 and occ["running"][-1] == 0 and occ["blocks_in_use"][-1] == 0
    assert max(occ["blocks_in_use"]) <= occ["pool_blocks"]
    assert occ["t"] == sorted(occ["t"]) and occ["t"][0] >= 0
    for r, comp in zip(c.timeline["requests"], c.completions, strict=True):
        assert r["start"] <= r["end"] and len(r["token_times"]) == len(comp.completion_ids)


def test_occupancy_by_hand():
    timeline = {"page_size": 4, "t0": 10.0, "pool_blocks": 8, "requests": [
        {"id": 0, "group": 0, "prompt_len": 3, "start": 10.0, "end": 10.5, "token_times": [10.1, 10.2, 10.3]},
        {"id": 1, "group": 0, "prompt_len": 3, "start": 10.6, "end": 10.9, "token_times": [10.7]},
    ]}
    occ = occupancy(timeline)
    # request 0: 1 block at start, a 2nd when its 5th token (2nd generated) lands, both freed at 10.5;
    # then request 1 reuses the pool: recycling.
    assert occ["blocks_in_use"] == [1, 2, 0, 1, 0]
    assert occ["running"] == [1, 1, 0, 1, 0]
    assert [round(t, 3) for t in occ["t"]] == [0.0, 0.2, 0.5, 0.6, 0.9]


def test_peak_memory_sees_an_allocation():
    import torch

    with PeakMemory("cpu") as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB
        x += 1
        import time

        time.sleep(0.05)
    assert mem.kind == "cpu_rss" and mem.peak_bytes > 48 * 2**20
    assert not math.isnan(mem.peak_bytes)


def test_occupancy_counts_a_groups_shared_prompt_pages_once():
    """Prefix sharing: two requests of one group with a 9-token prompt (two complete 4-token pages) share those
    pages from the group's first start to its last end; each holds only its own partial page and beyond."""
    requests = [
        {"id": 0, "group": 0, "prompt_len": 9, "start": 0.0, "end": 1.0, "token_times": [0.5, 0.6, 0.7, 0.8]},
        {"id": 1, "group": 0, "prompt_len": 9, "start": 0.2, "end": 2.0, "token_times": [0.3]},
    ]
    shared = occupancy({"page_size": 4, "t0": 0.0, "prefix_sharing": True, "requests": requests})
    alone = occupancy({"page_size": 4, "t0": 0.0, "prefix_sharing": False, "requests": requests})
    # shared: 2 prompt pages + 1 own page (req 0); +1 own page (req 1); req 0 grows into a 2nd own page at its
    # 4th token (9 + 4 = 13 tokens > 12); req 0 ends (-2); req 1 ends with the shared pages (-1 - 2).
    assert shared["blocks_in_use"] == [3, 4, 5, 3, 0]
    # without sharing every request holds all of its pages: 3, then 3 + 3, then 4 + 3, then 3, then 0.
    assert alone["blocks_in_use"] == [3, 6, 7, 3, 0]
    assert shared["running"] == alone["running"] == [1, 2, 2, 1, 0]


def test_real_timeline_with_sharing_stays_inside_the_pool(tiny):
    """The engine shares a group's complete prompt pages; counting them once keeps the timeline's blocks in use
    within the pool the engine really had, even when the pool is too small for every request's own copy."""
    from cbkit.rollout import SamplingParams, make_backend

    tok = tiny.tokenizer
    prompts = [list(range(5, 5 + 40)), list(range(7, 7 + 33))]
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    cb = make_backend("continuous", tiny.model, record_timestamps=True, cb_config={"page_size": 8, "num_blocks": 24})
    r = cb.generate(prompts, 6, sampling)
    assert r.timeline["prefix_sharing"] is True
    occ = occupancy(r.timeline)
    assert max(occ["blocks_in_use"]) <= r.engine_config["num_blocks"]
    unshared = occupancy({**r.timeline, "prefix_sharing": False})
    assert max(unshared["blocks_in_use"]) > max(occ["blocks_in_use"])


def test_cpu_peak_is_the_kernels_high_water_mark_without_a_poller():
    """A 64 MiB buffer allocated and freed inside the probe: the peak sees it (the kernel's VmHWM, exact), and no
    poller thread ran beside the measured code."""
    import threading

    import torch

    from cbkit.telemetry import PeakMemory

    before = threading.active_count()
    with PeakMemory("cpu") as mem:
        during = threading.active_count()
        buf = torch.ones(64 * 2**20, dtype=torch.uint8)  # touched, so resident
        del buf
    assert mem._hwm, "this Linux machine lets a process reset its own VmHWM (/proc/self/clear_refs)"
    assert during == before
    assert 60 * 2**20 <= mem.peak_bytes < 96 * 2**20


def test_process_peak_rss_survives_the_probes_reset_of_the_high_water_mark():
    """A 128 MiB buffer touched and freed, then a PeakMemory (which resets VmHWM to the current RSS): the kernel's
    counter no longer holds that peak, the process's peak since it started still does."""
    import torch

    from cbkit.telemetry import PeakMemory, _high_water_mark, process_peak_rss, rss_reader

    rss = rss_reader()
    buf = torch.ones(128 * 2**20, dtype=torch.uint8)  # touched, so resident; large, so freed straight to the OS
    high = rss()
    del buf
    with PeakMemory("cpu"):
        pass
    assert _high_water_mark() < high - 64 * 2**20, "the reset should have dropped VmHWM below the buffer's peak"
    # VmHWM trails the RSS counters by the kernel's per-thread batching (a few hundred KiB here)
    assert process_peak_rss() >= high - 16 * 2**20
