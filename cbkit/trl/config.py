"""cbkit's config onto TRL's `GRPOConfig` (TRL's names but for vLLM-named IS fields, steps counted in updates, a
constant learning rate), its rewards as TRL reward functions and its problems as a TRL dataset (docs/trl_bridge.md)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from trl import GRPOConfig

from cbkit.models.load import native_bf16
from cbkit.rollout.engine_config import cb_config_values
from cbkit.tasks.data import SYSTEM_PROMPT
from cbkit.tasks.rewards import DEFAULT_REWARD_WEIGHTS, resolve_rewards, reward_scores
from cbkit.train.config import CBGRPOConfig, continuous_batching_flag, did_you_mean

_RENAMED: dict[str, str] = {
    "importance_sampling_correction": "vllm_importance_sampling_correction",
    "importance_sampling_mode": "vllm_importance_sampling_mode",
    "clip_max": "vllm_importance_sampling_clip_max",
    "clip_min": "vllm_importance_sampling_clip_min",
    "kl_bias_correction": "use_bias_correction_kl",
}
# Read by the bridge itself rather than copied: TRL counts them in other units.
_SPECIAL: tuple[str, ...] = ("advantage_estimator", "use_transformers_paged", "prompts_per_step", "max_steps",
                             "save_steps", "reward_funcs", "eval_steps", "eval_num_generations")
_GRPO_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}
# The config fields the bridge maps: TRL's own names (but output_dir, trl_grpo_config's argument), renamed, special.
CBKIT_FIELDS: tuple[str, ...] = tuple(dict.fromkeys([
    *(f.name for f in dataclasses.fields(CBGRPOConfig) if f.name in _GRPO_FIELDS and f.name != "output_dir"),
    *_RENAMED, *_SPECIAL]))
# The rest: build_trainer's or trl_dataset's arguments, or cbkit's loop only (docs/trl_bridge.md says where each goes).
LOOP_ONLY: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CBGRPOConfig) if f.name not in CBKIT_FIELDS)


def trl_grpo_config(cfg_or_kwargs: Any = None, output_dir: str = "cbkit-trl", **overrides: Any):
    """A `trl.GRPOConfig` for the run `cfg_or_kwargs` describes (a cbkit config, a dict of its fields, or None), on
    the CB path with cbkit's CB defaults; `overrides` are `GRPOConfig` arguments under TRL's names and win."""
    values = cbkit_values(cfg_or_kwargs)
    estimator = values.pop("advantage_estimator", "grpo")
    if estimator != "grpo":
        raise ValueError(f"advantage_estimator={estimator!r}: the bridge builds TRL's GRPOTrainer, which has "
                         "only the group-mean baseline. Run the leave-one-out estimator in cbkit's loop "
                         "(`cbkit train`), or set advantage_estimator='grpo'.")
    unknown = sorted(set(overrides) - _GRPO_FIELDS)
    if unknown:
        raise ValueError(f"Unknown GRPOConfig argument(s) {did_you_mean(unknown, _GRPO_FIELDS)}. Overrides "
                         "use TRL's names; cbkit's names go in the first argument.")
    if overrides.get("use_vllm"):  # generate with vLLM instead: the config's CB settings no longer apply
        if overrides.get("use_transformers_continuous_batching"):
            raise ValueError("use_vllm=True and use_transformers_continuous_batching=True: choose one generation "
                             "backend.")
        values = {k: v for k, v in values.items() if not k.startswith(("use_transformers", "transformers_"))}
    kwargs: dict[str, Any] = {
        "use_transformers_continuous_batching": not overrides.get("use_vllm", False),
        "bf16": native_bf16(),  # TRL defaults bf16=True even on CPU
        # cbkit's loop keeps the learning rate constant, without warmup; TRL's default decays it linearly to 0.
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        **_counted_in_trl_units(values),
        **{_RENAMED.get(k, k): v for k, v in values.items()},
        **overrides,
    }
    if kwargs["use_transformers_continuous_batching"]:  # + return_logprobs=True, checked
        kwargs["transformers_continuous_batching_config"] = cb_config_values(
            kwargs.get("transformers_continuous_batching_config"))
    return GRPOConfig(output_dir=str(output_dir), **kwargs)


def cbkit_values(cfg: Any) -> dict[str, Any]:
    """The cbkit fields `cfg` sets. A dict must hold only cbkit fields; an object is read by attribute name."""
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        unknown = [k for k in cfg if k not in CBKIT_FIELDS]
        if unknown:
            raise ValueError(f"Unknown cbkit config field(s) {did_you_mean(unknown, CBKIT_FIELDS)}. cbkit fields: "
                             f"{', '.join(sorted(CBKIT_FIELDS))}. TRL-only settings go in the keyword overrides "
                             "under TRL's names, e.g. trl_grpo_config(cfg, output_dir, logging_steps=1).")
        values = dict(cfg)
    else:
        values = {k: getattr(cfg, k) for k in CBKIT_FIELDS if hasattr(cfg, k)}
    if isinstance(cfg, CBGRPOConfig) and cfg.reward_weights is None:  # cbkit's per-reward defaults (format 0.5)
        values["reward_weights"] = [DEFAULT_REWARD_WEIGHTS.get(name, 1.0) for name in cfg.reward_funcs]
    paged = values.pop("use_transformers_paged", None)
    if paged is not None:
        values["use_transformers_continuous_batching"] = continuous_batching_flag(
            paged, values.get("use_transformers_continuous_batching", True))
    return values


def _counted_in_trl_units(values: dict[str, Any]) -> dict[str, Any]:
    """Pop the fields TRL counts in other units (a step is `num_iterations` updates); return them in TRL's."""
    iterations = int(values.get("num_iterations", 1) or 1)
    out: dict[str, Any] = {}
    values.pop("reward_funcs", None)
    if "max_steps" in values:
        out["max_steps"] = int(values.pop("max_steps")) * iterations
    if "save_steps" in values:
        save = int(values.pop("save_steps"))
        out.update({"save_steps": save * iterations} if save else {"save_strategy": "no"})
    if "eval_steps" in values:  # TRL evaluates eval_dataset every eval_steps updates, and before the first one
        every = int(values.pop("eval_steps"))
        out.update({"eval_strategy": "steps", "eval_steps": every * iterations, "eval_on_start": True} if every
                   else {"eval_strategy": "no"})
    if "eval_num_generations" in values:
        out["num_generations_eval"] = int(values.pop("eval_num_generations"))
    if "prompts_per_step" in values:
        completions = int(values.pop("prompts_per_step")) * int(values.get("num_generations", 8))
        ga = int(values.get("gradient_accumulation_steps", 1) or 1)
        if completions % ga:
            raise ValueError(f"prompts_per_step x num_generations = {completions} completions do not split into "
                             f"gradient_accumulation_steps={ga} equal micro-batches (TRL's per-device batch).")
        out["per_device_train_batch_size"] = completions // ga
    return out


def trl_dataset(problems, system_prompt: str | None = SYSTEM_PROMPT):
    """cbkit `Problem`s as the dataset TRL expects: a conversational `prompt` column and the gold `answer`."""
    from datasets import Dataset

    head = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return Dataset.from_dict({
        "prompt": [head + [{"role": "user", "content": p.question}] for p in problems],
        "answer": [p.answer for p in problems],
    })


class TRLReward:
    """A cbkit reward `fn(completions, answers)` as TRL calls it, `__name__` kept; a class so it pickles like `fn`."""

    def __init__(self, fn: Callable[[list[str], list[str]], list[float]], answer_column: str = "answer") -> None:
        self.fn = fn
        self.answer_column = answer_column
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        if self.answer_column not in kwargs:
            # TRL passes these besides prompts, completions and the dataset's columns.
            extra = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
            raise ValueError(f"reward {self.__name__!r} needs the gold answers in a dataset column "
                             f"{self.answer_column!r}; the columns TRL passed are "
                             f"{sorted(k for k in kwargs if k not in extra)}. Add the column or pass answer_column=.")
        # A chat completion (a list of messages) is its assistant text.
        texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions or []]
        return reward_scores(self.__name__, self.fn, texts, [str(a) for a in kwargs[self.answer_column]])


def _is_trl_native(fn) -> bool:
    """TRL reward functions must take **kwargs (TRL passes trainer_state, log_extra, ...); cbkit's never do."""
    return isinstance(fn, str | torch.nn.Module | TRLReward) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def trl_rewards(reward_funcs, reward_weights=None, cfg: Any = None, answer_column: str = "answer"):
    """TRL's reward list and weights by the loop's rules (`resolve_rewards`), cbkit rewards wrapped in `TRLReward`.
    Without `reward_weights`, the config's matched by name; neither: None (TRL's 1.0 each)."""
    if reward_weights is None and cfg is not None:
        values = cbkit_values(cfg)
        names, reward_weights = values.get("reward_funcs"), values.get("reward_weights")
        if reward_weights is not None and names is not None and isinstance(reward_funcs, Mapping):
            reward_weights = {n: float(w) for n, w in zip(names, reward_weights, strict=True) if n in reward_funcs}
    funcs, weights = resolve_rewards(reward_funcs, reward_weights, names_are_builtin=False)
    adapted = [f if _is_trl_native(f) else TRLReward(f, answer_column) for f in funcs.values()]
    return adapted, None if reward_weights is None else weights
