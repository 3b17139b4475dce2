"""The logits budget (micro-batches) and mixed precision (fp32 master weights, autocast forwards)."""

from __future__ import annotations

import copy

import pytest
import torch

from cbkit.tasks.data import load_problems
from cbkit.teach.notebook import weight_change
from cbkit.train.batch import logits_bytes, micro_batches_for
from cbkit.train.config import CBGRPOConfig
from cbkit.train.grpo import GRPOTrainer

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


def _reward_by_length(completions, answers):
    # A reward with spread inside every group, so the advantages, the loss and the gradient are not zero.
    return [float(len(c) % 7) for c in completions]


def _one_update(policy, dtype: torch.dtype, autocast: str | None) -> dict[str, float]:
    model = copy.deepcopy(policy.model).to(dtype)
    cfg = CBGRPOConfig(model="tiny", system_prompt=None, prompts_per_step=2, num_generations=4,
                       max_completion_length=8, max_steps=1, learning_rate=1e-6, disable_tqdm=True)
    trainer = GRPOTrainer(cfg, policy=(model, policy.tokenizer), problems=load_problems("synthetic", n=4),
                          reward_funcs=[_reward_by_length], autocast_dtype=autocast)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    record = trainer.step()
    assert record.metrics["train/grad_norm"] > 0
    return weight_change(before, model)


def test_fp32_master_weights_keep_a_small_update_that_bf16_weights_lose(tiny):
    """lr 1e-6: AdamW moves each weight by about 1e-6, far below bf16's spacing near the tiny model's weights
    (~1e-4 at 0.02), so bf16 weights barely change, while fp32 weights under a bf16 autocast forward do."""
    master = _one_update(tiny, torch.float32, "bfloat16")
    plain_bf16 = _one_update(tiny, torch.bfloat16, None)
    assert master["changed_share"] > 0.5
    assert plain_bf16["changed_share"] < 0.05
    assert master["relative_change"] > 0


def test_autocast_refuses_bf16_weights_and_unknown_dtypes(tiny):
    cfg = CBGRPOConfig(model="tiny", system_prompt=None, prompts_per_step=2, num_generations=4,
                       max_completion_length=8, max_steps=1, disable_tqdm=True)
    problems = load_problems("synthetic", n=4)
    bf16 = copy.deepcopy(tiny.model).to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs fp32 \\(master\\) weights"):
        GRPOTrainer(cfg, policy=(bf16, tiny.tokenizer), problems=problems, autocast_dtype="bfloat16")
    with pytest.raises(ValueError, match="use 'bfloat16', 'float16' or None"):
        GRPOTrainer(cfg, policy=tiny, problems=problems, autocast_dtype="float64")
