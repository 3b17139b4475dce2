"""cbkit's config onto TRL's `GRPOConfig` / `RLOOConfig`: most fields keep TRL's names; the exceptions (vLLM-named
IS fields, steps counted in updates, a constant learning rate) and the CB engine config are here. docs/trl_bridge.md
explains each mapping."""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Mapping
from typing import Any

from trl import GRPOConfig, RLOOConfig

from cbkit.models.load import native_bf16
from cbkit.rollout.engine_config import cb_config_values
from cbkit.train.config import continuous_batching_flag

_RENAMED: dict[str, str] = {
    "importance_sampling_correction": "vllm_importance_sampling_correction",
    "importance_sampling_mode": "vllm_importance_sampling_mode",
    "clip_max": "vllm_importance_sampling_clip_max",
    "clip_min": "vllm_importance_sampling_clip_min",
    "kl_bias_correction": "use_bias_correction_kl",
}
_SAME_NAME: tuple[str, ...] = (
    "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "max_grad_norm",
    "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards", "num_iterations",
    "gradient_accumulation_steps", "mask_truncated_completions", "per_device_train_batch_size", "seed",
    "reward_weights", "save_total_limit", "disable_tqdm",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config",
)
# Read by the bridge itself rather than copied: TRL counts them in other units.
_SPECIAL: tuple[str, ...] = ("advantage_estimator", "use_transformers_paged", "prompts_per_step", "max_steps",
                             "save_steps", "reward_funcs", "eval_steps", "eval_num_generations")
CBKIT_FIELDS: tuple[str, ...] = _SAME_NAME + tuple(_RENAMED) + _SPECIAL
# cbkit config fields with no TRL config field, and why (tests/test_trl_bridge.py: every field is mapped or here).
LOOP_ONLY: dict[str, str] = {
    "model": "the model (or its id) is build_trainer's first argument; TRL loads an id itself",
    "dtype": "the precision cbkit's loop computes in over fp32 weights; TRL's nearest is bf16 mixed precision, which "
             "the bridge sets where bf16 is native (its rollouts sample from bf16 copies, where TRL's CB branch "
             "casts the weights themselves: docs/scale_out.md). The model's own dtype is the caller's "
             "(model_init_kwargs={'dtype': ...} for an id)",
    "data": "the dataset is build_trainer's train_dataset (trl_dataset(load_problems(...)))",
    "num_problems": "the dataset is build_trainer's train_dataset: cut it before",
    "system_prompt": "trl_dataset(problems, system_prompt=...) puts it in the prompts",
    "output_dir": "trl_grpo_config's output_dir argument (a TRL run writes TRL's checkpoints, not cbkit's)",
    "rollout_staleness": "cbkit's loop samples from a k-updates-old snapshot; TRL's GRPOTrainer always rolls out "
                         "from the current weights",
    "rollout_snapshots": "where cbkit's rollout_staleness keeps its older weights; TRL has no stale-snapshot rollouts",
    "async_rollouts": "TRL's async GRPO (AsyncGRPOTrainer) needs a vLLM server; its CB path is synchronous",
    "async_update_at": "pins where cbkit's async update lands inside the queued rollout; TRL has no async CB path",
    "max_staleness": "bounds cbkit's async and stale rollouts; TRL's max_staleness belongs to AsyncGRPOConfig (vLLM)",
    "stale_rollouts": "what cbkit's loop does with a rollout older than max_staleness; no TRL GRPOConfig field",
    "data_options": "the dataset is build_trainer's train_dataset (trl_dataset(load_problems(..., options=...)))",
    "eval_data": "the held-out set is build_trainer's eval_dataset (trl_dataset(HeldOut.problems)); TRL scores it "
                 "with the training rewards, not math-verify's held-out accuracy",
    "eval_num_problems": "the held-out set is build_trainer's eval_dataset: cut it before",
    "forward_chunk_rows": "TRL's chunk of rows is its micro-batch (per_device_train_batch_size, mapped) and its fused "
                          "LM head streams the vocabulary; no GRPOConfig field splits a micro-batch further",
}


def trl_grpo_config(cfg_or_kwargs: Any = None, output_dir: str = "cbkit-trl", **overrides: Any):
    """A `trl.GRPOConfig` for the run `cfg_or_kwargs` describes (a cbkit config, a dict of its fields, or None), on
    the CB path with cbkit's CB defaults; `overrides` are `GRPOConfig` arguments under TRL's names and win."""
    values = _cbkit_values(cfg_or_kwargs)
    estimator = values.pop("advantage_estimator", "grpo")
    if estimator != "grpo":
        raise ValueError(f"advantage_estimator={estimator!r}: TRL's GRPOTrainer has only the group-mean baseline. "
                         "Use build_trainer (which picks TRL's RLOOTrainer for it) or trl_rloo_config for the "
                         "leave-one-out estimator, or set advantage_estimator='grpo'.")
    return _trl_config(GRPOConfig, values, output_dir, overrides)


def trl_rloo_config(cfg_or_kwargs: Any = None, output_dir: str = "cbkit-trl-rloo", **overrides: Any):
    """A `trl.RLOOConfig` (see `trl_grpo_config`): `scale_rewards` becomes `normalize_advantages`; settings RLOO
    lacks are dropped, with a warning when they differ from TRL's GRPO defaults."""
    values = _cbkit_values(cfg_or_kwargs)
    values.pop("advantage_estimator", None)  # RLOO is the leave-one-out estimator whatever the config says
    if "scale_rewards" in values:
        scale = values.pop("scale_rewards")
        if scale not in ("batch", "none"):
            raise ValueError(f"scale_rewards={scale!r} has no RLOO equivalent: TRL's RLOOTrainer normalises "
                             "advantages over the whole batch or not at all. Set scale_rewards='batch' "
                             "(normalize_advantages=True) or 'none'.")
        values["normalize_advantages"] = scale == "batch"
    rloo_fields = {f.name for f in dataclasses.fields(RLOOConfig)}
    grpo_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    dropped = {k: v for k, v in values.items() if k not in _SPECIAL and _trl_name(k) not in rloo_fields}
    changed = {k: v for k, v in dropped.items() if v != grpo_defaults.get(_trl_name(k), object())}
    if changed:
        warnings.warn(f"RLOOConfig (TRL 1.16) has no equivalent for {changed}; ignored. TRL's RLOO uses its own "
                      "sequence-level loss and has no importance-sampling correction.", stacklevel=2)
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
            raise ValueError(f"Unknown cbkit config field(s) {', '.join(hints)}. cbkit fields: "
                             f"{', '.join(sorted(CBKIT_FIELDS))}. TRL-only settings go in the keyword overrides "
                             "under TRL's names, e.g. trl_grpo_config(cfg, output_dir, logging_steps=1).")
        values = dict(cfg)
    else:
        missing = object()
        values = {k: v for k in CBKIT_FIELDS if (v := getattr(cfg, k, missing)) is not missing}
    if "reward_weights" in values and values["reward_weights"] is None and hasattr(cfg, "resolved_reward_weights"):
        values["reward_weights"] = cfg.resolved_reward_weights()  # cbkit's per-reward defaults (format 0.5)
    paged = values.pop("use_transformers_paged", None)
    if paged is not None:
        values["use_transformers_continuous_batching"] = continuous_batching_flag(
            paged, values.get("use_transformers_continuous_batching", True))
    return values


def _trl_config(config_cls, values: dict[str, Any], output_dir: str, overrides: dict[str, Any]):
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        close = {k: difflib.get_close_matches(k, fields, n=1) for k in unknown}
        raise ValueError(f"Unknown {config_cls.__name__} argument(s) {unknown}"
                         + "".join(f"; {k!r}: did you mean {c[0]!r}?" for k, c in close.items() if c)
                         + ". Overrides use TRL's names; cbkit's names go in the first argument.")
    if overrides.get("use_vllm"):  # generate with vLLM instead: the config's CB settings no longer apply
        if overrides.get("use_transformers_continuous_batching"):
            raise ValueError("use_vllm=True and use_transformers_continuous_batching=True: choose one generation "
                             "backend.")
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
            kwargs.get("transformers_continuous_batching_config"))
    return config_cls(output_dir=str(output_dir), **kwargs)


def _counted_in_trl_units(values: dict[str, Any]) -> dict[str, Any]:
    """Pop the fields TRL counts differently and return them in TRL's units: a cbkit step is one rollout and
    `num_iterations` updates, a TRL step one update; cbkit's prompts x N completions a step are split into
    `gradient_accumulation_steps` micro-batches of `per_device_train_batch_size` (one process)."""
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
    if "eval_steps" in values:  # TRL evaluates eval_dataset every eval_steps updates, and before the first one
        every = int(values.pop("eval_steps"))
        out["eval_strategy"] = "steps" if every else "no"
        if every:
            out.update(eval_steps=every * iterations, eval_on_start=True)
    if "eval_num_generations" in values:
        out["num_generations_eval"] = int(values.pop("eval_num_generations"))
    if "prompts_per_step" in values:
        completions = int(values.pop("prompts_per_step")) * int(values.get("num_generations", 8))
        ga = int(values.get("gradient_accumulation_steps", 1) or 1)
        if completions % ga:
            raise ValueError(f"prompts_per_step x num_generations = {completions} completions do not split into "
                             f"gradient_accumulation_steps={ga} equal micro-batches; TRL needs "
                             "per_device_train_batch_size to be a whole number.")
        out["per_device_train_batch_size"] = completions // ga
    return out


def cb_config_dict(overrides: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
    """cbkit's CB defaults + the user's keys + `return_logprobs=True`, validated: what goes into TRL's config."""
    if isinstance(overrides, str):  # TRL's CLI passes dict fields as JSON
        import json

        return cb_config_values(json.loads(overrides))
    return cb_config_values(overrides)  # raises on unknown keys, a bad max_memory_percent, or return_logprobs=False


__all__ = ["CBKIT_FIELDS", "cb_config_dict", "trl_grpo_config", "trl_rloo_config"]
