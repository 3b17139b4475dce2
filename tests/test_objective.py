"""cbkit.train.objective checked against TRL 1.16's own code, plus the invariants a reader can check by hand.

The oracle is TRL itself, not a transcription of it. A tiny real `GRPOTrainer` (random 2-layer Llama, hidden
32, byte-level tokenizer built here) runs its own `_generate_and_score_completions` on a hand-made rollout
(handed in through TRL's `rollout_func`) and rewards (read from a dataset column by the reward function), so
TRL computes the advantages, the teacher-forced logprobs and the IS ratio. Its `_compute_loss` then gives the
loss and the `clip_ratio/*` and `kl` metrics, and we compare values *and* gradients with `grpo_loss` driven
from cbkit's own forward of the same model. RLOO advantages come from a tiny real `RLOOTrainer`.

Two things cannot be reached through `GRPOConfig` on a machine without vLLM, so the tests set the trainer
attributes `_compute_loss` / `_generate_and_score_completions` read (`test_trl_reads_the_attributes_we_set`
pins them): TRL computes the IS ratio only when `use_vllm` is True, and the loss type, beta, epsilons and
scaling are switched per case on one module-scoped trainer to keep the file fast.

Tolerances (fp32 throughout): advantages atol 1e-6; logprobs atol 1e-5 (TRL's chunked LM head sums in a
different order); IS weights rtol 1e-5; loss and gradients atol 1e-6 / 1e-5. Measured maxima are printed by
`pytest -s` via the `worst` fixture.
"""

from __future__ import annotations

import inspect
import math
import warnings
import zlib

import pytest
import torch

from cbkit.train.objective import (
    chunk_share,
    group_advantages,
    grpo_loss,
    importance_weights,
    policy_logprobs,
    processed_logprobs,
    replayed_logprobs,
)

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

PAD, EOS, VOCAB = 0, 1, 258  # byte-level tokenizer below: <pad>, <eos>, then the 256 byte symbols
MAX_LEN = 8  # max_completion_length


# --- the oracle: tiny real TRL trainers ---------------------------------------------------------------------


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def reward_from_column(completions, reward, **kwargs):
    """TRL passes dataset columns to reward functions: the rewards under test ride in a `reward` column."""
    return reward


class TRLOracle:
    def __init__(self, root):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

        self.temperature = 0.7
        common = dict(report_to="none", use_cpu=True, per_device_train_batch_size=8, max_completion_length=MAX_LEN,
                      temperature=self.temperature, seed=0,
                      bf16=False)  # TRL 1.16 defaults to bf16 autocast, even on CPU; compare the math in fp32
        data = Dataset.from_dict({"prompt": ["ab", "cd"], "reward": [0.0, 1.0]})
        self._rollout: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rollout_func is marked experimental; deprecation notices
            self.grpo = GRPOTrainer(
                model=_tiny_llama(0), reward_funcs=reward_from_column, train_dataset=data,
                processing_class=_byte_tokenizer(), rollout_func=lambda prompts, trainer: self._rollout,
                args=GRPOConfig(output_dir=str(root / "grpo"), num_generations=4, **common),
            )
            self.rloo = RLOOTrainer(
                model=_tiny_llama(1), reward_funcs=reward_from_column, train_dataset=data,
                processing_class=_byte_tokenizer(),
                args=RLOOConfig(output_dir=str(root / "rloo"), num_generations=4, beta=0.0, **common),
            )
        self.grpo.current_gradient_accumulation_steps = 1  # set by Trainer's train loop, which we do not run

    def grpo_batch(self, rollout, rewards, n, *, scale_rewards="group", is_mode=None, clip_max=3.0, clip_min=None):
        """TRL's `_generate_and_score_completions` output for a hand-made rollout; IS on iff `is_mode`."""
        tr = self.grpo
        tr.num_generations, tr.scale_rewards, tr.beta = n, scale_rewards, 0.0
        tr.use_vllm = tr.vllm_importance_sampling_correction = is_mode is not None
        tr._last_loaded_step = tr.state.global_step  # nothing to sync: there is no vLLM engine
        tr.vllm_importance_sampling_mode = is_mode
        tr.vllm_importance_sampling_clip_max, tr.vllm_importance_sampling_clip_min = clip_max, clip_min
        self._rollout = {"prompt_ids": rollout["prompts"], "completion_ids": rollout["completions"],
                         "logprobs": rollout.get("sampling")}
        return tr._generate_and_score_completions([{"prompt": "x", "reward": float(r)} for r in rewards])

    def rloo_advantages(self, rewards, n, normalize):
        tr = self.rloo
        tr.num_generations, tr.normalize_advantages = n, normalize
        b = len(rewards)
        tr._generate = lambda prompts: ([[5, 6]] * b, [[7, EOS]] * b, ["x"] * b)
        return tr._generate_and_score_completions([{"prompt": "x", "reward": float(r)} for r in rewards])["advantages"]


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
    # A 32-wide model is all thread overhead: intra-op threads make each op ~500x slower on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield TRLOracle(tmp_path_factory.mktemp("trl"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def worst():
    """Largest difference seen per quantity; printed at the end of the module (`pytest -s` to see it)."""
    seen: dict[str, float] = {}
    yield seen
    print("\nmax |cbkit - TRL|:", {k: f"{v:.2e}" for k, v in sorted(seen.items())})


def _close(worst, name, got, want, atol, rtol=0.0):
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    finite = torch.isfinite(want)
    if finite.any():
        worst[name] = max(worst.get(name, 0.0), (got - want)[finite].abs().max().item())
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def make_rollout(num_prompts, n, seed):
    """Prompts of 2-4 tokens, completions of 1-8 tokens (half ending in EOS): both paddings are exercised."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(num_prompts):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            c = torch.randint(2, VOCAB, (int(torch.randint(1, MAX_LEN + 1, (1,), generator=g)),), generator=g).tolist()
            if torch.rand(1, generator=g) < 0.5:
                c[-1] = EOS
            prompts.append(prompt)
            completions.append(c)
    return {"prompts": prompts, "completions": completions}


def padded(rollout):
    """The batch layout TRL builds: prompts left-padded, completions right-padded."""
    p_len = max(map(len, rollout["prompts"]))
    t_len = max(map(len, rollout["completions"]))
    prompt_ids = torch.tensor([[PAD] * (p_len - len(p)) + p for p in rollout["prompts"]])
    prompt_mask = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in rollout["prompts"]])
    completion_ids = torch.tensor([c + [PAD] * (t_len - len(c)) for c in rollout["completions"]])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (t_len - len(c)) for c in rollout["completions"]])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def cbkit_policy_logps(model, rollout, temperature):
    """cbkit's teacher-forced logprobs: one plain forward (logits), then `policy_logprobs`."""
    prompt_ids, prompt_mask, completion_ids, _ = padded(rollout)
    logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                   attention_mask=torch.cat([prompt_mask, (completion_ids != PAD).long()], 1)).logits
    p, t = prompt_ids.size(1), completion_ids.size(1)
    return policy_logprobs(logits[:, p - 1 : p + t - 1], completion_ids, temperature)


def with_sampling_logps(trl, rollout, seed, noise=0.4):
    """Add engine-like sampling logprobs: the policy's, perturbed, with one token the engine could not score."""
    with torch.no_grad():
        pol = cbkit_policy_logps(trl.grpo.model, rollout, trl.temperature)
    g = torch.Generator().manual_seed(seed)
    sampling = [(pol[i, : len(c)] + noise * torch.randn(len(c), generator=g)).tolist()
                for i, c in enumerate(rollout["completions"])]
    sampling[1][0] = None  # vLLM's convention for an unscorable token; TRL maps it to NaN
    return {**rollout, "sampling": sampling}


# --- contract: what TRL reads -------------------------------------------------------------------------------


def test_trl_reads_the_attributes_we_set(trl):
    """If a TRL upgrade renames these, the oracle tests below would silently test defaults: fail loudly."""
    from trl import GRPOTrainer, RLOOTrainer

    loss_src = inspect.getsource(GRPOTrainer._compute_loss)
    gen_src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for attr in ("loss_type", "beta", "epsilon_low", "epsilon_high", "max_completion_length", "use_vllm",
                 "vllm_importance_sampling_correction", "current_gradient_accumulation_steps"):
        assert f"self.{attr}" in loss_src, attr
    for attr in ("num_generations", "scale_rewards", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
        assert f"self.{attr}" in gen_src, attr
    assert 'inputs["importance_sampling_ratio"]' in loss_src and "use_bias_correction_kl" in loss_src
    assert "self.normalize_advantages" in inspect.getsource(RLOOTrainer._generate_and_score_completions)
    assert trl.grpo.args.use_bias_correction_kl is True  # cbkit's kl_bias_correction default follows it


# --- advantages ---------------------------------------------------------------------------------------------


def _rewards(kind, b, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "binary":  # correctness rewards: some groups all-equal, the zero-std case
        return torch.randint(0, 2, (b,), generator=g).float()
    return torch.randn(b, generator=g) * 2 + 1


@pytest.mark.parametrize("kind", ["normal", "binary"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_grpo_advantages_match_trl(trl, worst, n, scale, kind):
    """TRL `GRPOTrainer._generate_and_score_completions` (sum_then_normalize). atol 1e-6, fp32."""
    rewards = _rewards(kind, 3 * n, seed=n)
    want = trl.grpo_batch(make_rollout(3, n, seed=n), rewards, n, scale_rewards=scale)["advantages"]
    _close(worst, "advantages/grpo", group_advantages(rewards, n, scale, "grpo"), want, atol=1e-6)


@pytest.mark.parametrize("kind", ["normal", "binary"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_rloo_advantages_match_trl(trl, worst, n, normalize, kind):
    """TRL `RLOOTrainer._generate_and_score_completions`, beta=0. atol 1e-6, fp32."""
    rewards = _rewards(kind, 3 * n, seed=10 + n)
    want = trl.rloo_advantages(rewards, n, normalize)
    got = group_advantages(rewards, n, "batch" if normalize else "none", "rloo")
    _close(worst, "advantages/rloo", got, want, atol=1e-6)


def test_grpo_advantages_by_hand():
    """[0, 1] in a group of 2: mean 0.5, unbiased std 1/sqrt(2) (TRL's nanstd), so A = -+0.5 / (0.7071 + 1e-4)."""
    a = group_advantages(torch.tensor([0.0, 1.0, 3.0, 3.0]), 2, "group", "grpo")
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(a, torch.tensor([-expected, expected, 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(torch.tensor([0.0, 1.0, 3.0, 3.0]), 2, "none"),
                               torch.tensor([-0.5, 0.5, 0.0, 0.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_sum_to_zero_per_group(scale):
    a = group_advantages(torch.randn(24), 6, scale, "grpo").view(4, 6)
    torch.testing.assert_close(a.sum(1), torch.zeros(4), atol=1e-5, rtol=0)


def test_rloo_baseline_excludes_self():
    """A_i = r_i - mean of the others; so changing r_i moves A_i by exactly the change, nothing else of i's."""
    r = torch.randn(12)
    a = group_advantages(r, 4, "none", "rloo")
    for i in range(12):
        g = i // 4
        others = [r[j] for j in range(4 * g, 4 * g + 4) if j != i]
        torch.testing.assert_close(a[i], r[i] - torch.stack(others).mean())
    torch.testing.assert_close(a, 4 / 3 * group_advantages(r, 4, "none", "grpo"))  # = N/(N-1) (r - mean)


def test_advantage_errors_say_what_to_change():
    with pytest.raises(ValueError, match=r"10 rewards .* num_generations=4"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match=r"rewards\[5\] is nan \(prompt 1, completion 1\)"):
        group_advantages(torch.tensor([0.0, 1, 2, 3, 4, float("nan"), 6, 7]), 4)
    with pytest.raises(ValueError, match=r"rewards\[0\] is inf"):
        group_advantages(torch.tensor([float("inf"), 1.0]), 2)


# --- logprobs -----------------------------------------------------------------------------------------------


def test_policy_logprobs_match_trl(trl, worst):
    """TRL's fused LM head (temperature only) and `selective_log_softmax`, on completion tokens. atol 1e-5."""
    from trl.trainer.utils import selective_log_softmax

    rollout = with_sampling_logps(trl, make_rollout(3, 4, seed=3), seed=3)
    out = trl.grpo_batch(rollout, torch.randn(12), 4, is_mode="token_truncate")
    _, _, completion_ids, completion_mask = padded(rollout)
    assert torch.equal(out["completion_ids"], completion_ids) and torch.equal(out["completion_mask"], completion_mask)
    with torch.no_grad():
        got = cbkit_policy_logps(trl.grpo.model, rollout, trl.temperature)
    m = completion_mask.bool()
    _close(worst, "logprobs/fused_head", got[m], out["old_per_token_logps"][m], atol=1e-5)
    logits = torch.randn(4, 6, 50)
    tokens = torch.randint(0, 50, (4, 6))
    _close(worst, "logprobs/selective_log_softmax", policy_logprobs(logits, tokens, 0.7),
           selective_log_softmax(logits, tokens, temperature=0.7), atol=1e-6)


def _all_token_logprobs(logits, **kw):
    """processed_logprobs of every vocab token, [B, V], by asking for each token id."""
    b, v = logits.shape
    return processed_logprobs(logits[:, None].expand(b, v, v), torch.arange(v).expand(b, v), **kw)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.9), (0.6, 10, 0.8), (1.3, 3, 0.5)])
def test_processed_logprobs_match_transformers_warpers(trl, worst, temperature, top_k, top_p):
    """The list `generate` builds (`_get_logits_processor`) and CB's per-request versions. atol 1e-6, -inf equal."""
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList,
    )

    processors = trl.grpo.model._get_logits_processor(
        GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p))
    expected_types = [name for name, on in (("TemperatureLogitsWarper", temperature != 1.0),
                                            ("TopKLogitsWarper", top_k), ("TopPLogitsWarper", top_p < 1)) if on]
    assert [type(p).__name__ for p in processors] == expected_types  # the order cbkit applies them in
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(top_k)) * 3
    got = _all_token_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    _close(worst, "logprobs/warpers", got, processors(None, logits.clone()).log_softmax(-1), atol=1e-6)

    cb = ContinuousBatchingLogitsProcessorList(LogitsProcessorList(processors), per_request_processors=True)
    args = torch.zeros(max(cb.tensors_required, 1), 16, dtype=torch.int32)
    cb.fill_defaults(args)
    _close(worst, "logprobs/cb_warpers", got, cb(None, logits.clone(), args).log_softmax(-1), atol=1e-6)


def test_processed_logprobs_invariants():
    logits = torch.randn(3, 7, 40)
    tokens = torch.randint(0, 40, (3, 7))
    plain = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(processed_logprobs(logits, tokens, 1.0), plain)
    greedy = processed_logprobs(logits, logits.argmax(-1), 0.5, top_k=1)
    assert torch.equal(greedy, torch.zeros_like(greedy))
    others = _all_token_logprobs(logits[0], temperature=1.0, top_k=1)
    assert torch.isinf(others).sum() == 7 * 39  # every non-argmax token is filtered
    tiny_p = _all_token_logprobs(logits[0], temperature=1.0, top_p=1e-6)
    assert (torch.isfinite(tiny_p).sum(-1) == 1).all()  # top-p always keeps the most likely token
    # Uniform over 4 (probabilities exact in fp32), top_p=0.75: the least likely 0.25 of mass goes, 3 tokens stay.
    boundary = _all_token_logprobs(torch.zeros(1, 4), temperature=1.0, top_p=0.75)
    assert torch.isfinite(boundary).sum() == 3
    assert processed_logprobs(torch.randn(5, 40, dtype=torch.bfloat16), tokens[0, :5], 1.0).dtype == torch.float32


def test_replayed_logprobs_keep_a_sampled_token_inside_its_support():
    """Worked by hand: p = (0.5, 0.3, 0.15, 0.05), top_p = 0.75. The trainer's nucleus is {0, 1} (0.05 + 0.15 of mass
    dropped <= 0.25), so token 2, which a sampler with other rounding kept, gets -inf from `processed_logprobs`.
    Replayed, its support is {0, 1, 2}: log(0.15 / 0.95). Token 0 keeps its nucleus {0, 1}: log(0.5 / 0.8)."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2, 4)
    tokens = torch.tensor([0, 2])
    assert processed_logprobs(logits, tokens, 1.0, top_p=0.75)[1] == -math.inf
    logps, outside = replayed_logprobs(logits, tokens, 1.0, top_p=0.75)
    torch.testing.assert_close(logps, torch.tensor([math.log(0.5 / 0.8), math.log(0.15 / 0.95)]))
    assert outside.tolist() == [False, True]
    # Without truncation nothing is ever outside, and the values are the plain ones.
    plain, none = replayed_logprobs(logits * 2, tokens, 2.0)
    torch.testing.assert_close(plain, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))
    assert not none.any()


# --- importance-sampling correction -------------------------------------------------------------------------


@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0)])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_match_trl(trl, worst, mode, clip_min, clip_max):
    """TRL's IS ratio and its `sampling/*` metrics, with one NaN (unscorable) sampling logprob. rtol 1e-5."""
    rollout = with_sampling_logps(trl, make_rollout(3, 4, seed=7), seed=7, noise=0.8)
    out = trl.grpo_batch(rollout, torch.randn(12), 4, is_mode=mode, clip_max=clip_max, clip_min=clip_min)
    w, metrics = importance_weights(out["old_per_token_logps"], out["sampling_per_token_logps"],
                                    out["completion_mask"], mode, clip_max=clip_max, clip_min=clip_min)
    want = out["importance_sampling_ratio"].expand_as(w)
    _close(worst, "is/weights", w, want, atol=1e-7, rtol=1e-5)
    trl_metrics = {k: v[-1] for k, v in trl.grpo._metrics["train"].items()}
    for ours, theirs in [("is/ratio_mean", "sampling/importance_sampling_ratio/mean"),
                         ("is/ratio_min", "sampling/importance_sampling_ratio/min"),
                         ("is/ratio_max", "sampling/importance_sampling_ratio/max"),
                         ("logprob/mean_abs_diff", "sampling/sampling_logp_difference/mean"),
                         ("logprob/max_abs_diff", "sampling/sampling_logp_difference/max")]:
        _close(worst, "is/metrics", metrics[ours], trl_metrics[theirs], atol=1e-6, rtol=1e-5)
    assert metrics["is/skipped"] == 0.0
    assert 0.0 < metrics["is/clipped_frac"] < 1.0  # the case really exercises the bounds


def test_importance_weights_skipped_without_sampling_logprobs():
    """Released TRL on transformers CB: no sampling logprobs, so no correction. Weights are exactly 1."""
    w, metrics = importance_weights(torch.randn(4, 5), None, torch.ones(4, 5), "token_truncate")
    assert torch.equal(w, torch.ones(4, 5))
    assert metrics["is/skipped"] == 1.0 and metrics["is/clipped_frac"] == 0.0


def test_token_mask_zeroes_exactly_the_tokens_outside_the_bounds():
    old = torch.randn(6, 9)
    sampled = old + torch.randn(6, 9)
    mask = torch.rand(6, 9) < 0.8
    w, metrics = importance_weights(old, sampled, mask, "token_mask", clip_max=2.0, clip_min=0.5)
    ratio = torch.exp((old - sampled) * mask)
    outside = (ratio < 0.5) | (ratio > 2.0)
    assert torch.equal(w == 0, outside) and torch.equal(w[~outside], ratio[~outside])
    assert metrics["is/clipped_frac"] == pytest.approx(outside[mask].float().mean().item())
    w, _ = importance_weights(old, sampled, mask, "token_truncate", clip_max=2.0, clip_min=0.5)
    assert w.min() >= 0.5 and w.max() <= 2.0


def test_sequence_modes_use_one_weight_per_sequence():
    """rho_seq = exp(sum over completion tokens of (old - sampling)): a sum, not a mean."""
    old, sampled = torch.randn(5, 6) * 0.1, torch.randn(5, 6) * 0.1
    mask = torch.ones(5, 6)
    mask[0, 3:] = 0
    w, _ = importance_weights(old, sampled, mask, "sequence_truncate", clip_max=None)
    torch.testing.assert_close(w[:, 0], torch.exp(((old - sampled) * mask).sum(-1)))
    assert torch.equal(w, w[:, :1].expand_as(w))


# --- the loss -----------------------------------------------------------------------------------------------


def _trl_and_cbkit_loss(trl, loss_type, beta, is_mode, epsilon_high, seed, accumulation=1):
    """Run TRL's `_compute_loss` and cbkit's `grpo_loss` on the same batch; return both losses, grads, metrics."""
    tr, model = trl.grpo, trl.grpo.model
    rollout = with_sampling_logps(trl, make_rollout(3, 4, seed=seed), seed=seed)
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(seed))
    out = trl.grpo_batch(rollout, rewards, 4, is_mode=is_mode)
    mask = out["completion_mask"]
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # "old" = the policy some updates ago, so the clip bites; ref further away still
        pol = cbkit_policy_logps(model, rollout, trl.temperature)
        old = pol + 0.3 * torch.randn(pol.shape, generator=g)
        ref = pol + 0.5 * torch.randn(pol.shape, generator=g)
    is_weights = None
    if is_mode is not None:
        is_weights, _ = importance_weights(out["old_per_token_logps"], out["sampling_per_token_logps"], mask, is_mode)
    inputs = {**out, "old_per_token_logps": old, "ref_per_token_logps": ref}

    tr.loss_type, tr.beta = loss_type, beta
    tr.epsilon_low, tr.epsilon_high = 0.2, 0.2 if epsilon_high is None else epsilon_high
    tr.current_gradient_accumulation_steps = tr.args.steps_per_generation = accumulation
    try:
        model.zero_grad(set_to_none=True)
        trl_loss = tr._compute_loss(model, inputs)
        trl_loss.backward()
        trl_grads = [p.grad.clone() for p in model.parameters()]
        trl_metrics = {k: v[-1] for k, v in tr._metrics["train"].items()}
    finally:
        tr.beta, tr.current_gradient_accumulation_steps, tr.args.steps_per_generation = 0.0, 1, 1

    model.zero_grad(set_to_none=True)
    loss, metrics = grpo_loss(
        cbkit_policy_logps(model, rollout, trl.temperature), old, out["advantages"], mask, loss_type=loss_type,
        epsilon=0.2, epsilon_high=epsilon_high, beta=beta, ref_logps=ref, is_weights=is_weights,
        max_completion_length=MAX_LEN, num_items_in_batch=out["num_items_in_batch"],
        gradient_accumulation_steps=accumulation,
    )
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return (loss, trl_loss), (grads, trl_grads), (metrics, trl_metrics)


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("is_mode", [None, "token_truncate", "sequence_mask"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_matches_trl(trl, worst, loss_type, beta, is_mode, epsilon_high):
    """TRL `GRPOTrainer._compute_loss`: loss atol 1e-6, every parameter's gradient atol 1e-5, metrics atol 1e-6."""
    (loss, trl_loss), (grads, trl_grads), (metrics, trl_metrics) = _trl_and_cbkit_loss(
        trl, loss_type, beta, is_mode, epsilon_high, seed=zlib.crc32(repr((loss_type, beta, is_mode, epsilon_high)).encode()) % 1000)
    _close(worst, "loss", loss.detach(), trl_loss.detach(), atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, trl_grads, strict=True):
        _close(worst, "loss/grad", got, want, atol=1e-5, rtol=1e-4)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (("kl",) if beta else ()):
        _close(worst, "loss/metrics", metrics[f"train/{name}"], trl_metrics[name], atol=1e-6)
    assert metrics["train/clip_ratio/region_mean"] > 0  # the clip really bites in this batch


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_with_gradient_accumulation_matches_trl(trl, worst, loss_type):
    """2 accumulation steps (= steps_per_generation): TRL divides grpo/bnpo/dr_grpo by 2; dapo by its count."""
    (loss, trl_loss), _, _ = _trl_and_cbkit_loss(trl, loss_type, 0.0, None, None, seed=99, accumulation=2)
    _close(worst, "loss", loss.detach(), trl_loss.detach(), atol=1e-6, rtol=1e-5)


def test_loss_by_hand_and_errors():
    """On-policy (old = policy), no IS, no KL: every ratio is 1, so the loss is -mean advantage per aggregation."""
    pol = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    grpo, _ = grpo_loss(pol, pol, adv, mask, loss_type="grpo")
    bnpo, _ = grpo_loss(pol, pol, adv, mask, loss_type="bnpo")
    dr, _ = grpo_loss(pol, pol, adv, mask, loss_type="dr_grpo", max_completion_length=4)
    assert grpo.item() == pytest.approx(-(1 - 2) / 2)
    assert bnpo.item() == pytest.approx(-(3 - 2) / 4)
    assert dr.item() == pytest.approx(-(3 - 2) / (2 * 4))
    dapo, _ = grpo_loss(pol, pol, adv, mask, loss_type="dapo")  # one process, no accumulation: this batch's tokens
    assert dapo.item() == pytest.approx(bnpo.item())
    with pytest.raises(ValueError, match="num_items_in_batch"):
        grpo_loss(pol, pol, adv, mask, loss_type="dapo", gradient_accumulation_steps=2)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_chunks_scaled_by_their_share_add_up_to_the_micro_batch(loss_type, beta):
    """A micro-batch scored a chunk of rows at a time (the loop's `forward_chunk_rows`): the chunks' losses times
    `chunk_share` add up to the whole micro-batch's loss, their gradients to its gradient, and their token-share
    metrics to its metrics. Chunks of 3, 3, 1 rows of a 7-row batch with uneven lengths, two rows with no token
    in the loss (masked truncated completions) and a chunk made only of one of them."""
    g = torch.Generator().manual_seed(7)
    b, t, ga = 7, 6, 2
    lengths = torch.tensor([6, 0, 2, 5, 1, 3, 0])
    mask = torch.arange(t)[None] < lengths[:, None]
    pol = torch.randn(b, t, generator=g, dtype=torch.float64)
    old = pol + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = pol + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    is_w = 0.5 + torch.rand(b, t, generator=g, dtype=torch.float64)
    # dapo's count spans the whole optimizer step: here, pretend the other micro-batch held 9 tokens.
    kw = dict(loss_type=loss_type, beta=beta, ref_logps=ref, is_weights=is_w, max_completion_length=8,
              num_items_in_batch=mask.sum() + 9, gradient_accumulation_steps=ga, epsilon=0.2)

    whole_pol = pol.clone().requires_grad_(True)
    whole, whole_metrics = grpo_loss(whole_pol, old, adv, mask, **kw)
    whole.backward()

    chunk_pol = pol.clone().requires_grad_(True)
    total, metrics = torch.zeros((), dtype=torch.float64), {}
    for rows in (slice(0, 3), slice(3, 6), slice(6, 7)):
        k = {**kw, "ref_logps": ref[rows], "is_weights": is_w[rows]}
        loss, m = grpo_loss(chunk_pol[rows], old[rows], adv[rows], mask[rows], **k)
        loss_share, token_share = chunk_share(loss_type, mask[rows], mask)
        (loss * loss_share).backward()
        total += loss.detach() * loss_share
        for key, v in m.items():
            metrics[key] = metrics.get(key, 0.0) + v * token_share
    assert whole.item() != 0.0 and whole_metrics["train/clip_ratio/region_mean"] > 0
    torch.testing.assert_close(total, whole.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(chunk_pol.grad, whole_pol.grad, atol=1e-12, rtol=1e-10)
    assert metrics.keys() == whole_metrics.keys()
    for key, v in whole_metrics.items():
        assert metrics[key] == pytest.approx(v, abs=1e-12), key


def test_chunk_share_by_hand():
    """Rows 0-1 of a 4-row micro-batch holding 2 of its 8 loss tokens."""
    micro = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 1, 1]]).bool()
    assert chunk_share("grpo", micro[:2], micro) == (0.5, 0.25)
    assert chunk_share("dr_grpo", micro[:2], micro) == (0.5, 0.25)
    assert chunk_share("bnpo", micro[:2], micro) == (0.25, 0.25)
    assert chunk_share("dapo", micro[:2], micro) == (1.0, 0.25)
    assert chunk_share("bnpo", micro[1:2], micro) == (1 / 8, 0.0)  # no tokens: grpo_loss of the chunk is 0 anyway
