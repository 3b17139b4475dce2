"""cbkit.train.logprobs checks the forward training runs (`cbkit.train.batch`), and that forward scores what a plain one does."""

from __future__ import annotations

import random

import pytest
import torch

from cbkit.models.load import load_policy
from cbkit.rollout import Completion, SamplingParams
from cbkit.train import batch as batch_module
from cbkit.train.logprobs import teacher_forced_logprobs
from cbkit.train.objective import processed_logprobs


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny", seed=0)


def _completions(vocab: int) -> list[Completion]:
    """Uneven prompts and completions, so left padding, right padding and micro-batch trimming all happen."""
    rng = random.Random(3)
    shapes = [(5, 9), (12, 1), (3, 14), (9, 6), (7, 11)]
    return [
        Completion(group=i, prompt_ids=tuple(rng.randrange(vocab) for _ in range(p)),
                   completion_ids=tuple(rng.randrange(vocab) for _ in range(t)),
                   sampling_logprobs=(0.0,) * t, finish_reason="length")
        for i, (p, t) in enumerate(shapes)
    ]


def _right_padded(model, completions, sampling):
    """The forward cbkit.train.logprobs ran before it used the training one: right padding, default positions."""
    seqs = [list(c.prompt_ids) + list(c.completion_ids) for c in completions]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    out = []
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.completion_ids)
        step = logits[i, p - 1 : p - 1 + n]
        tokens = torch.tensor(c.completion_ids)
        if sampling is None:
            out.append(torch.log_softmax(step, -1).gather(-1, tokens[:, None]).squeeze(-1))
        else:
            out.append(processed_logprobs(step, tokens, sampling.temperature, sampling.top_k, sampling.top_p))
    return out


@pytest.mark.parametrize("sampling", [None, SamplingParams(max_new_tokens=16, temperature=0.7, top_k=50, top_p=0.95)])
def test_training_forward_equals_the_old_right_padded_one(tiny, sampling):
    completions = _completions(tiny.model.config.vocab_size)
    new = teacher_forced_logprobs(tiny.model, completions, sampling, batch_size=2)  # micro-batches of 2
    old = _right_padded(tiny.model, completions, sampling)
    assert [len(t) for t in new] == [len(c.completion_ids) for c in completions]
    for a, b in zip(new, old, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # -inf (outside top-k/top-p) must match too


def test_the_check_runs_the_training_forward(tiny, monkeypatch):
    """teacher_forced_logprobs goes through cbkit.train.batch.completion_logits: a change to the training forward
    reaches it."""
    calls = []
    real = batch_module.completion_logits

    def spy(model, b, *autocast):
        calls.append(len(b))
        return real(model, b, *autocast)

    monkeypatch.setattr("cbkit.train.logprobs.completion_logits", spy)
    completions = _completions(tiny.model.config.vocab_size)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    teacher_forced_logprobs(tiny.model, completions, sampling)
    assert calls == [5]
