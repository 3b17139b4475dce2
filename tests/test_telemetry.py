"""KV accounting, the engine timeline and the memory probe."""

from __future__ import annotations

import math

import pytest

from cbkit.rollout import SamplingParams, make_backend
from cbkit.telemetry import PeakMemory, kv_accounting, kv_bytes_per_token


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
    assert acc["kv_bytes"] == rows * (width + steps) * 512
    useful = sum(len(c.prompt_ids) + len(c.completion_ids) for c in g.completions)
    assert acc["kv_padding_share"] == pytest.approx(1 - useful / (rows * (width + steps)))
    assert acc["kv_padding_share"] > 0.2  # prompts of very different lengths: a third of the rows is left pad


def test_pool_accounting_and_timeline(tiny, rollouts):
    _, c = rollouts
    acc = kv_accounting(c, tiny.model.config, 4)
    assert acc["kv_bytes"] == c.engine_config["num_blocks"] * 8 * 512
    assert len(c.timeline["requests"]) == 6
    for r, comp in zip(c.timeline["requests"], c.completions, strict=True):
        assert r["start"] <= r["end"] and len(r["token_times"]) == len(comp.completion_ids)


def test_peak_memory_sees_an_allocation():
    import torch

    with PeakMemory("cpu") as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB
        x += 1
        import time

        time.sleep(0.05)
    assert mem.kind == "cpu_rss" and mem.peak_bytes > 48 * 2**20
    assert not math.isnan(mem.peak_bytes)


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
    assert mem._poller is None, "this Linux machine lets a process reset its own VmHWM (/proc/self/clear_refs)"
    assert during == before
    assert 60 * 2**20 <= mem.peak_bytes < 96 * 2**20


def test_process_peak_rss_survives_the_probes_reset_of_the_high_water_mark():
    """A 128 MiB buffer touched and freed, then a PeakMemory (which resets VmHWM to the current RSS): the kernel's
    counter no longer holds that peak, the process's peak since it started still does."""
    import torch

    from cbkit.telemetry import PeakMemory, _status_bytes, process_peak_rss, resident_bytes

    buf = torch.ones(128 * 2**20, dtype=torch.uint8)  # touched, so resident; large, so freed straight to the OS
    high = resident_bytes()
    del buf
    with PeakMemory("cpu"):
        pass
    assert _status_bytes("VmHWM") < high - 64 * 2**20, "the reset should have dropped VmHWM below the buffer's peak"
    # VmHWM trails the RSS counters by the kernel's per-thread batching (a few hundred KiB here)
    assert process_peak_rss() >= high - 16 * 2**20
