"""The offline SmolLM2-135M-Instruct through both backends on real GSM8K prompts (slow on CPU; run in CI)."""

from __future__ import annotations

import pytest

from cbkit.rollout import SamplingParams, make_backend
from cbkit.tasks.data import chat_prompt_ids, load_gsm8k_jsonl
from tests.helpers import max_logprob_diff

pytestmark = pytest.mark.real_model

# fp32 CPU; measured max |sampling - teacher-forced| on this test ~2e-5 (SmolLM2 logits are larger than the
# tiny model's, so rounding differences between paged/padded and dense attention grow with them).
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def prompts(smollm2, gsm8k_test_path):
    problems = load_gsm8k_jsonl(gsm8k_test_path, limit=3)
    return [chat_prompt_ids(smollm2.tokenizer, p) for p in problems]


def _sp(tok, **kw):
    return SamplingParams(**{"max_new_tokens": 24, "eos_token_id": tok.eos_token_id,
                             "pad_token_id": tok.pad_token_id, "seed": 0, **kw})


def test_greedy_parity_on_gsm8k(smollm2, prompts):
    sp = _sp(smollm2.tokenizer, do_sample=False)
    a = make_backend("generate", smollm2.model).generate(prompts, 1, sp)
    b = make_backend("continuous", smollm2.model).generate(prompts, 1, sp)
    for x, y in zip(a.completions, b.completions, strict=True):
        assert x.completion_ids == y.completion_ids, smollm2.tokenizer.decode(x.completion_ids)


@pytest.mark.parametrize("backend", ["generate", "continuous"])
def test_sampling_logprobs_match_policy(smollm2, prompts, backend):
    sp = _sp(smollm2.tokenizer, temperature=0.8, top_p=0.95)
    r = make_backend(backend, smollm2.model).generate(prompts[:2], 2, sp)
    worst = max_logprob_diff(smollm2.model, r, sp)
    print(f"SmolLM2 {backend}: max |sampling - teacher-forced| logprob {worst:.2e}")
    assert worst < LOGPROB_ATOL
