"""The logits budget (micro-batches). Mixed precision (fp32 weights, autocast forwards): tests/test_precision.py."""

from __future__ import annotations

import pytest

from cbkit.train.batch import logits_bytes, micro_batches_for

QWEN_VOCAB = 151_936
GiB = 2**30


def test_logits_of_the_issue_case_are_what_the_issue_says():
    # 128 completions x 256 tokens over Qwen2.5's vocabulary: one fp32 copy is ~19.9 GB (the issue's
    # "about 20 GB"), and the loss holds four of them at once.
    assert logits_bytes(128, 256, QWEN_VOCAB) / 4 == pytest.approx(19.9e9, rel=0.01)


def test_micro_batches_keep_the_logits_under_the_budget():
    # 4 copies x 4 bytes x 256 x 151936 = 0.58 GiB per completion: 2 GiB holds 3 of them, but the micro-batch
    # must divide 128, so 2 rows (64 micro-batches); 8 GiB holds 13, so 8 rows (16 micro-batches).
    assert micro_batches_for(128, 256, QWEN_VOCAB, 2 * GiB) == 64
    assert micro_batches_for(128, 256, QWEN_VOCAB, 8 * GiB) == 16
    assert micro_batches_for(6, 10, 100, 10**9) == 1  # everything fits in one
    k = micro_batches_for(96, 100, 32_000, GiB)  # the fewest: every smaller divisor of 96 is over budget
    assert logits_bytes(96 // k, 100, 32_000) <= GiB
    assert all(logits_bytes(96 // d, 100, 32_000) > GiB for d in range(1, k) if 96 % d == 0)
    with pytest.raises(ValueError, match="shorten max_completion_length or raise the budget"):
        micro_batches_for(8, 4096, QWEN_VOCAB, GiB)
