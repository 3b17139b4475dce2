"""Run the same experiment on TRL's `GRPOTrainer` / `RLOOTrainer`: the path from one GPU to many.

cbkit's own loop (`cbkit/grpo.py`) is for one process and for reading. When a run outgrows one GPU, cbkit
does not grow a distributed engine of its own: TRL already runs under `accelerate launch` with DeepSpeed
ZeRO or FSDP (see `docs/scale_out.md`). This module is the bridge, in three parts.

1. **Config mapping** (`trl_grpo_config`, `trl_rloo_config`). cbkit's config uses TRL's names wherever TRL
   has the concept, so most fields copy across unchanged. The exceptions: the importance-sampling (IS)
   settings, which TRL names after vLLM (`importance_sampling_correction` -> `vllm_importance_sampling_
   correction`, `importance_sampling_mode` / `clip_max` / `clip_min` -> `vllm_importance_sampling_mode` /
   `_clip_max` / `_clip_min`) because vLLM was its only source of sampling logprobs; `kl_bias_correction`
   -> `use_bias_correction_kl`; and, for RLOO, `scale_rewards` -> `normalize_advantages`. Some fields count in
   other units: a cbkit step is one rollout and `num_iterations` updates, a TRL step one update, so `max_steps`
   and `save_steps` are multiplied by `num_iterations`; `prompts_per_step` becomes `per_device_train_batch_size`
   (prompts x N / gradient_accumulation_steps completions). The optimizer fields (`weight_decay`, `adam_*`,
   `max_grad_norm`) copy across, the learning rate is held constant as in cbkit's loop (TRL's default decays it
   linearly), and the reward weights come from the config, matched to the functions by name. `LOOP_ONLY` lists
   the fields with no TRL config equivalent and says where each goes instead. The continuous
   batching (CB) engine is on (`use_transformers_continuous_batching=True`) and its config is cbkit's
   (`CB_DEFAULTS`: `max_memory_percent=0.5`, TRL's default too, and `use_cuda_graph=False`, which TRL leaves to
   the engine) plus the user's keys, validated by the
   same `make_cb_config` the rollout backend uses, so an unknown key fails here, at config time, with the list
   of valid ones. Either a cbkit config object (read by attribute name, so anything with those attributes
   works) or plain keyword arguments are accepted; TRL-only settings go in `**overrides` under TRL's names.

2. **`CBLogprobGRPOTrainer`**: the smallest change that makes TRL's IS correction run on the CB path.
   In TRL 1.16 (`trl/trainer/grpo_trainer.py`) two things stop it:

   * `GRPOTrainer._generate_single_turn`, branch `elif self.use_transformers_continuous_batching:`, calls
     `generate_batch`, keeps `output.generated_tokens` and sets `logprobs = None`; it never asks the engine
     for them (TRL never sets `ContinuousBatchingConfig.return_logprobs`; set by the user, the engine computes
     them and the branch still discards them).
   * even given logprobs, every IS line is gated on `self.use_vllm and self.vllm_importance_sampling_correction`:
     in `_generate_and_score_completions` the old-logprob forward, the ratio itself, the `sampling/*`
     metrics and `output["importance_sampling_ratio"]`; in `_compute_loss` the multiplication of the
     per-token loss by that ratio.

   The subclass overrides `_generate_single_turn` with its own CB call (same unwrap / ZeRO-3 gather / FSDP
   summon contexts, dtype casts and `generate_batch` call as TRL's branch) with an engine config built by
   `cbkit.rollout.continuous.make_cb_config` (so `return_logprobs=True`), and returns
   `GenerationOutput.logprobs` cut to the same length as the completion ids. For the gate, `use_vllm` becomes
   a read-only property that is True exactly while TRL computes the IS quantities of a batch that has sampling
   logprobs, i.e. inside `_generate_and_score_completions` *after* `_generate` has returned, and inside
   `_compute_loss` for inputs carrying `importance_sampling_ratio`. Every other reader of `self.use_vllm`
   (`__init__` building a vLLM engine, `_generate`'s weight sync for `rollout_func`, `_tool_call_loop`'s
   colocate length check, `_generate_single_turn`'s branch) runs while it reads False, so no vLLM-only code
   path can fire. `tests/test_trl_bridge.py::test_trl_gates_we_depend_on` pins those lines: an upgrade that
   moves them fails loudly instead of silently skipping the correction again.

   The rest is unchanged TRL: its old-logprob forward (temperature only), its four IS modes, its clip
   bounds, its `sampling/importance_sampling_ratio/{min,mean,max}` and
   `sampling/sampling_logp_difference/{mean,max}` metrics.

   Sampling parameters (TRL issue #5783, CB sampling near-greedy when the generation config was not passed):
   TRL 1.16 already passes them. `__init__` builds `self.generation_config` with `do_sample=True`,
   `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and the CB branch hands it to
   `generate_batch(generation_config=...)`. The subclass passes the same object; the tests confirm it
   reaches the sampler by checking that the engine's logprobs equal a teacher-forced forward under the
   *processed* distribution (temperature 0.7, top-k, top-p) and not under the raw one.

   Where the subclass's CB call differs from TRL's branch, it is because TRL fails, loses data or wastes time:

   * with bf16/fp16 mixed precision it generates through the model's own `forward` (`_plain_forward`):
     accelerate's mixed-precision wrapper converts outputs to fp32 and calls `.float()` on the engine's
     `PagedAttentionCache`, so stock TRL's CB path with `bf16=True` dies in the engine thread and then fails
     with an IndexError (reproduced on CPU with `use_cpu=True`; accelerate installs the same wrapper on GPU);
   * a request that fails or goes missing raises (TRL's `generate_batch` logs it and returns fewer or empty
     completions, which misaligns prompts and completions downstream);
   * on CPU the KV pool is sized to the workload unless `num_blocks` is set (a share of *host RAM* is
     gigabytes of zeroed cache for a test model);
   * each call gets its own engine seed (`args.seed`, process index, call count), so a run is reproducible
     and ranks do not draw the same samples.

   A bias TRL's IS has by construction, on the vLLM path too: the sampling logprobs are under the processed
   distribution (top-k / top-p truncated and renormalised), TRL's old logprobs under temperature only. With
   `top_p < 1` or `top_k > 0` the ratio is then below 1 for every kept token even on identical weights. The
   subclass warns at construction when that is the case.

3. **Reward adapter** (`trl_reward`). TRL calls `fn(prompts=..., completions=..., completion_ids=...,
   **dataset_columns, trainer_state=..., ...)`, with chat completions as message lists; cbkit's rewards
   are `fn(completions: list[str], answers: list[str])`. The adapter takes the text and the `answer`
   column and keeps `__name__`, which TRL uses for its `rewards/<name>/mean` metric.

RLOO: TRL 1.16's `RLOOTrainer` has the same CB branch without logprobs, but also no IS correction at all
(`RLOOConfig` has no `vllm_importance_sampling_*` fields, and its vLLM path asks for `logprobs=None`). There
is nothing to hand logprobs to, so `build_rloo_trainer` builds `CBRLOOTrainer`: the stock trainer with the GRPO
bridge's CB call (`_CBRollouts`: the mixed-precision fix, the CPU pool, the per-call seed, failures raised), whose
logprobs it drops. `RLOOConfig` also has no
`loss_type` or `scale_rewards`: `scale_rewards` maps to `normalize_advantages` ("batch" -> True, "none" ->
False; "group" has no RLOO equivalent and is refused), and settings RLOO lacks are dropped with a warning when
they differ from TRL's GRPO defaults.

Also seen in TRL 1.16's CB branch and kept as is: with `bf16=True` it casts the policy's weights to bf16
*in place* before generating (`unwrapped_model.to(torch.bfloat16)`), so training continues on bf16 weights.
TRL defaults `bf16=True` even on CPU; the bridge defaults it to whether the GPU has native bf16.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from cbkit.models import native_bf16
from cbkit.rewards import resolve_rewards, reward_scores
from cbkit.rollout.base import cut_at_eos
from cbkit.rollout.continuous import CB_DEFAULTS, make_cb_config

# cbkit field -> TRL field. Everything not listed keeps its name (see _SAME_NAME).
_RENAMED: dict[str, str] = {
    "importance_sampling_correction": "vllm_importance_sampling_correction",
    "importance_sampling_mode": "vllm_importance_sampling_mode",
    "clip_max": "vllm_importance_sampling_clip_max",
    "clip_min": "vllm_importance_sampling_clip_min",
    "kl_bias_correction": "use_bias_correction_kl",
}
_SAME_NAME: tuple[str, ...] = (
    "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards", "num_iterations",
    "gradient_accumulation_steps", "mask_truncated_completions", "per_device_train_batch_size", "seed",
    "reward_weights", "save_total_limit", "disable_tqdm",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config",
)
# Read by the bridge itself rather than copied (see `_trl_config`): TRL counts them in other units.
_SPECIAL: tuple[str, ...] = ("advantage_estimator", "use_transformers_paged", "prompts_per_step", "max_steps",
                             "save_steps", "reward_funcs")
CBKIT_FIELDS: tuple[str, ...] = _SAME_NAME + tuple(_RENAMED) + _SPECIAL
# cbkit config fields with no TRL config field, and why. tests/test_trl_bridge.py checks that every field of
# cbkit.config.CBGRPOConfig is either mapped (CBKIT_FIELDS) or listed here.
LOOP_ONLY: dict[str, str] = {
    "model": "the model (or its id) is build_grpo_trainer's first argument; TRL loads an id itself",
    "dtype": "the caller loads the model; for an id, pass model_init_kwargs={'dtype': ...} under TRL's name",
    "data": "the dataset is build_grpo_trainer's train_dataset (trl_dataset(load_problems(...)))",
    "num_problems": "the dataset is build_grpo_trainer's train_dataset: cut it before",
    "system_prompt": "trl_dataset(problems, system_prompt=...) puts it in the prompts",
    "output_dir": "trl_grpo_config's output_dir argument (a TRL run writes TRL's checkpoints, not cbkit's)",
}


# --- config mapping -----------------------------------------------------------------------------------------


def trl_grpo_config(cfg_or_kwargs: Any = None, output_dir: str = "cbkit-trl", **overrides: Any):
    """A `trl.GRPOConfig` for the run `cfg_or_kwargs` describes, on the CB path, with cbkit's CB defaults.

    `cfg_or_kwargs`: a cbkit config (any object with cbkit's field names as attributes), a dict of those
    fields, or None. `overrides` are `GRPOConfig` arguments under TRL's names and win over the mapped values.
    """
    values = _cbkit_values(cfg_or_kwargs)
    estimator = values.pop("advantage_estimator", "grpo")
    if estimator != "grpo":
        raise ValueError(
            f"advantage_estimator={estimator!r}: TRL's GRPOTrainer has only the group-mean "
            "baseline. Use build_rloo_trainer / trl_rloo_config for the leave-one-out estimator, or set "
            "advantage_estimator='grpo'."
        )
    return _trl_config(GRPOConfig, values, output_dir, overrides)


def trl_rloo_config(cfg_or_kwargs: Any = None, output_dir: str = "cbkit-trl-rloo", **overrides: Any):
    """A `trl.RLOOConfig` for the run `cfg_or_kwargs` describes (see `trl_grpo_config`).

    `scale_rewards` becomes `normalize_advantages`; settings RLOOConfig does not have (`loss_type`, the IS
    settings, `kl_bias_correction`) are dropped, with a warning when they differ from TRL's GRPO defaults.
    """
    values = _cbkit_values(cfg_or_kwargs)
    values.pop("advantage_estimator", None)  # RLOO is the leave-one-out estimator whatever the config says
    if "scale_rewards" in values:
        scale = values.pop("scale_rewards")
        if scale not in ("batch", "none"):
            raise ValueError(
                f"scale_rewards={scale!r} has no RLOO equivalent: TRL's RLOOTrainer normalises advantages over the "
                "whole batch or not at all. Set scale_rewards='batch' (normalize_advantages=True) or 'none'."
            )
        values["normalize_advantages"] = scale == "batch"
    rloo_fields = {f.name for f in dataclasses.fields(RLOOConfig)}
    grpo_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    dropped = {k: v for k, v in values.items() if k not in _SPECIAL and _trl_name(k) not in rloo_fields}
    changed = {k: v for k, v in dropped.items() if v != grpo_defaults.get(_trl_name(k), object())}
    if changed:
        warnings.warn(
            f"RLOOConfig (TRL 1.16) has no equivalent for {changed}; ignored. TRL's RLOO uses its own "
            "sequence-level loss and has no importance-sampling correction.",
            stacklevel=2,
        )
    values = {k: v for k, v in values.items() if k not in dropped}
    return _trl_config(RLOOConfig, values, output_dir, overrides)


def _trl_name(cbkit_name: str) -> str:
    return _RENAMED.get(cbkit_name, cbkit_name)


def _cbkit_values(cfg: Any) -> dict[str, Any]:
    """The cbkit fields `cfg` sets. A dict must hold only cbkit fields; an object is read by attribute name."""
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        unknown = [k for k in cfg if k not in CBKIT_FIELDS]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, CBKIT_FIELDS, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(
                f"Unknown cbkit config field(s) {', '.join(hints)}. cbkit fields: {', '.join(sorted(CBKIT_FIELDS))}. "
                "TRL-only settings go in the keyword overrides under TRL's names, e.g. "
                "trl_grpo_config(cfg, output_dir, logging_steps=1)."
            )
        values = dict(cfg)
    else:
        missing = object()
        values = {k: v for k in CBKIT_FIELDS if (v := getattr(cfg, k, missing)) is not missing}
    if "reward_weights" in values and values["reward_weights"] is None and hasattr(cfg, "resolved_reward_weights"):
        values["reward_weights"] = cfg.resolved_reward_weights()  # cbkit's per-reward defaults (format 0.5)
    if values.pop("use_transformers_paged", False):
        warnings.warn(
            "use_transformers_paged is deprecated; use use_transformers_continuous_batching=True instead.",
            FutureWarning,
            stacklevel=3,
        )
        values["use_transformers_continuous_batching"] = True
    return values


def _trl_config(config_cls, values: dict[str, Any], output_dir: str, overrides: dict[str, Any]):
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        close = {k: difflib.get_close_matches(k, fields, n=1) for k in unknown}
        raise ValueError(
            f"Unknown {config_cls.__name__} argument(s) {unknown}"
            + "".join(f"; {k!r}: did you mean {c[0]!r}?" for k, c in close.items() if c)
            + ". Overrides use TRL's names; cbkit's names go in the first argument."
        )
    if overrides.get("use_vllm"):
        # Asking for vLLM here means "generate with vLLM instead": the config's CB settings no longer apply.
        if overrides.get("use_transformers_continuous_batching"):
            raise ValueError(
                "use_vllm=True and use_transformers_continuous_batching=True: choose one generation backend."
            )
        values = {k: v for k, v in values.items() if not k.startswith(("use_transformers", "transformers_"))}
    kwargs: dict[str, Any] = {
        "use_transformers_continuous_batching": not overrides.get("use_vllm", False),
        # TRL defaults bf16=True even on CPU (and casts the weights to bf16 in its CB branch); follow the hardware.
        "bf16": native_bf16(),
        # cbkit's loop keeps the learning rate constant, without warmup; TRL's default decays it linearly to 0.
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
    }
    kwargs.update(_counted_in_trl_units(values))
    kwargs.update({_trl_name(k): v for k, v in values.items()})
    kwargs.update(overrides)
    if kwargs["use_transformers_continuous_batching"]:
        kwargs["transformers_continuous_batching_config"] = cb_config_dict(
            kwargs.get("transformers_continuous_batching_config")
        )
    return config_cls(output_dir=str(output_dir), **kwargs)


def _counted_in_trl_units(values: dict[str, Any]) -> dict[str, Any]:
    """Pop the fields TRL counts differently and return them in TRL's units.

    A cbkit step is one rollout and `num_iterations` optimizer updates on it; TRL's `max_steps` and `save_steps`
    count optimizer updates (it regenerates every `steps_per_generation * num_iterations` micro-batches, i.e.
    every `num_iterations` updates). cbkit's `prompts_per_step` prompts x N completions are split into
    `gradient_accumulation_steps` micro-batches; TRL's `per_device_train_batch_size` is one micro-batch of
    completions (one process: with several, TRL's generation batch grows with the number of processes).
    `reward_funcs` names the rewards `reward_weights` belongs to; the trainer takes the functions themselves.
    """
    iterations = int(values.get("num_iterations", 1) or 1)
    out: dict[str, Any] = {}
    values.pop("reward_funcs", None)
    if "max_steps" in values:
        out["max_steps"] = int(values.pop("max_steps")) * iterations
    if "save_steps" in values:
        save = int(values.pop("save_steps"))
        if save == 0:
            out["save_strategy"] = "no"
        else:
            out["save_steps"] = save * iterations
    if "prompts_per_step" in values:
        completions = int(values.pop("prompts_per_step")) * int(values.get("num_generations", 8))
        ga = int(values.get("gradient_accumulation_steps", 1) or 1)
        if completions % ga:
            raise ValueError(
                f"prompts_per_step x num_generations = {completions} completions do not split into "
                f"gradient_accumulation_steps={ga} equal micro-batches; TRL needs per_device_train_batch_size to "
                "be a whole number."
            )
        out["per_device_train_batch_size"] = completions // ga
    return out


def cb_config_dict(overrides: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
    """cbkit's CB defaults + the user's keys + `return_logprobs=True`, validated: what goes into TRL's config."""
    if isinstance(overrides, str):  # TRL's CLI passes dict fields as JSON
        import json

        overrides = json.loads(overrides)
    overrides = dict(overrides or {})
    make_cb_config(overrides)  # raises on unknown keys, a bad max_memory_percent, or return_logprobs=False
    return {**CB_DEFAULTS, **overrides, "return_logprobs": True}


# --- data ---------------------------------------------------------------------------------------------------


def trl_dataset(problems, system_prompt: str | None = "default"):
    """cbkit `Problem`s as the dataset TRL expects: a conversational `prompt` column and the gold `answer`.

    TRL applies the tokenizer's chat template itself; `system_prompt="default"` uses `cbkit.data.SYSTEM_PROMPT`
    (the `#### <number>` instruction the format reward checks), None sends the user turn alone.
    """
    from datasets import Dataset

    from cbkit.data import SYSTEM_PROMPT

    system = SYSTEM_PROMPT if system_prompt == "default" else system_prompt
    head = [{"role": "system", "content": system}] if system is not None else []
    return Dataset.from_dict({
        "prompt": [head + [{"role": "user", "content": p.question}] for p in problems],
        "answer": [p.answer for p in problems],
    })


# --- rewards ------------------------------------------------------------------------------------------------


class TRLReward:
    """A cbkit reward `fn(completions, answers)` as the reward function TRL calls.

    TRL passes every dataset column by name, so the gold answers arrive as `kwargs[answer_column]`; chat
    completions arrive as message lists and are reduced to their text. `__name__` is kept: TRL logs the
    reward as `rewards/<__name__>/mean`. A class rather than a closure so it pickles like `fn` does.
    """

    def __init__(self, fn: Callable[[list[str], list[str]], list[float]], answer_column: str = "answer") -> None:
        self.fn = fn
        self.answer_column = answer_column
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        if self.answer_column not in kwargs:
            columns = sorted(k for k in kwargs if k not in _TRL_EXTRA_KWARGS)
            raise ValueError(
                f"reward {self.__name__!r} needs the gold answers in a dataset column {self.answer_column!r}; the "
                f"columns TRL passed are {columns}. Add the column or pass answer_column= to trl_reward."
            )
        texts = [_completion_text(c) for c in completions]
        answers = [str(a) for a in kwargs[self.answer_column]]
        return reward_scores(self.__name__, self.fn, texts, answers)

    def __repr__(self) -> str:
        return f"TRLReward({self.__name__}, answer_column={self.answer_column!r})"


# What TRL passes to reward functions besides prompts, completions and the dataset columns.
_TRL_EXTRA_KWARGS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def trl_reward(fn: Callable[[list[str], list[str]], list[float]], answer_column: str = "answer") -> TRLReward:
    """Wrap a cbkit reward for TRL (see `TRLReward`)."""
    return TRLReward(fn, answer_column)


def _completion_text(completion) -> str:
    """A plain completion is its text; a chat completion (list of messages) is its assistant text."""
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion:
        content = message.get("content") if isinstance(message, Mapping) else message
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # typed content blocks
            parts.extend(b.get("text", "") for b in content if isinstance(b, Mapping))
    return "".join(parts)


def _is_trl_native(fn) -> bool:
    """TRL reward functions must take **kwargs (TRL passes trainer_state, log_extra, ...); cbkit's never do."""
    if isinstance(fn, str | torch.nn.Module | TRLReward):
        return True
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _weights_for(reward_funcs, reward_weights, cfg: Any):
    """The weights to hand TRL: `reward_weights` when given, else the config's, matched to the functions by name.

    Without this a TRL run trained every reward at 1.0 where cbkit's loop, from the same config, weighs the
    format reward 0.5 (`cbkit.rewards.DEFAULT_REWARD_WEIGHTS`): not the same experiment.
    """
    if reward_weights is not None or cfg is None:
        return reward_weights
    if isinstance(cfg, Mapping):
        names, weights = cfg.get("reward_funcs"), cfg.get("reward_weights")
    else:
        names = getattr(cfg, "reward_funcs", None)
        resolve = getattr(cfg, "resolved_reward_weights", None)
        weights = resolve() if callable(resolve) else getattr(cfg, "reward_weights", None)
    if weights is None:
        return None
    if names is not None and isinstance(reward_funcs, Mapping):
        return {n: float(w) for n, w in zip(names, weights, strict=True) if n in reward_funcs}
    count = 1 if callable(reward_funcs) or isinstance(reward_funcs, str) else len(reward_funcs)
    if count != len(weights):
        raise ValueError(
            f"The config's reward_weights {list(weights)} are for {len(weights)} reward functions, got {count}. "
            "Pass reward_funcs as a name -> fn dict with the config's names, or reward_weights= explicitly."
        )
    return list(weights)


def _trl_rewards(reward_funcs, reward_weights, answer_column: str):
    """cbkit rewards (a callable, a list, or cbkit's name -> fn mapping) as TRL's list, and weights as its list.

    Names and weights follow the loop's rules (`cbkit.rewards.resolve_rewards`), except that a string stays
    what TRL makes of it, a reward model's id; no weights stays None (TRL's default, 1.0 each).
    """
    funcs, weights = resolve_rewards(reward_funcs, reward_weights, names_are_builtin=False)
    adapted = [f if _is_trl_native(f) else trl_reward(f, answer_column) for f in funcs.values()]
    return adapted, None if reward_weights is None else weights


# --- the trainer that keeps the CB logprobs -----------------------------------------------------------------


class _CBRollouts:
    """TRL's CB branch as both bridge trainers run it: cut at the stop ids, logprobs kept, failures raised, the KV
    pool sized to the workload on CPU and a seed per call (see the module docstring). Mixed into a TRL trainer."""

    _cb_calls = 0  # rollouts so far in this process: part of each call's engine seed

    def _cb_generate(self, prompt_ids) -> tuple[list[list[int]], list[list[float]]]:
        """Completion ids cut after the first stop id, and their sampling logprobs, one per row of `prompt_ids`."""
        from trl.extras.profiling import profiling_context
        from trl.models import unwrap_model_for_generation

        max_new = self.max_completion_length
        rows = [list(p) for p in prompt_ids]
        with (
            profiling_context(self, "transformers.generate_batch"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            # The same casts TRL's CB branch makes (in place, as there), so training sees what stock TRL sees.
            if self.args.bf16:
                unwrapped.to(torch.bfloat16)
            elif self.args.fp16:
                unwrapped.to(torch.float16)
            if getattr(self.args, "cast_lm_head_to_fp32", False):
                unwrapped.lm_head.to(torch.float32)
            was_training = unwrapped.training
            with _plain_forward(unwrapped):
                results = unwrapped.generate_batch(
                    rows,
                    generation_config=self.generation_config,
                    continuous_batching_config=self._cb_config(rows),
                    progress_bar=False,
                )
            unwrapped.train(was_training)
        outputs = list(results.values())  # generate_batch returns them in input order
        failed = [o.request_id for o in outputs if o.error is not None]
        if len(outputs) != len(rows) or failed:
            # generate_batch logs lost or failed requests and returns the rest; the prompt/completion pairing
            # downstream would silently shift, so stop here.
            raise RuntimeError(
                f"The CB engine returned {len(outputs) - len(failed)} usable completions for {len(rows)} prompts "
                f"(failed: {failed}); see the log above."
            )

        eos = frozenset(self.eos_token_ids)
        completion_ids, logprobs = [], []
        for i, out in enumerate(outputs):
            keep, _ = cut_at_eos(out.generated_tokens, eos, max_new)
            lps = list(out.logprobs or [])
            if len(lps) < keep:
                raise RuntimeError(
                    f"The CB engine returned {len(lps)} logprobs for {keep} tokens (request {i}); does this "
                    "transformers version support ContinuousBatchingConfig.return_logprobs?"
                )
            completion_ids.append(list(out.generated_tokens[:keep]))
            logprobs.append([float(x) for x in lps[:keep]])
        return completion_ids, logprobs

    def _cb_config(self, rows: list[list[int]]):
        """This call's engine config: the user's keys, logprobs on, a per-call seed, the pool sized on CPU."""
        overrides = dict(self.args.transformers_continuous_batching_config or {})
        device = self.accelerator.device
        if torch.device(device).type == "cpu" and "num_blocks" not in overrides:
            # A share of host RAM is gigabytes of zeroed KV cache for a small model: size to the workload.
            overrides.pop("max_memory_percent", None)
        seed = (int(self.args.seed) * 1_000_003 + self.accelerator.process_index * 10_007 + self._cb_calls)
        self._cb_calls += 1
        return make_cb_config(
            overrides,
            seed=seed % (2**31 - 1),
            device=device,
            rows=rows,
            max_new_tokens=self.max_completion_length,
        )


class CBLogprobGRPOTrainer(_CBRollouts, GRPOTrainer):
    """`trl.GRPOTrainer` whose CB rollouts carry sampling logprobs, so TRL's IS correction runs on the CB path.

    Only for `use_transformers_continuous_batching=True` without vLLM (with vLLM, TRL already has the
    logprobs; use `GRPOTrainer`). See the module docstring for what is overridden and why.
    """

    # Class defaults: TRL's __init__ reads `use_vllm` before this class's own attributes exist.
    _is_gate_open = False
    _scoring = False

    def __init__(self, model, reward_funcs=None, args=None, *pos, **kwargs):
        if args is None or not getattr(args, "use_transformers_continuous_batching", False):
            raise ValueError(
                "CBLogprobGRPOTrainer is for the continuous batching path: pass args with "
                "use_transformers_continuous_batching=True (trl_grpo_config sets it)."
            )
        if getattr(args, "use_vllm", False):
            raise ValueError(
                "use_vllm=True: TRL's vLLM path already returns sampling logprobs and runs the IS correction; "
                "use trl.GRPOTrainer (build_grpo_trainer picks it), or set use_vllm=False to generate with CB."
            )
        cb = dict(args.transformers_continuous_batching_config or {})
        if cb.get("return_logprobs") is False:
            raise ValueError(
                "transformers_continuous_batching_config has return_logprobs=False; remove it (this trainer "
                "exists to keep them)."
            )
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        # TRL checks this in __init__ only when use_vllm is True (grpo_trainer.py, `loss_type == "vespo"`).
        if (self.loss_type == "vespo" and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError(
                f"loss_type='vespo' needs importance_sampling_mode 'token_truncate' or 'token_mask', got "
                f"{self.vllm_importance_sampling_mode!r}."
            )
        if self.vllm_importance_sampling_correction and (
            (self.top_p is not None and self.top_p < 1.0) or (self.top_k or 0) > 0 or self.min_p
        ):
            warnings.warn(
                f"IS correction with top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}: the engine's "
                "sampling logprobs are under the truncated distribution, TRL's old logprobs under temperature "
                "only, so the IS ratio is biased below 1 even on identical weights (TRL's vLLM path has the same "
                "bias). Use top_p=1.0, top_k=0 for an unbiased correction, or read the sampling/* metrics with "
                "that in mind.",
                stacklevel=2,
            )

    # -- the gate: `use_vllm` reads True only where TRL computes and applies the IS ratio --

    @property
    def use_vllm(self) -> bool:
        return self._is_gate_open

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        if value:  # TRL's __init__ assigns args.use_vllm; __init__ above refused True already
            raise ValueError("CBLogprobGRPOTrainer never runs vLLM; use trl.GRPOTrainer for use_vllm=True.")

    @contextmanager
    def _gate(self, is_open: bool):
        before, self._is_gate_open = self._is_gate_open, is_open
        try:
            yield
        finally:
            self._is_gate_open = before

    def _generate(self, prompts: list):
        with self._gate(False):  # generation, weight sync, tool loop: vLLM-only code must not see True
            out = super()._generate(prompts)
        # out[4]: the per-token sampling logprobs (None from a rollout_func that has none). Open the gate for
        # the rest of _generate_and_score_completions only when there is something to correct with.
        if self._scoring:
            self._is_gate_open = out[4] is not None and bool(self.vllm_importance_sampling_correction)
        return out

    def _generate_and_score_completions(self, inputs):
        self._scoring = True
        try:
            with self._gate(False):  # closed again on the way out, whatever _generate opened
                return super()._generate_and_score_completions(inputs)
        finally:
            self._scoring = False

    def _compute_loss(self, model, inputs):
        with self._gate("importance_sampling_ratio" in inputs):
            return super()._compute_loss(model, inputs)

    # -- generation: TRL's CB call, keeping the logprobs --

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completions (prompt_ids arrive already repeated N times) and their sampling logprobs from the CB engine."""
        if images is not None and any(images):
            raise ValueError("The continuous batching path is text-only; use vLLM for multimodal models.")
        return self._cb_generate(prompt_ids)


@contextmanager
def _plain_forward(model):
    """Run the model's own `forward`, not the one accelerate installs under mixed precision.

    With `mixed_precision` bf16/fp16 (TRL's `bf16=True`), `Accelerator.prepare_model` replaces the instance's
    `forward` by autocast + `convert_outputs_to_fp32`, which walks the outputs and calls `.float()` on anything
    with a half `dtype`, including the CB engine's `PagedAttentionCache`: the generation loop dies with
    "'PagedAttentionCache' object has no attribute 'float'" and stock TRL then fails later with an IndexError.
    The weights were just cast to the half dtype in place, so autocast has nothing left to do here.
    """
    wrapped = model.__dict__.get("forward") if "_original_forward" in model.__dict__ else None
    if wrapped is None:
        yield
        return
    del model.forward  # the class's forward shows through
    try:
        yield
    finally:
        model.forward = wrapped


class CBRLOOTrainer(_CBRollouts, RLOOTrainer):
    """`trl.RLOOTrainer` with the GRPO bridge's CB call: it survives bf16/fp16 mixed precision (`_plain_forward`),
    sizes the CPU pool to the workload (TRL's `max_memory_percent=0.5` there means half of host RAM), seeds each
    call, and raises on a failed request.

    RLOO in TRL 1.16 has no IS correction, so unlike `CBLogprobGRPOTrainer` the logprobs are dropped.
    """

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        if not self.use_transformers_continuous_batching or self.use_vllm:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        if images is not None and any(images):
            raise ValueError("The continuous batching path is text-only; use vLLM for multimodal models.")
        return self._cb_generate(prompt_ids)[0]


# --- building trainers --------------------------------------------------------------------------------------


def build_grpo_trainer(
    model,
    tokenizer,
    reward_funcs,
    train_dataset,
    cfg: Any = None,
    *,
    output_dir: str = "cbkit-trl",
    reward_weights: Mapping[str, float] | Sequence[float] | None = None,
    answer_column: str = "answer",
    eval_dataset=None,
    callbacks=None,
    **overrides: Any,
):
    """TRL's GRPO trainer for a cbkit run: `CBLogprobGRPOTrainer` on the CB path, stock `GRPOTrainer` otherwise.

    `reward_funcs`: cbkit rewards (`fn(completions, answers)`, adapted with `trl_reward`), TRL-native ones
    (taking `**kwargs`, passed as they are), or cbkit's name -> fn dict (then `reward_weights` may be by name).
    `overrides`: `GRPOConfig` arguments under TRL's names.
    """
    funcs, weights = _trl_rewards(reward_funcs, _weights_for(reward_funcs, reward_weights, cfg), answer_column)
    if weights is not None:
        overrides = {**overrides, "reward_weights": weights}
    args = trl_grpo_config(cfg, output_dir, **overrides)
    cls = CBLogprobGRPOTrainer if args.use_transformers_continuous_batching and not args.use_vllm else GRPOTrainer
    return cls(
        model=model, reward_funcs=funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, callbacks=callbacks,
    )


def build_rloo_trainer(
    model,
    tokenizer,
    reward_funcs,
    train_dataset,
    cfg: Any = None,
    *,
    output_dir: str = "cbkit-trl-rloo",
    reward_weights: Mapping[str, float] | Sequence[float] | None = None,
    answer_column: str = "answer",
    eval_dataset=None,
    callbacks=None,
    **overrides: Any,
):
    """TRL's RLOO trainer for a cbkit run, on the CB path: `CBRLOOTrainer`, stock but for the mixed-precision fix.

    RLOO in TRL 1.16 has no IS correction to feed, so its rollouts' logprobs are not kept.
    """
    funcs, weights = _trl_rewards(reward_funcs, _weights_for(reward_funcs, reward_weights, cfg), answer_column)
    if weights is not None:
        overrides = {**overrides, "reward_weights": weights}
    args = trl_rloo_config(cfg, output_dir, **overrides)
    cls = CBRLOOTrainer if args.use_transformers_continuous_batching and not args.use_vllm else RLOOTrainer
    return cls(
        model=model, reward_funcs=funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, callbacks=callbacks,
    )


def is_metrics(logs: Mapping[str, float]) -> dict[str, float]:
    """TRL's importance-sampling metrics from a log record (empty when the correction did not run)."""
    return {k: v for k, v in logs.items() if k.startswith("sampling/") and not math.isnan(float(v))}


__all__ = [
    "CBKIT_FIELDS",
    "CBLogprobGRPOTrainer",
    "CBRLOOTrainer",
    "TRLReward",
    "build_grpo_trainer",
    "build_rloo_trainer",
    "cb_config_dict",
    "is_metrics",
    "trl_grpo_config",
    "trl_dataset",
    "trl_reward",
    "trl_rloo_config",
]
