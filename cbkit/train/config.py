"""The run's config: TRL 1.16's `GRPOConfig` names where TRL has the concept, only the fields the loop reads, and
`__post_init__` the one home of every check of a value (its type, then its range), each error saying what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

from cbkit.models.load import training_precision
from cbkit.tasks.data import SYSTEM_PROMPT
from cbkit.train.objective import IS_MODES, LOSS_TYPES

SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
STALE_ROLLOUTS = ("regenerate", "drop")
SNAPSHOT_PLACES = ("device", "host", "disk")  # where cbkit.train.snapshots.WeightSnapshots keeps a copy
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")  # TRL's names (TrainingArguments.optim) for torch's AdamW
# Fields a resumed run may change: how long and where it goes, or how (not what) it computes.
RESUMABLE_CHANGES = ("max_steps", "output_dir", "save_steps", "save_total_limit", "disable_tqdm",
                     "forward_chunk_rows", "eval_steps", "rollout_snapshots", "optim")
# Range checks by table, {lowest value: fields}; None passes where a field allows it.
BOUNDS = {1: ("prompts_per_step", "max_completion_length", "num_iterations", "gradient_accumulation_steps",
              "max_steps", "save_total_limit", "eval_num_problems", "eval_num_generations", "forward_chunk_rows",
              "num_problems", "async_update_at"),
          0: ("top_k", "beta", "max_grad_norm", "save_steps", "eval_steps", "rollout_staleness", "max_staleness")}
POSITIVE = ("temperature", "epsilon", "epsilon_high", "learning_rate", "clip_max")


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass
class CBGRPOConfig:
    """Everything one cbkit GRPO run needs; each field's help text is in its metadata (`cbkit train --help`)."""

    # --- model and prompts (cbkit's own) ---
    model: str = _help("Policy: 'smollm2-offline', 'tiny', a hub id or a local directory.", default="smollm2-offline")
    dtype: str = _help("Autocast over fp32 weights: 'auto' (bf16 where native), 'float32', 'bfloat16'.", default="auto")
    data: str = _help("Prompts: 'synthetic', 'gsm8k-local[:split]', 'gsm8k[:split]', 'reasoning-gym:<name>' or "
                      "a .jsonl path.", default="synthetic")
    data_options: dict[str, Any] = _help("A reasoning-gym source's config, e.g. {min_digits: 1}.", default_factory=dict)
    num_problems: int | None = _help("Cap on the problems loaded (None: all).", default=None)
    system_prompt: str | None = _help("System prompt of every chat prompt (None: none).", default=SYSTEM_PROMPT)
    prompts_per_step: int = _help("Prompts per step, each with num_generations completions.", default=2)
    # --- sampling (TRL names) ---
    num_generations: int = _help("Completions per prompt (the group size N), at least 2.", default=8)
    max_completion_length: int = _help("Most tokens generated per completion.", default=256)
    temperature: float = _help("Sampling temperature; the training forward divides by it too, as TRL.", default=1.0)
    top_p: float = _help("Nucleus sampling mass in (0, 1]; 1.0 disables it.", default=1.0)
    top_k: int = _help("Keep the top_k most likely tokens; 0 disables it.", default=0)
    # --- rewards ---
    reward_funcs: list[str] = _help("Reward functions: 'correctness', 'format', 'verified'.",
                                    default_factory=lambda: ["correctness", "format"])
    reward_weights: list[float] | None = _help("One weight per reward function (None: defaults).", default=None)
    # --- the objective (TRL names and meanings) ---
    loss_type: str = _help(f"Loss aggregation, one of {LOSS_TYPES}.", default="dapo")
    scale_rewards: str = _help(f"Advantage scaling by the std of the {SCALE_REWARDS}.", default="group")
    advantage_estimator: str = _help(f"Baseline, one of {ADVANTAGE_ESTIMATORS}.", default="grpo")
    beta: float = _help("KL coefficient to the initial policy; 0.0 loads no reference model.", default=0.0)
    epsilon: float = _help("Lower clip of the policy ratio: 1 - epsilon.", default=0.2)
    epsilon_high: float | None = _help("Upper clip: 1 + epsilon_high (None: epsilon).", default=None)
    kl_bias_correction: bool = _help("Multiply the KL term by the policy ratio (TRL's).", default=True)
    num_iterations: int = _help("Optimizer updates per rollout (TRL's mu).", default=1)
    gradient_accumulation_steps: int = _help("Micro-batches per update, dividing the step's completions.", default=1)
    forward_chunk_rows: int | None = _help("Completions per training forward (None: a micro-batch).", default=4)
    mask_truncated_completions: bool = _help("Leave truncated completions out of the loss.", default=False)
    # --- importance-sampling correction (TRL: vllm_importance_sampling_*) ---
    importance_sampling_correction: bool = _help("Weigh the loss by exp(old - sampling) logprobs.", default=True)
    importance_sampling_mode: str = _help(f"One of {IS_MODES}.", default="sequence_mask")
    clip_max: float = _help("Upper bound of the IS ratio (not the policy ratio's epsilon).", default=3.0)
    clip_min: float | None = _help("Lower bound of the IS ratio (None: none).", default=None)
    # --- off-policy rollouts (cbkit.train.offpolicy) ---
    rollout_staleness: int = _help("Sample from the weights of this many updates earlier (0: on-policy).", default=0)
    rollout_snapshots: str = _help(f"Where older weights wait, one of {SNAPSHOT_PLACES}.", default="host")
    async_rollouts: bool = _help("Decode the next step's rollout in the CB engine during this step.", default=False)
    async_update_at: int = _help("Async: the engine forward of a rollout at which new weights land.", default=8)
    max_staleness: int = _help("Async: most updates a token may lag the loss's policy.", default=4)
    stale_rollouts: str = _help(f"A too-old rollout is, one of {STALE_ROLLOUTS}.", default="regenerate")
    # --- rollout engine (TRL names) ---
    use_transformers_continuous_batching: bool = _help("Roll out with transformers' CB engine (else generate()).",
                                                       default=True)
    transformers_continuous_batching_config: dict[str, Any] = _help(
        "ContinuousBatchingConfig fields you set, over cbkit's defaults.", default_factory=dict)
    use_transformers_paged: bool | None = _help("Deprecated: use use_transformers_continuous_batching.", default=None)
    # --- optimisation (TRL names) ---
    learning_rate: float = _help("AdamW learning rate, constant.", default=1e-5)
    weight_decay: float = _help("AdamW weight decay.", default=0.0)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon.", default=1e-8)
    optim: str = _help(f"torch's AdamW kernel, one of {OPTIMIZERS}.", default="adamw_torch_fused")
    max_grad_norm: float = _help("Clip the gradient's global norm to this; 0 disables clipping.", default=1.0)
    # --- the run ---
    max_steps: int = _help("Steps to train (a rollout and num_iterations updates each).", default=20)
    seed: int = _help("Seeds the data order, every rollout's sampler and the RNGs.", default=0)
    output_dir: str | None = _help("Where metrics.jsonl and checkpoint-<step>/ go (None: nowhere).", default=None)
    save_steps: int = _help("Checkpoint every save_steps steps and at the end; 0 disables it.", default=10)
    save_total_limit: int = _help("Keep this many newest checkpoints.", default=1)
    disable_tqdm: bool = _help("No progress bar.", default=False)
    # --- held-out evaluation (cbkit.train.evaluate) ---
    eval_steps: int = _help("Evaluate held-out accuracy at step 0 and every eval_steps; 0: never.", default=0)
    eval_data: str | None = _help("Source of the held-out problems (None: the training source).", default=None)
    eval_num_problems: int = _help("Held-out problems (distinct questions).", default=64)
    eval_num_generations: int = _help("Completions per held-out problem.", default=4)

    def __post_init__(self) -> None:
        from cbkit.rollout.engine_config import make_cb_config

        _check_types(self)  # first: every check below compares values of the declared types
        self.use_transformers_continuous_batching = continuous_batching_flag(self.use_transformers_paged,
                                                                             self.use_transformers_continuous_batching)
        self.use_transformers_paged = None  # forwarded: a round trip does not warn again
        make_cb_config(self.transformers_continuous_batching_config)  # unknown keys, bad values: say so now

        def bad(msg: str) -> None:
            raise ValueError(msg)

        for name, valid in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                            ("advantage_estimator", ADVANTAGE_ESTIMATORS), ("importance_sampling_mode", IS_MODES),
                            ("optim", OPTIMIZERS), ("stale_rollouts", STALE_ROLLOUTS),
                            ("rollout_snapshots", SNAPSHOT_PLACES)):
            if getattr(self, name) not in valid:
                bad(f"{name}={getattr(self, name)!r} is not supported; use one of {', '.join(map(repr, valid))}.")
        training_precision(self.dtype, "cpu")  # an unknown name, float16; bf16 on a GPU without it: the trainer
        for least, names in BOUNDS.items():
            for name in names:
                if getattr(self, name) is not None and getattr(self, name) < least:
                    bad(f"{name}={getattr(self, name)} must be >= {least}.")
        for name in POSITIVE:
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                bad(f"{name}={getattr(self, name)} must be > 0.")
        if self.num_generations < 2:
            bad(f"num_generations={self.num_generations}: group-relative advantages need at least 2 completions "
                "per prompt (with 1 every advantage is 0); set num_generations >= 2.")
        if self.advantage_estimator == "rloo" and self.scale_rewards == "group":
            bad("advantage_estimator='rloo' has no per-group scaling (as TRL's RLOO); set scale_rewards='none' "
                "(RLOO's default) or 'batch'.")
        batch = self.prompts_per_step * self.num_generations
        if batch % self.gradient_accumulation_steps:
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            bad(f"prompts_per_step x num_generations = {batch} completions do not split into "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} equal micro-batches; use one of "
                f"{divisors}, or change prompts_per_step.")
        if not 0 < self.top_p <= 1:
            bad(f"top_p={self.top_p} must be in (0, 1]; 1.0 disables nucleus sampling.")
        if self.clip_min is not None and not 0 <= self.clip_min <= self.clip_max:
            bad(f"clip_min={self.clip_min} must be in [0, clip_max={self.clip_max}]; lower it, raise clip_max, or "
                "set it to None.")
        if self.async_rollouts:
            if not self.use_transformers_continuous_batching:
                bad("async_rollouts=True queues requests in transformers' continuous batching engine; set "
                    "use_transformers_continuous_batching=True, or async_rollouts=False.")
            if self.rollout_staleness:
                bad(f"async_rollouts=True with rollout_staleness={self.rollout_staleness}: choose one (set "
                    "rollout_staleness=0 or async_rollouts=False).")
            if self.eval_steps:
                bad("eval_steps with async_rollouts=True: the evaluation would sample while the async engine "
                    "decodes. Set eval_steps=0 and evaluate the run's checkpoints, or use the synchronous loop.")
        if self.data_options and not self.data.startswith("reasoning-gym:"):
            bad(f"data_options are knobs of a reasoning-gym source, but data={self.data!r}; remove data_options or "
                "use data='reasoning-gym:<dataset>'.")
        if not self.reward_funcs:
            bad("reward_funcs is empty; name at least one reward function (e.g. 'correctness').")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            bad(f"reward_weights has {len(self.reward_weights)} entries for {len(self.reward_funcs)} reward_funcs "
                f"{self.reward_funcs}; give one weight per function, or None for all 1.0.")

    @property
    def backend(self) -> str:
        return "continuous" if self.use_transformers_continuous_batching else "generate"

    @property
    def per_device_train_batch_size(self) -> int:
        """TRL's micro-batch in completions: a step's rollout is gradient_accumulation_steps of them."""
        return self.prompts_per_step * self.num_generations // self.gradient_accumulation_steps

    def cb_overrides(self) -> dict[str, Any]:
        return dict(self.transformers_continuous_batching_config)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CBGRPOConfig:
        """Build from a dict (a checkpoint's config.json, CLI flags); unknown keys are an error naming the close ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in names]
        if unknown:
            raise ValueError(f"Unknown config field(s) {did_you_mean(unknown, names)}. Fields: {', '.join(names)}.")
        return cls(**values)

    def diff(self, other: CBGRPOConfig, ignore: tuple[str, ...] = RESUMABLE_CHANGES) -> dict[str, tuple[Any, Any]]:
        """{name: (self's, other's)} for fields that differ, but `ignore`; CB configs when their engine settings do."""
        from cbkit.rollout.engine_config import cb_config_values

        a, b = self.to_dict(), other.to_dict()
        out = {k: (a[k], b[k]) for k in a if k not in ignore and a[k] != b[k]}
        cb = "transformers_continuous_batching_config"
        if cb in out and cb_config_values(a[cb]) == cb_config_values(b[cb]):
            del out[cb]
        return out


def did_you_mean(names: list[str], known: Any) -> str:
    hints = [(n, difflib.get_close_matches(n, known, n=1)) for n in names]
    return ", ".join(f"{n!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for n, c in hints)


def same_as(name: str, *, aliases: tuple[str, ...] = (), **kw: Any) -> Any:
    """A field of another command's config that means `CBGRPOConfig.<name>`, with its help text (and flag `aliases`)."""
    text = next(f.metadata["help"] for f in dataclasses.fields(CBGRPOConfig) if f.name == name)
    return field(metadata={"help": text, **({"aliases": list(aliases)} if aliases else {})}, **kw)


def continuous_batching_flag(use_transformers_paged: bool | None, use_transformers_continuous_batching: bool) -> bool:
    """The rollout engine switch with TRL's deprecated `use_transformers_paged` (None: not set) forwarded."""
    if use_transformers_paged is None:
        return use_transformers_continuous_batching
    warnings.warn("use_transformers_paged is deprecated (as in TRL); use use_transformers_continuous_batching. "
                  f"Setting use_transformers_continuous_batching={bool(use_transformers_paged)}.", FutureWarning,
                  stacklevel=4)
    return bool(use_transformers_paged)


def read_recipe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields a recipe file sets, unchecked (`CBGRPOConfig.from_dict` checks and converts them)."""
    import yaml  # transformers' own dependency

    with open(path) as f:
        values = yaml.safe_load(f)
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a YAML mapping of config fields (e.g. `num_generations: 8`), "
                         f"not {type(values).__name__}.")
    return values


# --- every field against its annotation, generically ---

_NAMES: dict[Any, tuple[str, str, Any]] = {  # (one, several, an example)
    int: ("an integer", "integers", 1), float: ("a number", "numbers", 0.5),
    bool: ("true or false", "true/false", True), str: ("a string", "strings", "text")}


def _check_types(config: Any) -> None:
    """Give each field its annotation's type where nothing is lost (`1` -> `1.0`, "5e-5"), else raise with an example."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        try:
            converted = _as_type(value, hint)
        except TypeError:
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            kind, example = _describe(hint)
            example = example if default is None or len(repr(default)) > 40 else default
            shown = example if isinstance(example, str) else json.dumps(example)  # YAML's flow style
            raise ValueError(f"{f.name}={value!r} ({type(value).__name__}) is not {kind}; "
                             f"e.g. `{f.name}: {shown}` in a recipe.") from None
        if converted is not value:
            setattr(config, f.name, converted)


def _as_type(value: Any, hint: Any) -> Any:
    """`value` as a `hint`, the same object where it already is one; a TypeError where it is not one."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType):  # X | None
        return None if value is None else _as_type(value, args[0])
    if typing.get_origin(hint) is list and isinstance(value, list | tuple):
        items = [_as_type(v, args[0]) for v in value]
        return value if type(value) is list and all(a is b for a, b in zip(items, value, strict=True)) else items
    if isinstance(value, typing.get_origin(hint) or hint) and (hint is bool or not isinstance(value, bool)):
        return value  # a dict, a string, a bool (YAML's true/false: 0 and 1 are not switches), a number of its type
    if hint in (int, float) and isinstance(value, numbers.Real | str) and not isinstance(value, bool):
        try:
            number = value if isinstance(value, numbers.Integral) else float(value)
        except ValueError:
            raise TypeError from None
        if hint is float or float(number).is_integer():
            return hint(number)
    raise TypeError


def _describe(hint: Any, plural: bool = False) -> tuple[str, Any]:
    """(how an error names the type `hint`, an example of it)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType):  # X | None: an example of X
        return " or ".join("null" if a is type(None) else _describe(a, plural)[0] for a in args), _describe(args[0])[1]
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(args[0], plural=True)[0]}", [_describe(args[0])[1]]
    if typing.get_origin(hint) is dict:
        return "a mapping", {}
    one, several, example = _NAMES[hint]
    return several if plural else one, example
