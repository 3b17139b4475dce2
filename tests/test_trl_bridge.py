"""The TRL bridge: stock TRL 1.16 loses the CB sampling logprobs, the bridge keeps them and TRL's IS runs.

Everything runs on the tiny random Llama from `cbkit.models.load` (byte tokenizer, ChatML template) in fp32 on
CPU, with real `GRPOTrainer` objects and real CB engine calls.

Tolerances (fp32): the engine's logprob of a sampled token is log(softmax(processed logits))[token], the
teacher-forced one log_softmax of a dense forward's logits; they differ only in summation order (paged vs
dense attention). Measured max |difference| here ~5e-6; asserted < 1e-4, like tests/test_rollout.py.
The IS ratio on unchanged weights is exp(sum of up to 12 such differences): asserted within 1e-3 of 1.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pickle
import re
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import ContinuousBatchingConfig, TrainerCallback
from trl import GRPOTrainer

from cbkit.models.load import load_policy
from cbkit.rollout.engine import Engine
from cbkit.tasks.rewards import correctness_reward, format_reward
from cbkit.train.config import CBGRPOConfig
from cbkit.train.objective import processed_logprobs
from cbkit.trl.config import CBKIT_FIELDS, LOOP_ONLY, TRLReward, trl_dataset, trl_grpo_config, trl_rewards
from cbkit.trl.trainers import CBLogprobGRPOTrainer, build_trainer, is_metrics
from tests.helpers import cb_forward_returns_its_cache

pytestmark = [
    # transformers 5.24 renames gradient checkpointing; TRL 1.16 still uses the old names.
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_disable` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
]

LOGPROB_ATOL = 1e-4
N = 4  # num_generations
MAX_LEN = 12  # max_completion_length
IS_METRICS = {
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
}
QUESTIONS = ["What is 2 + 3?", "Tom has 4 apples and eats one. How many are left?"]
ANSWERS = ["5", "3"]
# cbkit-named fields of a small run: one generation batch of 2 prompts x N.
RUN = dict(num_generations=N, max_completion_length=MAX_LEN, prompts_per_step=2, max_steps=1, seed=0)
TRL_ONLY = dict(logging_steps=1, save_strategy="no", report_to="none")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A 64-wide model is all thread overhead: more intra-op threads only make each op slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS], "answer": ANSWERS})


class Logs(TrainerCallback):
    """Every dict the trainer logs."""

    def __init__(self):
        self.records: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.records.append(dict(logs or {}))

    @property
    def train_step(self) -> dict:
        return next(r for r in self.records if "loss" in r)


def distinct_chars_reward(completions: list[str], answers: list[str]) -> list[float]:
    """A cbkit-style reward that differs between samples, so advantages (and gradients) are not all zero."""
    return [len(set(c)) / 10 for c in completions]


def _policy():
    return load_policy("tiny", seed=0)  # fresh weights per trainer: training changes them


def _bridge(tmp_path, dataset, callbacks=None, rewards=None, trl_overrides=None, **run):
    model, tok = _policy()
    return build_trainer(
        model, tok, rewards or {"correctness": correctness_reward, "format": format_reward}, dataset,
        {**RUN, **run}, output_dir=str(tmp_path / "bridge"), callbacks=callbacks, **TRL_ONLY, **(trl_overrides or {}),
    )


def _stock(tmp_path, dataset, callbacks=None, trl_overrides=None, **run):
    """Stock TRL on the CB path, with the bridge's config: even asked for logprobs, it drops them."""
    model, tok = _policy()
    # Stock TRL sizes the KV pool as a share of host RAM on CPU; give it a small pool explicitly.
    args = trl_grpo_config({**RUN, **run, "transformers_continuous_batching_config": {"num_blocks": 64}},
                           str(tmp_path / "stock"), **TRL_ONLY, **(trl_overrides or {}))
    return GRPOTrainer(model=model, reward_funcs=[TRLReward(format_reward)], args=args, train_dataset=dataset,
                       processing_class=tok, callbacks=callbacks)


def _batch():
    """What TRL's RepeatSampler hands `_generate_and_score_completions`: each row N times in a row."""
    return [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in zip(QUESTIONS, ANSWERS, strict=True)
            for _ in range(N)]


def _prompt_ids(tok):
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS for _ in range(N)]


def _teacher_forced(model, prompt, completion, temperature, top_k=0, top_p=1.0):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return processed_logprobs(logits, torch.tensor(completion), temperature, top_k, top_p)


# --- the gap: stock TRL ---------------------------------------------------------------------------------------


def test_stock_trl_cb_path_yields_no_sampling_logprobs(tmp_path, dataset):
    logs = Logs()
    tr = _stock(tmp_path, dataset, callbacks=[logs])
    assert tr.args.vllm_importance_sampling_correction is True  # asked for, yet it never runs on this path
    assert tr.continuous_batching_config.return_logprobs is True  # the engine computes them; TRL discards them
    _, logprobs = tr._generate_single_turn(_prompt_ids(tr.processing_class), None, {}, N)
    assert logprobs is None
    tr.model.train()
    out = tr._generate_and_score_completions(_batch())
    assert "sampling_per_token_logps" not in out and "importance_sampling_ratio" not in out
    tr.train()
    assert not is_metrics(logs.train_step), logs.train_step


# --- the bridge -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_bridge_logprobs_match_teacher_forced(tmp_path, dataset, knobs):
    """Right shape, and equal to a dense forward under the same processed distribution (atol 1e-4, fp32).

    With temperature 0.7 + top-k + top-p they are far from the raw distribution's: the sampling parameters
    reached the engine (TRL issue #5783).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # top-p/top-k IS bias warning, tested below
        tr = _bridge(tmp_path, dataset, **knobs)
    prompts = _prompt_ids(tr.processing_class)
    completions, logprobs = tr._generate_single_turn(prompts, None, {}, N)
    assert len(completions) == len(logprobs) == len(prompts)
    assert [len(c) for c in completions] == [len(lp) for lp in logprobs]
    eos = tr.processing_class.eos_token_id
    assert all(len(c) == MAX_LEN or c[-1] == eos for c in completions)
    model = tr.model.eval()
    diff = raw_diff = 0.0
    for p, c, lp in zip(prompts, completions, logprobs, strict=True):
        ref = _teacher_forced(model, p, c, knobs["temperature"], knobs.get("top_k", 0), knobs.get("top_p", 1.0))
        diff = max(diff, (torch.tensor(lp) - ref).abs().max().item())
        raw_diff = max(raw_diff, (torch.tensor(lp) - _teacher_forced(model, p, c, 1.0)).abs().max().item())
    print(f"{knobs}: max |CB sampling - teacher-forced| = {diff:.2e}")
    assert diff < LOGPROB_ATOL
    if knobs["temperature"] != 1.0:
        assert raw_diff > 0.1


def test_the_models_generation_config_does_not_reach_the_bridges_sampler(tmp_path, dataset):
    """A checkpoint's generation advice (repetition penalty, n-gram bans, min_p, ...) on the model: the bridge samples
    from TRL's config alone, so its logprobs still match a teacher-forced forward at temperature 1."""
    model, tok = _policy()
    advice = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 1, "typical_p": 0.5, "min_p": 0.2, "top_k": 5,
              "top_p": 0.5, "temperature": 0.5, "bad_words_ids": [[71]], "suppress_tokens": list(range(60, 120)),
              "sequence_bias": {(71,): 5.0}, "min_new_tokens": 6, "exponential_decay_length_penalty": (1, 3.0)}
    for k, v in advice.items():
        setattr(model.generation_config, k, v)
    tr = build_trainer(model, tok, [format_reward], dataset, dict(RUN, temperature=1.0),
                       output_dir=str(tmp_path), **TRL_ONLY)
    prompts = _prompt_ids(tok)
    completions, logprobs = tr._generate_single_turn(prompts, None, {}, N)
    model = tr.model.eval()
    diff = max((torch.tensor(lp) - _teacher_forced(model, p, c, 1.0)).abs().max().item()
               for p, c, lp in zip(prompts, completions, logprobs, strict=True))
    assert diff < LOGPROB_ATOL


def test_bridge_scoring_hands_logprobs_to_trl_is(tmp_path, dataset, monkeypatch):
    """`_generate_and_score_completions` returns TRL's IS ratio; the gate is shut during generation."""
    seen = {}
    original = GRPOTrainer._generate

    def spy(self, prompts):
        seen["use_vllm during _generate"] = self.use_vllm
        return original(self, prompts)

    monkeypatch.setattr(GRPOTrainer, "_generate", spy)
    tr = _bridge(tmp_path, dataset)
    assert isinstance(tr, CBLogprobGRPOTrainer)
    tr.model.train()
    out = tr._generate_and_score_completions(_batch())
    assert seen == {"use_vllm during _generate": False}
    assert tr.use_vllm is False  # shut again on the way out
    sampling, old, mask = out["sampling_per_token_logps"], out["old_per_token_logps"], out["completion_mask"].bool()
    assert sampling.shape == out["completion_ids"].shape == old.shape
    # TRL's own teacher-forced forward (temperature only; top_p=1, top_k=0 here, so the same distribution).
    diff = (sampling - old)[mask].abs().max().item()
    print(f"max |CB sampling - TRL old logps| = {diff:.2e}")
    assert diff < LOGPROB_ATOL
    torch.testing.assert_close(out["importance_sampling_ratio"], torch.ones_like(out["importance_sampling_ratio"]),
                               atol=1e-3, rtol=0)


def test_bridge_train_step_logs_trl_is_metrics(tmp_path, dataset, monkeypatch):
    """One `trainer.train()` step: TRL's loss sees the ratio, and its `sampling/*` metrics are logged."""
    seen = []
    original = GRPOTrainer._compute_loss

    def spy(self, model, inputs):
        seen.append((self.use_vllm, "importance_sampling_ratio" in inputs))
        return original(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", spy)
    logs = Logs()
    tr = _bridge(tmp_path, dataset, callbacks=[logs], rewards=[distinct_chars_reward, format_reward],
                 importance_sampling_mode="token_truncate")
    tr.train()
    step = logs.train_step
    assert step["reward_std"] > 0 and step["grad_norm"] > 0  # a real update, weighted by TRL's IS ratio
    print({k: round(v, 6) for k, v in is_metrics(step).items()})
    assert set(is_metrics(step)) >= IS_METRICS
    assert step["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert step["sampling/sampling_logp_difference/max"] < LOGPROB_ATOL
    assert seen and all(seen_gate and has_ratio for seen_gate, has_ratio in seen)
    assert torch.isfinite(torch.tensor(step["loss"]))


def test_bridge_warns_and_ratio_drops_with_top_p(tmp_path, dataset):
    """top_p < 1: the engine's logprobs are of the truncated distribution, TRL's of the full one -> ratio < 1."""
    with pytest.warns(UserWarning, match="biased below 1"):
        tr = _bridge(tmp_path, dataset, top_p=0.8, importance_sampling_mode="token_truncate")
    tr.model.train()
    out = tr._generate_and_score_completions(_batch())
    ratio = out["importance_sampling_ratio"][out["completion_mask"].bool()]
    assert (ratio <= 1 + 1e-4).all() and ratio.mean() < 0.99


def test_bf16_mixed_precision_stock_breaks_bridge_runs(tmp_path, dataset):
    """TRL's default bf16=True (here on CPU, `use_cpu=True`). accelerate wraps `model.forward` to convert outputs
    to fp32; where the CB engine's forward returns its PagedAttentionCache among the outputs (transformers 5.24.0; not
    5.17.0), that calls `.float()` on it and the engine thread dies. Stock TRL then has no completions and fails
    with an IndexError; the bridge generates through the plain forward (`plain_forward`) under either version.

    bf16 logprobs: the engine (paged attention, bf16 weights) and TRL's forward (sdpa, autocast over the fp32
    weights) round differently; with this model's large logits (bf16 spacing is 0.125 at |x| ~ 20) measured mean
    ~3.6e-2 and max ~0.18 per token;
    asserted mean < 0.05, max < 0.5, and the ratio's batch mean within 0.05 of 1.
    """
    bf16 = {"bf16": True, "use_cpu": True}
    stock = _stock(tmp_path, dataset, trl_overrides=bf16)
    if cb_forward_returns_its_cache(*_policy()):
        with pytest.raises(IndexError):
            stock.train()
    else:
        stock.train()  # nothing for the wrapper to choke on
    # TRL's CB branch casts the policy to bf16 in place before generating: training would go on in bf16 (the bridge
    # does not: the test below).
    assert next(stock.model.parameters()).dtype == torch.bfloat16
    logs = Logs()
    tr = _bridge(tmp_path, dataset, callbacks=[logs], trl_overrides=bf16, importance_sampling_mode="token_truncate")
    tr.train()
    step = logs.train_step
    print({k: round(v, 4) for k, v in is_metrics(step).items()})
    assert set(is_metrics(step)) >= IS_METRICS
    assert step["sampling/sampling_logp_difference/mean"] < 0.05
    assert step["sampling/sampling_logp_difference/max"] < 0.5
    assert step["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.05)
    assert "forward" in tr.model.__dict__  # accelerate's wrapper is back for training


def test_bf16_bridge_step_leaves_the_callers_policy_fp32_for_cbkits_loop(tmp_path, dataset):
    """TRL's CB branch casts the policy it is given to bf16 in place (`unwrapped_model.to(torch.bfloat16)`, never cast
    back): notebook 04 hands its policy to the bridge, and its own cells re-run afterwards refused it
    (`check_policy`). The bridge samples from bf16 copies of the weights instead: after a bf16 TRL step the
    policy is fp32, it moved (TRL trained it), and cbkit's loop trains it on with CB rollouts."""
    from cbkit.train.setup import check_policy
    from tests.helpers import config, trainer

    model, tok = _policy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cast: list[torch.dtype] = []  # the weights' dtype the engine sampled from: TRL's bf16, as in stock TRL
    original = Engine.run

    def spy(self, *a, **k):
        cast.append(next(self.model.parameters()).dtype)
        return original(self, *a, **k)

    tr = build_trainer(model, tok, [distinct_chars_reward, format_reward], dataset, RUN, output_dir=str(tmp_path),
                       bf16=True, use_cpu=True, **TRL_ONLY)
    own_forward = model.__dict__.get("forward")  # TRL's __init__ adds its fused LM head, a pass-through here
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "run", spy)
        tr.train()
    assert cast == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} <= {torch.float32}
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved  # TRL's update landed on the caller's fp32 weights, not on a copy
    # AdamW's moments are fp32 too: TRL trained fp32 master weights under autocast.
    assert {s["exp_avg"].dtype for s in tr.optimizer.state.values()} == {torch.float32}
    check_policy(tok, model)
    step = trainer(config(max_steps=1, use_transformers_continuous_batching=True), policy=(model, tok))
    # ... with its own forward: accelerate's autocast wrapper, left on by TRL's train, made cbkit's CB rollout write
    # bf16 keys into its fp32 KV cache (a RuntimeError in the engine).
    assert model.__dict__.get("forward") is own_forward and "_original_forward" not in model.__dict__
    step.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bridge_refuses_what_it_does_not_handle(tmp_path, dataset):
    model, tok = _policy()
    no_cb = trl_grpo_config(dict(RUN, use_transformers_continuous_batching=False), str(tmp_path), **TRL_ONLY)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching=True"):
        CBLogprobGRPOTrainer(model, [TRLReward(format_reward)], no_cb, train_dataset=dataset, processing_class=tok)
    with pytest.raises(ValueError, match="use_transformers_continuous_batching=True"):
        CBLogprobGRPOTrainer(model, [TRLReward(format_reward)], train_dataset=dataset, processing_class=tok)
    vllm = trl_grpo_config(RUN, str(tmp_path), **TRL_ONLY)
    vllm.use_vllm = True  # set after validation: GRPOConfig would otherwise want a vLLM install
    with pytest.raises(ValueError, match="use_vllm=True"):
        CBLogprobGRPOTrainer(model, [TRLReward(format_reward)], vllm, train_dataset=dataset, processing_class=tok)
    # Without CB, build_trainer falls back to the stock trainer.
    no_cb_run = dict(RUN, use_transformers_continuous_batching=False)
    tr = build_trainer(model, tok, [format_reward], dataset, no_cb_run,
                            output_dir=str(tmp_path), **TRL_ONLY)
    assert type(tr) is GRPOTrainer


def test_bridge_from_a_model_directory(tmp_path):
    """docs/scale_out.md's form: TRL loads model and tokenizer itself (under ZeRO-3 that shards at load)."""
    from cbkit.tasks.data import synthetic_gsm
    from cbkit.tasks.rewards import DEFAULT_REWARD_WEIGHTS, DEFAULT_REWARDS

    model, tok = _policy()
    model.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    logs = Logs()
    tr = build_trainer(
        str(tmp_path / "policy"), None, DEFAULT_REWARDS, trl_dataset(synthetic_gsm(2), system_prompt=None),
        dict(RUN, max_completion_length=4), reward_weights=DEFAULT_REWARD_WEIGHTS, output_dir=str(tmp_path / "run"),
        callbacks=[logs], model_init_kwargs={"dtype": "float32"}, **TRL_ONLY,
    )
    assert isinstance(tr, CBLogprobGRPOTrainer) and tr.reward_weights.tolist() == [1.0, 0.5]
    tr.train()
    assert set(is_metrics(logs.train_step)) >= IS_METRICS


# --- contract: the TRL lines the bridge depends on ------------------------------------------------------------


def test_trl_gates_we_depend_on():
    """If an upgrade moves these, the bridge would silently skip IS again (or open vLLM-only code): fail loudly."""
    readers = {name for name, fn in inspect.getmembers(GRPOTrainer, inspect.isfunction)
               if "self.use_vllm" in inspect.getsource(fn)}
    # The gate is shut in every method but the last two, where only IS lines read it.
    assert readers == {"__init__", "_generate_single_turn", "_tool_call_loop", "_generate",
                       "_generate_and_score_completions", "_compute_loss"}, readers
    for name in ("_generate_and_score_completions", "_compute_loss"):
        src = inspect.getsource(getattr(GRPOTrainer, name))
        reads = len(re.findall(r"self\.use_vllm\b", src))
        gated = len(re.findall(r"self\.use_vllm and self\.vllm_importance_sampling_correction", src))
        assert reads == gated > 0, (name, reads, gated)
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "= self._generate(prompts)" in score and 'output["importance_sampling_ratio"]' in score
    assert 'inputs["importance_sampling_ratio"]' in inspect.getsource(GRPOTrainer._compute_loss)
    # The CB branch we replace: same contexts and casts, generation config passed, logprobs dropped.
    gen = inspect.getsource(GRPOTrainer._generate_single_turn)
    cb_branch = gen[gen.index("elif self.use_transformers_continuous_batching:"):gen.index("else:\n")]
    for piece in ("unwrap_model_for_generation(", "gather_deepspeed3_params=self.args.ds3_gather_for_generation",
                  "summon_full_params(self.model_wrapped, recurse=False)", "unwrapped_model.to(torch.bfloat16)",
                  "generation_config=self.generation_config", "output.generated_tokens", "logprobs = None"):
        assert piece in cb_branch, piece
    params = list(inspect.signature(GRPOTrainer._generate_single_turn).parameters)
    assert params == list(inspect.signature(CBLogprobGRPOTrainer._generate_single_turn).parameters)
    # TRL builds the sampling config the CB branch receives from these (issue #5783 is fixed in 1.16).
    init = inspect.getsource(GRPOTrainer.__init__)
    for knob in ('"do_sample": True', '"temperature": self.temperature', '"top_p": self.top_p', '"top_k": self.top_k'):
        assert knob in init, knob
    # accelerate's mixed-precision wrapper that plain_forward steps around.
    from accelerate import Accelerator

    prepare = inspect.getsource(Accelerator.prepare_model)
    assert "model._original_forward = model.forward" in prepare and "convert_outputs_to_fp32" in prepare


# --- config mapping -------------------------------------------------------------------------------------------


CBKIT_RUN = dict(
    num_generations=4, max_completion_length=64, temperature=0.9, top_p=0.95, top_k=0, learning_rate=5e-6,
    beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type="dr_grpo", scale_rewards="batch", num_iterations=2,
    gradient_accumulation_steps=2, mask_truncated_completions=True, importance_sampling_correction=True,
    importance_sampling_mode="token_mask", clip_max=2.5, clip_min=0.5, advantage_estimator="grpo",
    transformers_continuous_batching_config={"page_size": 32},
)


def _check_mapped(args, tmp_path):
    assert args.output_dir == str(tmp_path)
    for name in ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "learning_rate",
                 "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards", "num_iterations",
                 "gradient_accumulation_steps", "mask_truncated_completions"):
        assert getattr(args, name) == CBKIT_RUN[name], name
    assert args.vllm_importance_sampling_correction is True
    assert args.vllm_importance_sampling_mode == "token_mask"
    assert args.vllm_importance_sampling_clip_max == 2.5 and args.vllm_importance_sampling_clip_min == 0.5
    assert args.use_transformers_continuous_batching is True and args.use_vllm is False
    page = "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} else "block_size"
    assert args.transformers_continuous_batching_config == {
        "max_memory_percent": 0.5, "use_cuda_graph": False, page: 32, "return_logprobs": True}


def test_config_mapping_from_kwargs_and_from_a_config_object(tmp_path):
    _check_mapped(trl_grpo_config(CBKIT_RUN, str(tmp_path)), tmp_path)
    _check_mapped(trl_grpo_config(CBGRPOConfig(**CBKIT_RUN), str(tmp_path)), tmp_path)


def test_every_loop_only_config_field_says_where_it_goes_in_the_docs():
    """The bridge maps every field TRL names (tests above); the rest need a line in docs/trl_bridge.md."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs/trl_bridge.md").read_text()
    assert "model" in LOOP_ONLY and "temperature" in CBKIT_FIELDS and "clip_max" in CBKIT_FIELDS
    assert [name for name in LOOP_ONLY if f"`{name}`" not in doc] == [], "a new config field needs a line in the doc"


def test_a_real_config_maps_onto_trl_as_the_same_experiment(tmp_path):
    """Every mapped field of a CBGRPOConfig with non-default values, read back from TRL's own GRPOConfig."""
    from cbkit.train.config import CBGRPOConfig

    cfg = CBGRPOConfig(**{**CBKIT_RUN, "prompts_per_step": 3, "max_steps": 7, "save_steps": 3, "save_total_limit": 2,
                          "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6,
                          "max_grad_norm": 0.5, "seed": 11, "disable_tqdm": True,
                          "reward_funcs": ["correctness", "format"], "kl_bias_correction": False})
    args = trl_grpo_config(cfg, str(tmp_path))
    for name in ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "seed",
                 "save_total_limit", "disable_tqdm", "learning_rate", "num_iterations"):
        assert getattr(args, name) == getattr(cfg, name), name
    assert args.use_bias_correction_kl is False
    assert args.reward_weights == [1.0, 0.5]  # cbkit's default weights: the format reward counts half
    assert args.lr_scheduler_type == "constant" and args.warmup_steps == 0  # TRL's default is linear decay
    # A cbkit step is one rollout + num_iterations (2) updates; TRL counts updates.
    assert (args.max_steps, args.save_steps) == (14, 6)
    # 3 prompts x 4 completions in 2 micro-batches: 6 completions each, one generation every 2 micro-batches.
    assert args.per_device_train_batch_size == 6 and args.steps_per_generation == 2
    assert args.per_device_train_batch_size * args.steps_per_generation == 3 * cfg.num_generations
    assert trl_grpo_config(dataclasses.replace(cfg, save_steps=0), str(tmp_path)).save_strategy == "no"
    with pytest.raises(ValueError, match="do not split into gradient_accumulation_steps=5"):
        trl_grpo_config(dict(CBKIT_RUN, prompts_per_step=3, gradient_accumulation_steps=5), str(tmp_path))


def test_the_configs_reward_weights_follow_the_functions_by_name():
    from cbkit.train.config import CBGRPOConfig
    cfg = CBGRPOConfig(reward_funcs=["correctness", "format"])
    funcs = {"format": format_reward, "correctness": correctness_reward}  # another order than the config's
    assert trl_rewards(funcs, cfg=cfg)[1] == [0.5, 1.0]
    assert trl_rewards(funcs, {"format": 2.0}, cfg)[1] == [2.0, 1.0]  # explicit weights win
    with pytest.raises(ValueError, match="reward_weights has 2 entries for 1 reward functions"):
        trl_rewards([format_reward], cfg=cfg)


def test_config_defaults_and_overrides(tmp_path):
    args = trl_grpo_config(None, str(tmp_path))
    assert args.use_transformers_continuous_batching is True
    assert args.transformers_continuous_batching_config == {
        "max_memory_percent": 0.5, "use_cuda_graph": False, "return_logprobs": True}
    assert args.bf16 is False  # TRL would default to True, even on CPU (conftest hides any GPU from this test)
    args = trl_grpo_config(dict(temperature=0.9, transformers_continuous_batching_config={"max_memory_percent": 0.3}),
                           str(tmp_path), temperature=0.6, logging_steps=3, vllm_importance_sampling_clip_max=5.0)
    assert (args.temperature, args.logging_steps, args.vllm_importance_sampling_clip_max) == (0.6, 3, 5.0)
    assert args.transformers_continuous_batching_config["max_memory_percent"] == 0.3


def test_config_errors_say_what_to_change(tmp_path):
    with pytest.raises(ValueError, match=r"key\(s\) \['num_pages'\].*accepts:.*num_blocks"):
        trl_grpo_config(dict(transformers_continuous_batching_config={"num_pages": 8}), str(tmp_path))
    with pytest.raises(ValueError, match="return_logprobs=False"):
        trl_grpo_config(dict(transformers_continuous_batching_config={"return_logprobs": False}), str(tmp_path))
    with pytest.raises(ValueError, match="max_memory_percent"):
        trl_grpo_config(None, str(tmp_path), transformers_continuous_batching_config={"max_memory_percent": 50})
    with pytest.raises(ValueError, match=r"'temprature' \(did you mean 'temperature'\?\)"):
        trl_grpo_config(dict(temprature=0.7), str(tmp_path))
    with pytest.raises(ValueError, match=r"did you mean 'vllm_importance_sampling_mode'"):
        trl_grpo_config(None, str(tmp_path), vllm_importance_sampling_mod="token_mask")
    with pytest.raises(ValueError, match="leave-one-out estimator in cbkit's loop"):
        trl_grpo_config(dict(advantage_estimator="rloo"), str(tmp_path))
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        args = trl_grpo_config(dict(use_transformers_paged=True, use_transformers_continuous_batching=False),
                               str(tmp_path))
    assert args.use_transformers_continuous_batching is True
    # One rule with CBGRPOConfig's: a False set under the old name turns CB off there and here.
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        args = trl_grpo_config(dict(use_transformers_paged=False), str(tmp_path))
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        cfg = CBGRPOConfig(use_transformers_paged=False)
    assert args.use_transformers_continuous_batching is cfg.use_transformers_continuous_batching is False


def test_asking_for_vllm_turns_cb_off(tmp_path):
    args = trl_grpo_config(CBKIT_RUN, str(tmp_path), use_vllm=True, vllm_mode="server")
    assert args.use_vllm is True and args.use_transformers_continuous_batching is False
    assert args.transformers_continuous_batching_config is None
    assert args.vllm_importance_sampling_mode == "token_mask"  # the IS settings still map
    with pytest.raises(ValueError, match="choose one generation backend"):
        trl_grpo_config(None, str(tmp_path), use_vllm=True, use_transformers_continuous_batching=True)


# --- rewards --------------------------------------------------------------------------------------------------


def test_reward_adapter():
    r = TRLReward(format_reward)
    assert r.__name__ == "format_reward"
    plain = r(prompts=["p", "p"], completions=["x\n#### 5", "no"], completion_ids=[[1], [2]], answer=["5", "5"],
              trainer_state=None, log_extra=None, log_metric=None)
    assert plain == [1.0, 0.0]
    chat = TRLReward(correctness_reward)(
        prompts=[[{"role": "user", "content": "q"}]] * 2,
        completions=[[{"role": "assistant", "content": "so #### 12"}], [{"role": "assistant", "content": "11"}]],
        answer=[12, 12])  # numbers in the column are compared as text, like cbkit's rewards expect
    assert chat == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"column 'answer'.*\['question'\]"):
        r(prompts=["p"], completions=["x"], question=["q"], trainer_state=None)
    assert TRLReward(format_reward, answer_column="gold")(completions=["#### 1"], gold=["1"]) == [1.0]

    def broken_reward(completions, answers):
        raise KeyError("boom")

    # The loop's checks (cbkit.tasks.rewards.reward_scores): the failing function and completion are named, and a
    # non-finite score is an error rather than TRL's silent advantage 0.
    with pytest.raises(RuntimeError, match=r"Reward function 'broken_reward' raised KeyError(.|\n)*'no'"):
        TRLReward(broken_reward)(completions=["no"], answer=["1"])

    def nan_reward(completions, answers):
        return [1.0, math.nan]

    with pytest.raises(ValueError, match=r"'nan_reward' returned nan for completion 1 \(answer '2'\)"):
        TRLReward(nan_reward)(completions=["a", "b"], answer=["1", "2"])
    assert pickle.loads(pickle.dumps(r))(completions=["#### 5"], answer=["5"]) == [1.0]


def test_reward_list_and_weights():
    def trl_native(completions, **kwargs):
        return [0.0] * len(completions)

    funcs, weights = trl_rewards({"correctness": correctness_reward, "native": trl_native}, {"native": 0.5})
    assert isinstance(funcs[0], TRLReward) and funcs[1] is trl_native and weights == [1.0, 0.5]
    funcs, weights = trl_rewards(format_reward)
    assert [f.__name__ for f in funcs] == ["format_reward"] and weights is None
    with pytest.raises(ValueError, match="unknown rewards"):
        trl_rewards({"format": format_reward}, {"fromat": 1.0})
    with pytest.raises(ValueError, match="by name"):
        trl_rewards([format_reward], {"format": 1.0})


def test_trl_dataset_from_cbkit_problems():
    from cbkit.tasks.data import SYSTEM_PROMPT, synthetic_gsm

    problems = synthetic_gsm(3, seed=0)
    ds = trl_dataset(problems)
    assert ds.column_names == ["prompt", "answer"] and ds["answer"] == [p.answer for p in problems]
    assert ds[0]["prompt"] == [{"role": "system", "content": SYSTEM_PROMPT},
                               {"role": "user", "content": problems[0].question}]
    user_only = trl_dataset(problems, system_prompt=None)[0]["prompt"]
    assert user_only == [{"role": "user", "content": problems[0].question}]


def test_bridge_engine_sized_to_the_workload_with_a_seed_per_call(tmp_path, dataset, monkeypatch):
    """Two steps on the CB path in bf16 mixed precision (TRL's default): no pool size given, and still no share
    of host RAM; a seed per call."""
    logs = Logs()
    model, tok = _policy()
    seen = []
    original = Engine.config

    def spy(self, rows, max_new_tokens, seed):
        cb = original(self, rows, max_new_tokens, seed)
        seen.append((len(rows), cb))
        return cb

    monkeypatch.setattr(Engine, "config", spy)
    tr = build_trainer(
        model, tok, {"correctness": correctness_reward, "format": format_reward}, dataset,
        dict(RUN, max_steps=2), output_dir=str(tmp_path), callbacks=[logs],
        reward_weights={"format": 0.5}, bf16=True, use_cpu=True, **TRL_ONLY,
    )
    assert type(tr) is CBLogprobGRPOTrainer
    assert tr.reward_weights.tolist() == [1.0, 0.5]
    tr.train()
    step = logs.train_step
    assert {"rewards/correctness_reward/mean", "rewards/format_reward/mean"} <= set(step)
    assert len(seen) == 2
    for rows, cb in seen:
        # Sized to the workload (not gigabytes of host RAM): a 32-token page per 32 tokens of each row at full
        # length, plus one; the tiny model's prompts here are under 100 tokens and completions at most 64 (here 12).
        assert rows == 2 * N and cb.page_size == 32 and cb.num_blocks <= rows * -(-(100 + 64) // 32) + 1
        assert cb.return_logprobs
    assert seen[0][1].seed != seen[1][1].seed


def test_bridge_raises_on_a_failed_request(tmp_path, dataset, monkeypatch):
    """A forward that fails a few steps in fails the call; transformers' `generate_batch` (what TRL calls) logs it
    and returns fewer completions, which would shift every prompt/completion pair after the lost one."""
    model, tok = _policy()
    tr = build_trainer(model, tok, format_reward, dataset, RUN, output_dir=str(tmp_path), **TRL_ONLY)
    layer = model.model.layers[0].mlp
    real, calls = layer.forward, {"n": 0}

    def broken(x):
        calls["n"] += 1
        if calls["n"] == 3:  # requests are running when it fails
            raise RuntimeError("injected failure in the MLP")
        return real(x)

    monkeypatch.setattr(layer, "forward", broken)
    with pytest.raises(RuntimeError, match="injected failure|failed request"):
        tr._generate_single_turn(_prompt_ids(tok), None, {}, N)


def test_bridge_rollout_without_a_length_cap_says_what_to_set():
    # TRL's configs allow max_completion_length=None; the bridge's engine call needs a number (None used to reach
    # SamplingParams as a TypeError). The check comes before anything else the method reads from the trainer.
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="set max_completion_length"):
        CBLogprobGRPOTrainer._generate_single_turn(SimpleNamespace(max_completion_length=None), [[1, 2]], None, {}, 1)
