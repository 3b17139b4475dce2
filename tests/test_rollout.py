"""Both rollout backends on the tiny model: parity, logprob correctness, finish reasons, grouping, bad input."""

from __future__ import annotations

import contextlib

import pytest

from cbkit.rollout import ContinuousBackend, GenerateBackend, Rollout, SamplingParams, make_backend
from cbkit.rollout.base import Completion
from tests.helpers import max_logprob_diff

BACKENDS = ["generate", "continuous"]
# fp32 on CPU: the engines and the teacher-forced forward differ only in summation order (paged vs dense
# attention, padded vs packed batch). Measured max difference on these tests: ~5e-6 (see test output).
LOGPROB_ATOL = 1e-4


def _prompts(tok, questions):
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                return_dict=False)
        for q in questions
    ]


@pytest.fixture(scope="module")
def prompts(tiny):
    # Different lengths on purpose: the static batch must left-pad, the engine must not care.
    return _prompts(tiny.tokenizer, ["hi", "what is 12 + 30?", "Tom has 3 apples and buys 4 more. How many now?"])


def _sampling(tok, **kw):
    base = dict(max_new_tokens=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    return SamplingParams(**{**base, **kw})


def test_greedy_parity(tiny, prompts):
    sp = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=24)
    a = GenerateBackend(tiny.model).generate(prompts, 2, sp)
    b = ContinuousBackend(tiny.model).generate(prompts, 2, sp)
    assert [c.completion_ids for c in a.completions] == [c.completion_ids for c in b.completions]
    assert [c.finish_reason for c in a.completions] == [c.finish_reason for c in b.completions]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_sampling_logprobs_match_teacher_forced(tiny, prompts, backend, knobs, record_property):
    sp = _sampling(tiny.tokenizer, **knobs)
    r = make_backend(backend, tiny.model).generate(prompts, 3, sp)
    diff = max_logprob_diff(tiny.model, r, sp)
    record_property("max_abs_logprob_diff", diff)
    print(f"{backend} {knobs}: max |sampling - teacher-forced| = {diff:.2e}")
    assert diff < LOGPROB_ATOL
    assert all(x <= 0 for c in r.completions for x in c.sampling_logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eos_and_length_finish(tiny, prompts, backend):
    greedy = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=12)
    ref = GenerateBackend(tiny.model).generate(prompts[:1], 1, greedy).completions[0].completion_ids
    # Declare the greedy token at position k the EOS: generation must stop right after it, EOS included.
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    sp = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=12, eos_token_id=ref[k])
    r = make_backend(backend, tiny.model).generate(prompts[:1], 1, sp)
    (c,) = r.completions
    assert c.finish_reason == "eos" and c.completion_ids == ref[: k + 1]
    assert r.completion_tokens == k + 1

    sp_len = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=5, eos_token_id=-1)
    (c,) = make_backend(backend, tiny.model).generate(prompts[:1], 1, sp_len).completions
    assert c.finish_reason == "length" and len(c.completion_ids) == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_stay_in_order(tiny, prompts, backend):
    n = 4
    r = make_backend(backend, tiny.model).generate(prompts, n, _sampling(tiny.tokenizer, temperature=1.5))
    assert r.num_prompts == len(prompts) and len(r.completions) == n * len(prompts)
    for g, group in enumerate(r.groups()):
        assert all(c.group == g and list(c.prompt_ids) == prompts[g] for c in group)
    # Sampling at temperature 1.5 over ~260 tokens: identical completions within a group would mean the
    # copies were not sampled independently (odds of a chance collision over 16 tokens are negligible).
    for group in r.groups():
        assert len({c.completion_ids for c in group}) > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_reports_cost(tiny, prompts, backend):
    r = make_backend(backend, tiny.model).generate(prompts, 2, _sampling(tiny.tokenizer))
    assert r.backend == backend and r.wall_s > 0 and r.tokens_per_s > 0
    assert r.completion_tokens == sum(len(c.completion_ids) for c in r.completions)
    assert r.peak_mem_bytes is not None and r.peak_mem_kind == "cpu_rss"
    if backend == "continuous":
        assert r.engine_config["num_blocks"] >= 1 and "page_size" in r.engine_config


def test_same_seed_same_rollout(tiny, prompts):
    sp = _sampling(tiny.tokenizer, seed=123)
    for backend in BACKENDS:
        a = make_backend(backend, tiny.model).generate(prompts, 2, sp)
        b = make_backend(backend, tiny.model).generate(prompts, 2, sp)
        assert [c.completion_ids for c in a.completions] == [c.completion_ids for c in b.completions]


# --- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_requests(tiny, prompts, backend):
    b = make_backend(backend, tiny.model)
    sp = _sampling(tiny.tokenizer)
    with pytest.raises(ValueError, match="must be >= 1"):
        b.generate(prompts, 0, sp)
    with pytest.raises(ValueError, match="dataset or prompt list is empty"):
        b.generate([], 2, sp)
    long = [1] * 1020
    with pytest.raises(ValueError, match=r"Prompt q-long has 1020 tokens.*context of 1024"):
        b.generate([prompts[0], long], 2, sp, prompt_names=["q-ok", "q-long"])


def test_unknown_cb_key_names_valid_keys(tiny):
    with pytest.raises(ValueError, match=r"Unknown continuous batching config key\(s\) \['max_memory_pct'\].*max_memory_percent"):
        ContinuousBackend(tiny.model, {"max_memory_pct": 0.4})


@pytest.mark.parametrize("value", [0, -0.1, 1.5, "half"])
def test_max_memory_percent_range(tiny, value):
    with pytest.raises(ValueError, match=r"max_memory_percent must be a fraction in \(0, 1\]"):
        ContinuousBackend(tiny.model, {"max_memory_percent": value})


def test_cb_refuses_dropping_logprobs(tiny):
    with pytest.raises(ValueError, match="return_logprobs=False"):
        ContinuousBackend(tiny.model, {"return_logprobs": False})


def test_unknown_backend(tiny):
    with pytest.raises(ValueError, match=r"choose from \['continuous', 'generate'\]"):
        make_backend("vllm", tiny.model)


@pytest.mark.parametrize(
    "kw, msg",
    [(dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=0.0), "temperature"),
     (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k")],
)
def test_bad_sampling_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_rollout_validate_names_the_field():
    c = Completion(group=0, prompt_ids=(1, 2), completion_ids=(3, 4), sampling_logprobs=(-0.1,), finish_reason="eos")
    with pytest.raises(ValueError, match="sampling_logprobs has 1 entries for 2 completion tokens"):
        Rollout([c], 1, "x", 1.0).validate()
    c2 = Completion(group=0, prompt_ids=(1,), completion_ids=(3,), sampling_logprobs=None, finish_reason="eos")
    with pytest.raises(ValueError, match="logprobs_missing_reason"):
        Rollout([c2], 1, "x", 1.0).validate()
    Rollout([c2], 1, "paged-no-logprobs", 1.0, logprobs_missing_reason="engine did not return them").validate()
    with pytest.raises(ValueError, match="group is 1, expected 0"):
        Rollout([Completion(1, (1,), (2,), (-0.1,), "eos")], 1, "x", 1.0).validate()
    with pytest.raises(ValueError, match="do not split into groups"):
        Rollout([c, c, c], 2, "x", 1.0).validate()


def test_cpu_pool_sizing_respects_only_real_choices():
    from cbkit.rollout.engine_config import CPU_PAGE_SIZE, make_cb_config, page_size

    # 3 rows of 5 prompt tokens, limit 40: with 32-token pages each needs ceil(45 / 32) = 2 blocks, + 1 trash block
    assert CPU_PAGE_SIZE == 32
    work = dict(device="cpu", rows=[[1] * 5] * 3, max_new_tokens=40)
    # cbkit's own default max_memory_percent (as a merged config carries it) still gets the workload-sized pool
    assert make_cb_config({"max_memory_percent": 0.5}, **work).num_blocks == 7
    assert make_cb_config({}, **work).num_blocks == 7
    # a page size the user chose is kept, and the pool follows it: ceil(45 / 16) = 3 blocks a row
    cfg = make_cb_config({"page_size": 16}, **work)
    assert (page_size(cfg), cfg.num_blocks) == (16, 10)
    # another fraction is a share of *GPU* memory: on CPU it would be host RAM, so it is ignored, with a warning
    with pytest.warns(UserWarning, match="max_memory_percent=0.3 is a share of free GPU memory"):
        assert make_cb_config({"max_memory_percent": 0.3}, **work).num_blocks == 7
    # explicit blocks are the user's choice; num_blocks=None hands the sizing back to the engine
    assert make_cb_config({"num_blocks": 3}, **work).num_blocks == 3
    cfg = make_cb_config({"max_memory_percent": 0.3, "num_blocks": None}, **work)
    assert cfg.num_blocks is None and cfg.max_memory_percent == 0.3
    # on a GPU the fraction is what it says, and the engine's own page size stays
    cfg = make_cb_config({"max_memory_percent": 0.3}, **{**work, "device": "cuda"})
    assert cfg.num_blocks is None and page_size(cfg) == 256


def test_cpu_varlen_attention_matches_the_engines_dense_path(tiny, prompts):
    """cbkit's per-sequence attention (the CPU default) gives the engine's own results, restores the model."""
    sp = _sampling(tiny.tokenizer, temperature=0.8, top_k=30, max_new_tokens=20)
    from tests.reference_attention import engine_own_attention

    with engine_own_attention():
        dense = ContinuousBackend(tiny.model).generate(prompts, 2, sp)
    varlen = ContinuousBackend(tiny.model).generate(prompts, 2, sp)
    assert varlen.engine_config["attn_implementation"] == "cbkit_flash_varlen"
    assert dense.engine_config["attn_implementation"] == "sdpa"
    assert tiny.model.config._attn_implementation == "sdpa"
    assert [c.completion_ids for c in dense.completions] == [c.completion_ids for c in varlen.completions]
    diff = max(abs(a - b) for x, y in zip(dense.completions, varlen.completions, strict=True)
               for a, b in zip(x.sampling_logprobs, y.sampling_logprobs, strict=True))
    assert diff < 1e-4


def test_the_cpu_pool_warning_comes_once_per_backend(tiny, prompts):
    import warnings

    backend = ContinuousBackend(tiny.model, {"max_memory_percent": 0.3})
    sp = _sampling(tiny.tokenizer, max_new_tokens=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            backend.generate(prompts, 2, sp)
    assert sum("share of free GPU memory" in str(w.message) for w in caught) == 1


# --- per-request target lengths (replayed length workloads) ------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_lengths_are_exact_and_logprobs_still_match(tiny, prompts, backend):
    # Targets differ within and across groups; identical requests for both backends (same targets, same order).
    targets = [3, 11, 1, 7, 16, 9]
    sp = _sampling(tiny.tokenizer, temperature=0.9, top_k=40, max_new_tokens=16)
    r = make_backend(backend, tiny.model).generate(prompts, 2, sp, target_lengths=targets)
    assert [len(c.completion_ids) for c in r.completions] == targets
    assert all(c.finish_reason == "length" for c in r.completions)
    assert r.completion_tokens == sum(targets)
    assert max_logprob_diff(tiny.model, r, sp) < LOGPROB_ATOL
    if backend == "generate":
        assert r.engine_config["steps"] == 16  # the static batch runs to its longest target: that is its cost


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_lengths_ignore_eos(tiny, prompts, backend):
    """Declare a token the greedy continuation produces early the EOS: with a target, generation runs past it
    and gives the same tokens as a run without any EOS, cut at the target."""
    free = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=14, eos_token_id=-1)
    ref = GenerateBackend(tiny.model).generate(prompts[:1], 1, free).completions[0].completion_ids
    eos = ref[2]
    sp = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=14, eos_token_id=eos)
    b = make_backend(backend, tiny.model)
    assert b.generate(prompts[:1], 1, sp).completions[0].finish_reason == "eos"  # EOS does stop a normal run
    (c,) = b.generate(prompts[:1], 1, sp, target_lengths=[12]).completions
    assert c.completion_ids == ref[:12] and eos in c.completion_ids[:-1] and c.finish_reason == "length"


def test_cb_pool_is_sized_by_the_limit_not_the_targets(tiny):
    """A replayed length stands in for an EOS the engine cannot foresee: the pool is the same as without it."""
    from cbkit.rollout.engine_config import workload_blocks

    # page 16: prompt 5 + limit 40 -> 3 blocks a row; plus the trash block
    assert workload_blocks([[1] * 5] * 3, 40, 16) == 3 * 3 + 1
    sp = _sampling(tiny.tokenizer, max_new_tokens=40)
    prompt = [[65] * 5]
    short = ContinuousBackend(tiny.model, {"page_size": 16}).generate(prompt, 3, sp, target_lengths=[3, 3, 3])
    natural = ContinuousBackend(tiny.model, {"page_size": 16}).generate(prompt, 3, sp)
    assert short.engine_config["num_blocks"] == natural.engine_config["num_blocks"] == 3 * 3 + 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("targets", "message"),
    [([4, 4, 4, 4, 4], r"5 entries for 6 completion rows"), ([4, 0, 4, 4, 4, 4], r"target_lengths\[1\] is 0"),
     ([4, 4, 4, 4, 4, 17], r"target_lengths\[5\] is 17.*1..max_new_tokens=16"),
     ([4, 4, 2.5, 4, 4, 4], r"target_lengths\[2\] is 2.5"), ([True] * 6, r"target_lengths\[0\] is True")],
)
def test_bad_target_lengths_fail_before_model_time(tiny, prompts, backend, targets, message, monkeypatch):
    def no_forward(*a, **k):
        raise AssertionError("the model ran before the targets were checked")

    b = make_backend(backend, tiny.model)
    monkeypatch.setattr(tiny.model, "forward", no_forward)
    with pytest.raises(ValueError, match=message):
        b.generate(prompts, 2, _sampling(tiny.tokenizer), target_lengths=targets)


@pytest.mark.real_model
@pytest.mark.parametrize("backend", BACKENDS)
def test_target_lengths_on_smollm2(smollm2, backend):
    """SmolLM2 ends short answers with EOS quickly; with targets both backends run exactly to them, and the
    sampling logprobs still equal the teacher-forced forward's."""
    tok = smollm2.tokenizer
    prompts = _prompts(tok, ["Say hi.", "What is 2 + 2? Answer with one number."])
    targets = [40, 5, 23, 40, 1, 31]
    sp = SamplingParams(max_new_tokens=40, temperature=0.8, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, seed=0)
    r = make_backend(backend, smollm2.model).generate(prompts, 3, sp, target_lengths=targets)
    assert [len(c.completion_ids) for c in r.completions] == targets
    assert all(c.finish_reason == "length" for c in r.completions)
    assert max_logprob_diff(smollm2.model, r, sp) < 1e-3  # fp32 CPU, as tests/test_real_model.py


def test_targets_leave_a_persistent_engine_as_it_was(tiny, prompts):
    """EOS is disabled per request, not in the engine: the next call on a kept engine stops at EOS again."""
    free = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=12, eos_token_id=-1)
    ref = GenerateBackend(tiny.model).generate(prompts[:1], 1, free).completions[0].completion_ids
    sp = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=12, eos_token_id=ref[2])
    b = ContinuousBackend(tiny.model, persistent=True)
    try:
        (c,) = b.generate(prompts[:1], 1, sp, target_lengths=[10]).completions
        assert c.completion_ids == ref[:10]
        (c,) = b.generate(prompts[:1], 1, sp).completions
        assert c.finish_reason == "eos" and c.completion_ids == ref[:3]
    finally:
        b.close()


def test_targets_with_prefix_sharing_stay_with_their_rows(tiny, prompts):
    """With block sharing the engine's submission order is sorted by prompt; results still come back per row."""
    targets = [2, 9, 4, 13, 6, 1]
    r = ContinuousBackend(tiny.model, {"allow_block_sharing": True}).generate(
        prompts, 2, _sampling(tiny.tokenizer), target_lengths=targets)
    assert [len(c.completion_ids) for c in r.completions] == targets
    assert [list(c.prompt_ids) for c in r.completions] == [p for p in prompts for _ in range(2)]


# --- model families cbkit's CPU attention does not cover ----------------------------------------------------


def _family_model(kind: str):
    """A 2-layer random model over the tiny tokenizer's vocabulary, with the feature varlen_attention lacks made
    strong enough to change the tokens: a 4-token window (prompts are ~30 tokens) or soft-capping at 0.5."""
    import torch
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GenerationConfig,
        MistralConfig,
        MistralForCausalLM,
    )

    from cbkit.models.synthetic import TINY_SPECIALS

    eos, pad = 256 + TINY_SPECIALS.index("<|im_end|>"), 256 + TINY_SPECIALS.index("<pad>")
    common = dict(vocab_size=256 + len(TINY_SPECIALS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=256, eos_token_id=eos, pad_token_id=pad)
    if kind == "mistral":
        config, cls = MistralConfig(**common, sliding_window=4), MistralForCausalLM
    else:
        config = Gemma2Config(**common, attn_logit_softcapping=0.5, final_logit_softcapping=None,
                              layer_types=["full_attention"] * 2, query_pre_attn_scalar=16)
        cls = Gemma2ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation="sdpa" if kind == "mistral" else "eager").eval()
    model.generation_config = GenerationConfig(bos_token_id=256, eos_token_id=eos, pad_token_id=pad)
    return model


def test_cb_falls_back_to_the_engines_attention_for_a_sliding_window(tiny, prompts):
    """cbkit's varlen attention has no window: with it, the Mistral-style model's tokens differed from generate()'s
    (its logprobs by up to 6 nats). The engine's own attention has one."""
    from cbkit.rollout.varlen_attention import varlen_unsupported_reason

    assert varlen_unsupported_reason(tiny.model) is None
    model = _family_model("mistral")
    assert "sliding-window" in varlen_unsupported_reason(model)
    sp = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=12)
    reference = GenerateBackend(model, pad_token_id=tiny.tokenizer.pad_token_id).generate(prompts, 1, sp)
    with pytest.warns(UserWarning, match="no sliding-window.*own attention"):
        cb = ContinuousBackend(model).generate(prompts, 1, sp)
    assert cb.engine_config["attn_implementation"] == "sdpa"
    assert [c.completion_ids for c in cb.completions] == [c.completion_ids for c in reference.completions]
    # The logprobs too: a random model's greedy tokens can survive a wrong attention, its logprobs cannot.
    assert max_logprob_diff(model, cb, sp) < LOGPROB_ATOL


def test_cb_refuses_soft_capping_on_cpu_where_no_engine_attention_applies_it(tiny, prompts):
    """Gemma-2-style soft-capping: cbkit's varlen attention and the engine's paged eager both skip it (measured:
    logprobs 0.027 nats off a teacher-forced forward either way), so a CB rollout on CPU is refused; generate()
    applies it and matches the forward."""
    from cbkit.rollout.varlen_attention import varlen_unsupported_reason

    model = _family_model("gemma2")
    assert "soft-capping" in varlen_unsupported_reason(model)
    sp = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=12)
    reference = GenerateBackend(model, pad_token_id=tiny.tokenizer.pad_token_id).generate(prompts, 1, sp)
    assert max_logprob_diff(model, reference, sp) < LOGPROB_ATOL
    from tests.reference_attention import engine_own_attention

    for attention in (contextlib.nullcontext, engine_own_attention):  # cbkit's varlen attention, the engine's own
        with attention(), pytest.raises(ValueError, match="soft-capping.*'generate' backend"):
            ContinuousBackend(model).generate(prompts, 1, sp)


def test_a_shared_prompt_is_prefilled_once(tiny, monkeypatch):
    """N completions of a prompt that fills KV pages reuse its pages (counted by the engine's own prefix match)
    instead of each computing the whole prompt, and give generate()'s greedy tokens."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    matched = []
    search = PagedAttentionCache.search_prefix_match

    def counting(self, request_id, prompt_ids):
        matched.append(search(self, request_id, prompt_ids))
        return matched[-1]

    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", counting)
    prompt = [[65 + i % 23 for i in range(40)]]  # 40 tokens: two complete 16-token pages, 8 left over
    sp = _sampling(tiny.tokenizer, do_sample=False, max_new_tokens=6, eos_token_id=None)
    cb = ContinuousBackend(tiny.model, {"page_size": 16}).generate(prompt, 4, sp)
    # the first prefill finds nothing; each of the 4 completions then finds the 32 tokens of the complete pages
    assert matched == [0, 32, 32, 32, 32]
    ref = GenerateBackend(tiny.model, pad_token_id=0).generate(prompt, 4, sp)
    assert [c.completion_ids for c in cb.completions] == [c.completion_ids for c in ref.completions]


def test_the_cpu_pool_rule_is_what_the_engine_allocates(tiny, prompts):
    """The one CPU pool rule (`workload_blocks`): a CB rollout on a CPU runs on a pool of exactly the blocks that
    hold every request at the generation limit at once, counted from the page size the engine reports; a
    `num_blocks` the caller sets wins, and the rule steps aside."""
    from cbkit.rollout.engine_config import workload_blocks

    rows = [list(p) for p in prompts for _ in range(2)]
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    sized = make_backend("continuous", tiny.model).generate(prompts, 2, sp)
    page = sized.engine_config["page_size"]
    assert sized.engine_config["num_blocks"] == workload_blocks(rows, 6, page)
    assert sized.engine_config["num_blocks"] == sum(-(-(len(r) + 6) // page) for r in rows) + 1  # worked by hand
    fixed = make_backend("continuous", tiny.model, cb_config={"num_blocks": 64}).generate(prompts, 2, sp)
    assert fixed.engine_config["num_blocks"] == 64
