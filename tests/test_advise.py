"""The memory planner against hand arithmetic and against the CB engine itself, the decision guide, the CLI."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from cbkit.cli import main
from cbkit.measure.planner import crossover_n, plan
from cbkit.telemetry import kv_bytes_per_token

GiB = 1024**3


def llama_1b_config():
    """Llama-3.2-1B's shape (16 layers, 8 KV heads of 64, 32 heads, 2048 hidden, 128256 vocab), no weights."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=16, num_key_value_heads=8, num_attention_heads=32, head_dim=64,
                       hidden_size=2048, intermediate_size=8192, vocab_size=128256)


# --- KV bytes per token -------------------------------------------------------------------------------------


def test_kv_bytes_per_token_by_hand(tiny):
    # tiny: 2 layers x 2 (K and V) x 2 KV heads x head_dim 64/4=16 x 4 bytes (fp32)
    assert kv_bytes_per_token(tiny.model.config, 4) == 2 * 2 * 2 * 16 * 4 == 512
    assert kv_bytes_per_token(llama_1b_config(), 2) == 16 * 2 * 8 * 64 * 2 == 32768


def test_kv_bytes_per_token_without_head_dim():
    cfg = types.SimpleNamespace(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=512)
    assert kv_bytes_per_token(cfg, 2) == 4 * 2 * 2 * (512 // 8) * 2


# --- generate() ---------------------------------------------------------------------------------------------


def test_generate_kv_is_the_dynamic_cache_generate_holds_at_the_end(tiny):
    """Against transformers' own cache: after generate() the DynamicCache holds every row at prompt + steps - 1
    positions (the last sampled token is never fed back); the plan counts that last position too."""
    rows, prompt, steps = 3, 7, 5
    ids = torch.full((rows, prompt), 65)
    out = tiny.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, return_dict_in_generate=True,
                              pad_token_id=tiny.tokenizer.pad_token_id)
    cache = getattr(out, "cache", None) or out.past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    positions = cache.layers[0].keys.shape[-2]
    assert positions == prompt + steps - 1
    g = plan(tiny.model.config, num_prompts=1, num_generations=rows, prompt_len=prompt, max_new_tokens=steps,
             dtype_bytes=4, device="cpu").generate
    assert (g.rows, g.padded_len) == (rows, prompt + steps)
    assert g.kv_bytes == held // positions * (positions + 1)


def test_generate_scales_with_rows_and_fits_by_its_peak():
    """Llama-3.2-1B's shape: KV is rows x positions x 32768 bytes (worked by hand above); twice the rows is twice
    the KV and the last-step transients, and `fits` is the peak against the budget."""
    cfg = llama_1b_config()
    sizes = dict(num_prompts=8, prompt_len=200, max_new_tokens=512, dtype_bytes=2)
    g = plan(cfg, num_generations=64, budget_bytes=20 * GiB, **sizes).generate
    g2 = plan(cfg, num_generations=128, budget_bytes=20 * GiB, **sizes).generate
    assert g.kv_bytes == 512 * 712 * 32768
    assert (g2.kv_bytes, g2.decode_transient_bytes) == (2 * g.kv_bytes, 2 * g.decode_transient_bytes)
    assert g.fits and not g2.fits and g.peak_bytes <= 20 * GiB < g2.peak_bytes


def test_generate_plan_matches_telemetry_on_a_real_rollout(tiny):
    from cbkit.rollout.base import SamplingParams
    from cbkit.rollout.generate import GenerateBackend
    from cbkit.telemetry import kv_accounting

    prompts = [[65, 66, 67], [70] * 9]
    tok = tiny.tokenizer
    sampling = SamplingParams(max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    rollout = GenerateBackend(tiny.model).generate(prompts, 2, sampling)
    assert rollout.engine_config["steps"] == 6  # no EOS in the budget: the batch runs to max_new_tokens
    p = plan(tiny.model.config, num_prompts=2, num_generations=2, prompt_len=[3, 9], max_new_tokens=6,
             dtype_bytes=4, device="cpu")
    assert p.generate.kv_bytes == kv_accounting(rollout, tiny.model.config, 4)["kv_bytes"]


# --- the CB pool, checked against the engine ----------------------------------------------------------------


def _patch_free_memory(monkeypatch, budget: int) -> None:
    """Make the engine size its pool from `budget` bytes free, as on a GPU (pins where transformers reads it)."""
    import transformers.generation.continuous_batching.cache as cache_mod

    monkeypatch.setattr(cache_mod, "get_device_and_memory_breakdown",
                        lambda: (torch.device("cpu"), budget, 0, 0))


@pytest.mark.parametrize(
    ("name", "prompt_lens", "n", "max_new", "cb_config", "budget"),
    [
        ("cpu workload sizing", [5, 5], 3, 4, {}, None),
        ("small pages, mixed prompts", [40, 3, 90], 4, 8, {"page_size": 16}, None),
        ("num_blocks given", [5], 2, 4, {"num_blocks": 37}, None),
        ("memory, small batch", [5, 12], 2, 4, {"max_memory_percent": 0.45, "max_batch_tokens": 256, "num_blocks": None},
         256 << 20),
        ("memory, default batch (mask-bound)", [5], 3, 4, {"max_memory_percent": 0.4, "num_blocks": None}, 1 << 30),
    ],
)
@pytest.mark.parametrize("varlen", [False, True], ids=["engine-sdpa", "cbkit-cpu-varlen"])
def test_cb_pool_matches_the_engine(tiny, monkeypatch, name, prompt_lens, n, max_new, cb_config, budget, varlen):
    from cbkit.rollout.base import SamplingParams
    from cbkit.rollout.continuous import ContinuousBackend
    from cbkit.telemetry import kv_accounting

    if budget is not None:
        _patch_free_memory(monkeypatch, budget)
    prompts = [[65 + i % 7] * length for i, length in enumerate(prompt_lens)]
    from tests.reference_attention import engine_own_attention

    with contextlib.nullcontext() if varlen else engine_own_attention():
        rollout = ContinuousBackend(tiny.model, cb_config).generate(
            prompts, n, SamplingParams(max_new_tokens=max_new, eos_token_id=tiny.tokenizer.eos_token_id, seed=0))
    # cbkit's varlen attention: no dense mask to pay for
    p = plan(tiny.model.config, num_prompts=len(prompts), num_generations=n, prompt_len=prompt_lens,
             max_new_tokens=max_new, dtype_bytes=4, device="cpu", budget_bytes=budget, cb_config=cb_config,
             attn_implementation="varlen" if varlen else "sdpa")
    resolved = rollout.engine_config
    assert p.continuous.num_blocks == resolved["num_blocks"], name
    assert p.continuous.max_batch_tokens == resolved["max_batch_tokens"]
    assert p.continuous.page_size == resolved["page_size"]
    assert p.continuous.pool_bytes == kv_accounting(rollout, tiny.model.config, 4)["kv_bytes"]
    assert p.continuous.sized_by == ("memory" if budget else "num_blocks" if "num_blocks" in cb_config else "workload")


def test_cb_pool_on_gpu_does_not_grow_with_n():
    cfg = llama_1b_config()
    sizes = dict(num_prompts=8, prompt_len=200, max_new_tokens=512, dtype_bytes=2, budget_bytes=70 * GiB)
    pools = [plan(cfg, num_generations=n, **sizes).continuous.num_blocks for n in (8, 32, 64, 256)]
    # The hints do not cap the pool: free memory sizes it. More requests only reserve more LM-head rows
    # (max_requests_per_batch = min(requests, 1024)), which shrinks it slightly.
    assert pools == sorted(pools, reverse=True) and pools[-1] > 0.98 * pools[0]
    # 50% of the budget (cbkit's default) goes to the engine: the cache, its buffers and reservations
    p = plan(cfg, num_generations=8, attn_implementation="sdpa", **sizes).continuous
    assert p.engine_reserved_bytes <= 0.5 * 70 * GiB < p.engine_reserved_bytes + p.cache_tensor_bytes / p.num_blocks * 2
    # flash attention and cbkit's varlen one (the default) need no [batch, cache] mask: the budget buys more blocks
    for attn in ("flash", None):
        no_mask = plan(cfg, num_generations=8, attn_implementation=attn, **sizes).continuous
        assert no_mask.num_blocks > p.num_blocks and no_mask.buffer_bytes < p.buffer_bytes


def test_cb_on_gpu_needs_a_budget():
    with pytest.raises(ValueError, match="budget_bytes"):
        plan(llama_1b_config(), num_prompts=1, num_generations=8, prompt_len=10, max_new_tokens=10, dtype_bytes=2)


# --- crossover ----------------------------------------------------------------------------------------------


def test_crossover_is_where_cb_becomes_lighter_and_stays_so():
    cfg = llama_1b_config()
    sizes = dict(num_prompts=8, prompt_len=200, max_new_tokens=512, dtype_bytes=2, budget_bytes=40 * GiB)
    c = crossover_n(cfg, **sizes)
    assert c is not None and c > 1

    def lighter(n):
        p = plan(cfg, num_generations=n, **sizes)
        return p.continuous.peak_bytes < p.generate.peak_bytes

    assert not lighter(c - 1) and not lighter(1)
    assert all(lighter(n) for n in (c, c + 1, 2 * c, 4 * c))
    # more memory for the engine's pool pushes the crossover out
    assert crossover_n(cfg, **{**sizes, "budget_bytes": 70 * GiB}) > c
    assert crossover_n(cfg, max_n=c - 1, **sizes) is None


def test_bad_inputs_say_what_to_change():
    cfg = llama_1b_config()
    ok = dict(num_prompts=1, num_generations=8, prompt_len=10, max_new_tokens=10, dtype_bytes=2, budget_bytes=GiB)
    for bad, match in [({"num_generations": 0}, "num_generations"), ({"prompt_len": 0}, "prompt_len"),
                       ({"max_new_tokens": 0}, "max_new_tokens"), ({"budget_bytes": 0}, "budget_bytes"),
                       ({"mean_completion_len": 11}, "mean_completion_len"), ({"device": "tpu"}, "device"),
                       ({"prompt_len": [10, 10]}, "2 lengths")]:
        with pytest.raises(ValueError, match=match):
            plan(cfg, **{**ok, **bad})


# --- the CLI ------------------------------------------------------------------------------------------------


def test_cli_plan_prints_both_peaks_the_lower_one_and_the_crossover(capsys):
    """`cbkit plan`'s page against the planner called directly: on each side of the crossover the lower peak flips."""
    from cbkit.models.load import load_config

    cfg = load_config("llama-1b-random")
    sizes = dict(num_prompts=4, prompt_len=200, max_new_tokens=1024, dtype_bytes=2, budget_bytes=40 * GiB,
                 device="cuda")
    cross = crossover_n(cfg, **sizes)
    assert cross is not None and cross > 1
    for n in (cross - 1, cross):
        assert main(["plan", "-N", str(n), "--model", "llama-1b-random", "--prompts", "4", "--prompt-len", "200",
                     "--max-new-tokens", "1024", "--budget-gb", "40"]) == 0
        out = capsys.readouterr().out
        p = plan(cfg, num_generations=n, **sizes)
        lower = "continuous" if p.continuous.peak_bytes < p.generate.peak_bytes else "generate"
        assert lower == ("continuous" if n >= cross else "generate")
        assert f"lower peak at N={n}: {lower}" in out and f"crossover N: {cross}\n" in out
        assert "generate():" in out and "continuous:" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-N", "0"], "-N must be >= 1"),
        (["-N", "8", "--prompt-len", "0"], "prompt_len must be an integer >= 1"),
        (["-N", "8", "--max-new-tokens", "0"], "max_new_tokens"),
        (["-N", "8", "--budget-gb", "0"], "--budget-gb must be > 0"),
        (["-N", "8", "--budget-gb", "-3"], "--budget-gb must be > 0"),
        (["-N", "8", "--device", "cuda"], "give --budget-gb"),
        (["-N", "8", "--dtype", "int3"], "--dtype"),
        (["-N", "8", "--max-new-tokens", "10", "--mean-completion-len", "20"], "mean_completion_len"),
    ],
)
def test_cli_plan_bad_input(capsys, args, message):
    assert main(["plan", "--model", "tiny", *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_plan_unknown_model(capsys):
    assert main(["plan", "--model", "no-such-model", "-N", "8"]) == 2
    assert "Accepted forms" in capsys.readouterr().err


# --- the training step beside the rollout ------------------------------------------------------------------


def test_the_training_parts_grow_with_the_chunk_not_with_the_micro_batch():
    """`planner.training_bytes` on SmolLM2-135M's shape: a forward's logits and activations are one chunk's, so a
    chunk of 4 rows is a micro-batch of 4 rows, to the byte; unchunked, they grow with every row."""
    from transformers import LlamaConfig

    from cbkit.measure.planner import training_bytes

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    params, kw = 134_515_008, dict(tokens_per_row=196, completion_len=96, config=config, autocast=False)
    chunk4 = training_bytes(params, micro_batch_rows=32, chunk_rows=4, **kw)
    assert chunk4 == training_bytes(params, micro_batch_rows=4, **kw)
    assert chunk4["optimizer_state"] == 16 * params
    whole = training_bytes(params, micro_batch_rows=32, **kw)
    assert whole["activations"] == 8 * chunk4["activations"] and whole["logits"] == 8 * chunk4["logits"]


def test_the_planned_activations_are_what_autograd_saves(tiny):
    """`planner.activation_bytes_per_token` against an independent count: every tensor autograd saves for the
    backward of the loop's teacher-forced forward (`completion_logits`, left-padded rows, a padding mask), summed
    by storage, weights and the logits left out (`logits_bytes` plans those). Within 3% on the tiny Llama;
    Korthikanti's 34 x hidden bytes a token and layer (doubled in fp32), the planner's estimate before, is 16% short
    here and 20% short on SmolLM2."""
    from cbkit.measure.planner import activation_bytes_per_token
    from cbkit.rollout.base import Completion
    from cbkit.train.batch import Batch, completion_logits

    model = tiny.model
    completions = [Completion(prompt_ids=tuple(range(5, 5 + p)), completion_ids=tuple(range(40, 40 + c)),
                              sampling_logprobs=None, finish_reason="length", group=0)
                   for p, c in ((30, 20), (24, 11), (30, 17))]
    batch = Batch.from_completions(completions, pad_token_id=0, device="cpu", with_logprobs=False)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits = completion_logits(model, batch)
    logit_storages = {logits.untyped_storage().data_ptr()}
    counted = sum(n for ptr, n in saved.items() if ptr not in weights and ptr not in logit_storages)
    rows, width = batch.input_ids.shape
    planned = rows * width * activation_bytes_per_token(model.config, width, autocast=False)
    assert planned == pytest.approx(counted, rel=0.03)


def test_generate_on_a_cpu_carries_glibc_heap_slack_until_a_layer_is_mmapped():
    """On a CPU the static batch's plan adds `CPU_HEAP_SLACK` x its cache (glibc keeps freed torch.cat blocks
    resident beside the new ones, measured in lab/memory.md) while one layer's K is below glibc's largest mmap
    threshold; above it the blocks are mmapped and returned, so nothing is added; a GPU plan never has it."""
    from transformers import LlamaConfig

    from cbkit.measure.planner import CPU_HEAP_SLACK, CPU_HEAP_SLACK_MAX, GLIBC_MMAP_THRESHOLD_MAX

    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3)
    sizes = dict(num_prompts=1, prompt_len=137, max_new_tokens=96, dtype_bytes=4)
    cpu = plan(smol, num_generations=32, device="cpu", **sizes).generate
    gpu = plan(smol, num_generations=32, budget_bytes=20 * GiB, **sizes).generate
    assert cpu.kv_bytes == gpu.kv_bytes and gpu.cpu_heap_slack_bytes == 0
    assert cpu.cpu_heap_slack_bytes == int(CPU_HEAP_SLACK * cpu.kv_bytes) > 0
    assert cpu.peak_bytes == gpu.peak_bytes + cpu.cpu_heap_slack_bytes
    # the slack stops growing with the cache: at N=64 (a 644 MiB cache) 0.46x would be 296 MiB, the cap 192
    n64 = plan(smol, num_generations=64, device="cpu", **sizes).generate
    assert int(CPU_HEAP_SLACK * n64.kv_bytes) > CPU_HEAP_SLACK_MAX == n64.cpu_heap_slack_bytes
    # one layer's K: rows x 233 positions x 3 heads x 64 x 4 bytes; past 32 MiB the allocator maps it
    rows = GLIBC_MMAP_THRESHOLD_MAX // (233 * 3 * 64 * 4) + 1
    big = plan(smol, num_generations=rows, device="cpu", **sizes).generate
    assert big.cpu_heap_slack_bytes == 0
    assert "CPU heap slack" in plan(smol, num_generations=32, device="cpu", **sizes).summary()


def test_the_largest_batch_is_the_one_the_engine_runs_with_and_without_prefix_sharing(tiny):
    """The planner's `batch_tokens` (what its transients scale with) against the batches the CB engine schedules:
    with prefix sharing (the default) each repeated prompt is prefilled alone and its N copies compute only the
    tokens past its last full page; without it every copy prefills its whole prompt in one batch."""
    from cbkit.rollout.base import SamplingParams
    from cbkit.rollout.engine import Engine
    from cbkit.rollout.upstream import watch_batches

    tok = tiny.tokenizer
    prompts = [[65 + i % 20 for i in range(70)], [90 + i % 7 for i in range(45)]]  # 2 and 1 full 32-token pages
    n, new = 3, 4
    sampling = SamplingParams(max_new_tokens=new, eos_token_id=tok.eos_token_id, seed=0)
    for cb_config in ({}, {"allow_block_sharing": False}):
        seen = []
        with watch_batches(lambda requests, pool, page, seen=seen: seen.append(sum(r.query_len for r in requests))):
            Engine(tiny.model, cb_config).run([list(p) for p in prompts for _ in range(n)],
                                              sampling.generation_config(), max_new_tokens=new, seed=0)
        planned = plan(tiny.model.config, num_prompts=2, num_generations=n, prompt_len=[70, 45], max_new_tokens=new,
                       dtype_bytes=4, device="cpu", cb_config=cb_config).continuous
        assert max(seen) == planned.batch_tokens, (cb_config, seen)
    assert planned.batch_tokens == n * (70 + 45)  # no sharing: every copy's whole prompt
