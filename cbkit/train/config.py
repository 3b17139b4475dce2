"""The run's config: one dataclass, TRL 1.16's `GRPOConfig` names wherever TRL has the concept, only the fields the
loop reads (`cbkit.trl.config` maps it onto TRL's field by field). The IS settings drop TRL's `vllm_` prefix: cbkit
corrects its own CB rollouts. Every check in `__post_init__` says what to change, before a model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from cbkit.models.load import training_precision
from cbkit.tasks.data import SYSTEM_PROMPT
from cbkit.train.field_types import check_field_types
from cbkit.train.objective import IS_MODES, LOSS_TYPES

SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
STALE_ROLLOUTS = ("regenerate", "drop")
# Where a copy of the weights can wait (cbkit.train.snapshots.WeightSnapshots), and what each costs.
SNAPSHOT_PLACES = {"device": "a copy on the model's device (GPU memory on a GPU)",
                   "host": "a copy in CPU memory, pinned where CUDA is (host RAM, no GPU memory)",
                   "disk": "a file in a temporary folder (no memory)"}
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")  # TRL's names (TrainingArguments.optim) for torch's AdamW
# Fields a resumed run may change: how long and where it goes, or how (not what) it computes.
RESUMABLE_CHANGES = ("max_steps", "output_dir", "save_steps", "save_total_limit", "disable_tqdm",
                     "forward_chunk_rows", "eval_steps", "rollout_snapshots", "optim")


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass
class CBGRPOConfig:
    """Everything one cbkit GRPO run needs. `CBGRPOConfig.help()` prints every field with its help text."""

    # --- model and prompts (cbkit's own) ---
    model: str = _help("Policy to train: 'smollm2-offline', 'tiny' (tests), a hub id or a local directory.",
                       default="smollm2-offline")
    dtype: str = _help("Autocast over the fp32 weights: 'auto' (bf16 on a GPU with native bf16, else fp32), "
                       "'float32' or 'bfloat16'; 'float16' is refused (no loss scaling here).", default="auto")
    data: str = _help("Prompt source: 'synthetic' (offline), 'gsm8k-local[:split]', 'gsm8k[:split]' (hub) or a "
                      ".jsonl path.", default="synthetic")
    data_options: dict[str, Any] = _help("A reasoning-gym source's difficulty knobs (reasoning_gym.create_dataset "
                                         "config), e.g. {min_digits: 1, max_digits: 1}; empty for other sources.",
                                         default_factory=dict)
    num_problems: int | None = _help("Cap on the number of problems loaded (None: all; generated sources make 256).",
                                     default=None)
    system_prompt: str | None = _help("System prompt for every chat prompt; None sends the user turn alone. "
                                      "Default: cbkit.tasks.data.SYSTEM_PROMPT (asks for '#### <number>').",
                                      default=SYSTEM_PROMPT)
    prompts_per_step: int = _help("Prompts per step; each gets num_generations completions. TRL derives this from "
                                  "per_device_train_batch_size x steps_per_generation / num_generations.", default=2)
    # --- sampling (TRL names) ---
    num_generations: int = _help("Completions per prompt (N, the group size). At least 2: a group of 1 has no "
                                 "baseline.", default=8)
    max_completion_length: int = _help("Most tokens generated per completion.", default=256)
    temperature: float = _help("Sampling temperature; the training forward divides its logits by it too, as TRL.",
                               default=1.0)
    top_p: float = _help("Nucleus sampling mass in (0, 1]; 1.0 disables it. See cbkit.train.grpo on top-p and the IS "
                         "correction.", default=1.0)
    top_k: int = _help("Keep only the top_k most likely tokens; 0 disables it.", default=0)
    # --- rewards (TRL: reward_funcs is a trainer argument, reward_weights a config field) ---
    reward_funcs: list[str] = _help("Reward functions by name (cbkit.tasks.rewards: 'correctness', 'format', "
                                    "'verified' (math-verify)). GRPOTrainer(reward_funcs=...) takes callables instead.",
                                    default_factory=lambda: ["correctness", "format"])
    reward_weights: list[float] | None = _help("One weight per reward function. None: 1.0 each (TRL), except "
                                               "cbkit.tasks.rewards.DEFAULT_REWARD_WEIGHTS for the built-ins "
                                               "(correctness 1.0, format 0.5).", default=None)
    # --- the objective (TRL names and meanings) ---
    loss_type: str = _help(f"How the per-token loss becomes a scalar: one of {LOSS_TYPES} (TRL's definitions; "
                           "'dapo' is TRL's default).", default="dapo")
    scale_rewards: str = _help(f"Advantage scaling: one of {SCALE_REWARDS}: divide by the group's std, the "
                               "batch's, or not at all (Dr. GRPO).", default="group")
    advantage_estimator: str = _help(f"Baseline: one of {ADVANTAGE_ESTIMATORS}: the group mean (GRPO) or the "
                                     "mean of the other N-1 (RLOO).", default="grpo")
    beta: float = _help("KL coefficient to a frozen copy of the initial policy. 0.0 loads no reference model.",
                        default=0.0)
    epsilon: float = _help("Lower clip of the policy ratio: 1 - epsilon.", default=0.2)
    epsilon_high: float | None = _help("Upper clip: 1 + epsilon_high (DAPO's clip-higher); None uses epsilon.",
                                       default=None)
    kl_bias_correction: bool = _help("Multiply the KL term by the policy ratio (TRL's use_bias_correction_kl, "
                                     "default True there too); only matters with beta > 0.", default=True)
    num_iterations: int = _help("Optimizer updates per rollout (TRL's mu): the rollout is reused this many "
                                "times.", default=1)
    gradient_accumulation_steps: int = _help("Micro-batches per optimizer update; must divide "
                                             "prompts_per_step x num_generations.", default=1)
    forward_chunk_rows: int | None = _help(
        "Completions per teacher-forced forward: each chunk's loss is back-propagated at once, so one chunk's "
        "activations and logits are alive (the same gradient to float rounding). None: a whole micro-batch.",
        default=4)
    mask_truncated_completions: bool = _help("Leave completions that hit max_completion_length out of the loss "
                                             "(they still count in the advantages).", default=False)
    # --- importance-sampling correction (TRL: vllm_importance_sampling_*) ---
    importance_sampling_correction: bool = _help("Weigh the loss by exp(old - sampling) logprobs, correcting for the "
                                                 "rollout engine differing from the training forward.", default=True)
    importance_sampling_mode: str = _help(f"One of {IS_MODES}: per token or per sequence, clamp (truncate) or "
                                          "zero (mask) ratios outside [clip_min, clip_max]. TRL's default.",
                                          default="sequence_mask")
    clip_max: float = _help("Upper bound of the importance-sampling ratio (TRL's vllm_importance_sampling_clip_max, "
                            "C_max); not the policy ratio's clip (epsilon).", default=3.0)
    clip_min: float | None = _help("Lower bound of the importance-sampling ratio (TRL's "
                                   "vllm_importance_sampling_clip_min); None: no lower bound.", default=None)
    # --- off-policy rollouts (cbkit.train.offpolicy; TRL's AsyncGRPOConfig names where it has the concept) ---
    rollout_staleness: int = _help("Sample step t's rollout from the policy of this many optimizer updates earlier (an "
                                   "exact weight snapshot) while the loss uses the current one; 0 is the on-policy "
                                   "loop. No TRL twin: TRL's staleness is whatever its async queue gives.", default=0)
    rollout_snapshots: str = _help("Where rollout_staleness keeps the last k + 1 versions of the weights: 'device', "
                                   "'host' (no GPU memory, two transfers a step) or 'disk' (no memory; "
                                   "cbkit.train.snapshots).", default="host")
    async_rollouts: bool = _help("Decode step t+1's rollout in the CB engine while step t trains; a completion can "
                                 "straddle an update (TRL: AsyncGRPOTrainer). Needs the continuous backend.",
                                 default=False)
    async_update_at: int = _help("Async only: the engine forward of the next rollout before which the new weights "
                                 "land (pinned: reproducible and resumable).", default=8)
    max_staleness: int = _help("Async only: a rollout holding a token sampled more than this many updates before "
                               "the loss's policy is too old (TRL AsyncGRPOConfig's name and meaning).", default=4)
    stale_rollouts: str = _help(f"What to do with a too-old rollout: one of {STALE_ROLLOUTS}: sample it again on "
                                "the current weights, or drop its groups (TRL drops).", default="regenerate")
    # --- rollout engine (TRL names) ---
    use_transformers_continuous_batching: bool = _help("Roll out with transformers' continuous batching engine (True) "
                                                       "or one static padded generate() batch (False).", default=True)
    transformers_continuous_batching_config: dict[str, Any] = _help(
        "ContinuousBatchingConfig fields you set; the engine gets cbkit's defaults (max_memory_percent=0.5, "
        "use_cuda_graph=False: cbkit.rollout.engine_config.CB_DEFAULTS) under them.", default_factory=dict)
    use_transformers_paged: bool | None = _help("Deprecated: use use_transformers_continuous_batching.", default=None)
    # --- optimisation (TRL names) ---
    learning_rate: float = _help("AdamW learning rate, constant (TRL's default is 1e-6 with linear decay; short "
                                 "runs on small models need more).", default=1e-5)
    weight_decay: float = _help("AdamW weight decay.", default=0.0)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon.", default=1e-8)
    optim: str = _help("torch's AdamW kernel (TRL's names): 'adamw_torch_fused' (TRL's default) or 'adamw_torch'; "
                       "the same update to float rounding.", default="adamw_torch_fused")
    max_grad_norm: float = _help("Clip the gradient's global norm to this; 0 disables clipping.", default=1.0)
    # --- the run ---
    max_steps: int = _help("Steps to train; one step = one rollout and num_iterations optimizer updates.", default=20)
    seed: int = _help("Seeds the data order, every rollout's sampler and torch/python/numpy RNGs.", default=0)
    output_dir: str | None = _help("Where metrics.jsonl and checkpoint-<step>/ go; None writes nothing.", default=None)
    save_steps: int = _help("Checkpoint every save_steps steps and at the end; 0 disables checkpoints.", default=10)
    save_total_limit: int = _help("Keep this many newest checkpoints.", default=1)
    disable_tqdm: bool = _help("No progress bar.", default=False)
    # --- held-out evaluation (cbkit.train.evaluate; TRL: eval_strategy='steps', eval_steps) ---
    eval_steps: int = _help("Evaluate on the held-out set before training and every eval_steps steps (and after the "
                            "last); 0 disables it. eval/accuracy is math-verify's score, whatever the training "
                            "reward.", default=0)
    eval_data: str | None = _help("Source of the held-out problems; None: the training source (with another seed "
                                  "for generated ones). Their questions are removed from the training problems.",
                                  default=None)
    eval_num_problems: int = _help("Held-out problems (distinct questions; fewer if the source has fewer).", default=64)
    eval_num_generations: int = _help("Completions sampled per held-out problem, at the training temperature.",
                                      default=4)

    def __post_init__(self) -> None:
        check_field_types(self)  # first: every check below compares values of the declared types
        self.use_transformers_continuous_batching = continuous_batching_flag(self.use_transformers_paged,
                                                                             self.use_transformers_continuous_batching)
        self.use_transformers_paged = None  # forwarded: a round trip does not warn again
        self._check()
        from cbkit.rollout.engine_config import make_cb_config

        make_cb_config(self.transformers_continuous_batching_config)  # unknown keys, bad values: say so now

    def _check(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        def one_of(name: str, valid: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in valid:
                bad(f"{name}={value!r} is not supported; use one of {', '.join(map(repr, valid))}.")

        one_of("loss_type", LOSS_TYPES)
        one_of("scale_rewards", SCALE_REWARDS)
        one_of("advantage_estimator", ADVANTAGE_ESTIMATORS)
        one_of("importance_sampling_mode", IS_MODES)
        one_of("optim", OPTIMIZERS)
        # What no device allows (an unknown name, float16) fails here; bf16 on a GPU without it, in the trainer.
        training_precision(self.dtype, "cpu")
        if self.num_generations < 2:
            bad(f"num_generations={self.num_generations}: group-relative advantages need at least 2 completions "
                "per prompt (with 1 every advantage is 0); set num_generations >= 2.")
        if self.advantage_estimator == "rloo" and self.scale_rewards == "group":
            bad("advantage_estimator='rloo' has no per-group scaling (as TRL's RLOO); set scale_rewards='none' "
                "(RLOO's default) or 'batch'.")
        for name in ("prompts_per_step", "max_completion_length", "num_iterations", "gradient_accumulation_steps",
                     "max_steps", "save_total_limit"):
            if getattr(self, name) < 1:
                bad(f"{name}={getattr(self, name)} must be >= 1.")
        if self.forward_chunk_rows is not None and self.forward_chunk_rows < 1:
            bad(f"forward_chunk_rows={self.forward_chunk_rows} must be >= 1, or None for the whole micro-batch.")
        batch = self.prompts_per_step * self.num_generations
        if batch % self.gradient_accumulation_steps:
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            bad(f"prompts_per_step x num_generations = {batch} completions do not split into "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} equal micro-batches; use one of "
                f"{divisors}, or change prompts_per_step.")
        if not self.temperature > 0:
            bad(f"temperature={self.temperature} must be > 0 (GRPO samples; greedy rollouts give a group no spread).")
        if not 0 < self.top_p <= 1:
            bad(f"top_p={self.top_p} must be in (0, 1]; 1.0 disables nucleus sampling.")
        if self.top_k < 0:
            bad(f"top_k={self.top_k} must be >= 0; 0 disables top-k.")
        if not self.epsilon > 0:
            bad(f"epsilon={self.epsilon} must be > 0: the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high].")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            bad(f"epsilon_high={self.epsilon_high} must be > 0, or None to use epsilon.")
        if self.beta < 0:
            bad(f"beta={self.beta} must be >= 0 (0 disables the KL term and the reference model).")
        if not self.learning_rate > 0:
            bad(f"learning_rate={self.learning_rate} must be > 0.")
        if self.max_grad_norm < 0:
            bad(f"max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables clipping).")
        if self.save_steps < 0:
            bad(f"save_steps={self.save_steps} must be >= 0 (0 disables checkpoints).")
        if self.num_problems is not None and self.num_problems < 1:
            bad(f"num_problems={self.num_problems}: load at least 1 problem, or None for all.")
        cmax, cmin = self.clip_max, self.clip_min
        if not cmax > 0:
            bad(f"clip_max={cmax} must be > 0 (TRL's default is 3.0).")
        if cmin is not None and not 0 <= cmin <= cmax:
            bad(f"clip_min={cmin} must be in [0, clip_max={cmax}]; "
                "lower it, raise clip_max, or set it to None.")
        one_of("stale_rollouts", STALE_ROLLOUTS)
        if self.rollout_snapshots not in SNAPSHOT_PLACES:
            bad(f"rollout_snapshots={self.rollout_snapshots!r} is not a place for weight snapshots; use one of "
                + "; ".join(f"{k!r}: {v}" for k, v in SNAPSHOT_PLACES.items()) + ".")
        for name in ("rollout_staleness", "max_staleness"):
            if getattr(self, name) < 0:
                bad(f"{name}={getattr(self, name)} must be >= 0 (0: the rollout comes from the policy the loss uses).")
        if self.async_rollouts:
            if not self.use_transformers_continuous_batching:
                bad("async_rollouts=True queues requests in transformers' continuous batching engine; the 'generate' "
                    "backend has no queue. Set use_transformers_continuous_batching=True, or async_rollouts=False.")
            if self.rollout_staleness:
                bad(f"async_rollouts=True with rollout_staleness={self.rollout_staleness}: choose one. Async "
                    "rollouts are as stale as the overlap makes them (bounded by max_staleness); rollout_staleness "
                    "fixes the lag of a synchronous loop. Set rollout_staleness=0 or async_rollouts=False.")
            if self.async_update_at < 1:
                bad(f"async_update_at={self.async_update_at} must be >= 1 (the engine forwards of the next rollout "
                    "that run on the old weights before the update lands).")
        if self.eval_steps < 0:
            bad(f"eval_steps={self.eval_steps} must be >= 0 (0: no held-out evaluation).")
        for name in ("eval_num_problems", "eval_num_generations"):
            if getattr(self, name) < 1:
                bad(f"{name}={getattr(self, name)} must be >= 1.")
        if self.eval_steps and self.async_rollouts:
            bad("eval_steps with async_rollouts=True: the held-out evaluation would sample while the async engine "
                "decodes the next rollout on the same cores and random-number stream. Set eval_steps=0 and "
                "evaluate the run's checkpoints, or use the synchronous loop.")
        if not isinstance(self.data_options, dict):
            bad(f"data_options={self.data_options!r} must be a mapping of a reasoning-gym dataset's config fields.")
        if self.data_options and not self.data.startswith("reasoning-gym:"):
            bad(f"data_options are knobs of a reasoning-gym source, but data={self.data!r}; remove data_options or "
                "use data='reasoning-gym:<dataset>'.")
        if not self.reward_funcs:
            bad("reward_funcs is empty; name at least one reward function (e.g. 'correctness').")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            bad(f"reward_weights has {len(self.reward_weights)} entries for {len(self.reward_funcs)} reward_funcs "
                f"{self.reward_funcs}; give one weight per function, or None for all 1.0.")

    # --- derived ---------------------------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The rollout backend's name in `cbkit.rollout.make_backend`."""
        return "continuous" if self.use_transformers_continuous_batching else "generate"

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def per_device_train_batch_size(self) -> int:
        """TRL's name for the micro-batch, in completions: one step's rollout is gradient_accumulation_steps of
        them (TRL's steps_per_generation defaults to gradient_accumulation_steps), which is how
        `cbkit.trl.config` maps prompts_per_step onto TRL."""
        return self.completions_per_step // self.gradient_accumulation_steps

    def resolved_reward_weights(self) -> list[float]:
        if self.reward_weights is not None:
            return list(self.reward_weights)
        from cbkit.tasks.rewards import DEFAULT_REWARD_WEIGHTS

        return [DEFAULT_REWARD_WEIGHTS.get(name, 1.0) for name in self.reward_funcs]

    def cb_overrides(self) -> dict[str, Any]:
        """The CB keys the user set: what the backend is handed, and `make_cb_config` merges cbkit's defaults under.

        The config keeps only the user's keys, so `make_cb_config`'s CPU rule sees what the *user* chose: it sizes
        the KV pool to the workload unless they fixed it (a default memory share would mean half of host RAM).
        """
        return dict(self.transformers_continuous_batching_config)

    # --- (de)serialisation ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CBGRPOConfig:
        """Build from a dict (a checkpoint's config.json, CLI flags); unknown keys are an error naming the close ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in names]
        if unknown:
            hints = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
            said = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            raise ValueError(f"Unknown config field(s) {said}. Fields: {', '.join(names)}.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> CBGRPOConfig:
        """Build from a run recipe: a YAML (or JSON) mapping of these fields, the file `cbkit train --config`
        reads. It is the format TRL's `TrlParser --config` reads for its own dataclasses, so a recipe is also
        `cbkit.trl.config.trl_grpo_config(CBGRPOConfig.from_yaml(path))`."""
        return cls.from_dict(read_recipe(path))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def diff(self, other: CBGRPOConfig, ignore: tuple[str, ...] = RESUMABLE_CHANGES) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ, as {name: (self's, other's)}, leaving out `ignore`. CB configs differ when they
        resolve to different engine settings: a default spelled out (as configs saved before the defaults stopped
        being merged in hold them) is the default."""
        from cbkit.rollout.engine_config import cb_config_values

        a, b = self.to_dict(), other.to_dict()
        out = {k: (a[k], b[k]) for k in a if k not in ignore and a[k] != b[k]}
        cb = "transformers_continuous_batching_config"
        if cb in out and cb_config_values(a[cb]) == cb_config_values(b[cb]):
            del out[cb]
        return out

    @classmethod
    def help(cls) -> str:
        return "\n".join(f"{f.name}: {f.metadata['help']}" for f in dataclasses.fields(cls))


def same_as(name: str, *, aliases: tuple[str, ...] = (), **kw: Any) -> Any:
    """A field of another command's config (`cbkit demo`, `cbkit plan`) that means what `CBGRPOConfig`'s `name`
    means: its help text is that field's, so the flags of two commands cannot drift apart. ``aliases`` are more
    flag spellings (``-N``); ``kw`` the field's own default."""
    text = next(f.metadata["help"] for f in dataclasses.fields(CBGRPOConfig) if f.name == name)
    return field(metadata={"help": text, **({"aliases": list(aliases)} if aliases else {})}, **kw)


def continuous_batching_flag(use_transformers_paged: bool | None, use_transformers_continuous_batching: bool) -> bool:
    """The rollout engine switch, with TRL's deprecated `use_transformers_paged` forwarded to it (None: not set):
    the one place the old name is read, by `CBGRPOConfig` and by the TRL bridge's dicts alike."""
    if use_transformers_paged is None:
        return use_transformers_continuous_batching
    warnings.warn(
        "use_transformers_paged is deprecated (as in TRL); use use_transformers_continuous_batching. "
        f"Setting use_transformers_continuous_batching={bool(use_transformers_paged)}.",
        FutureWarning,
        stacklevel=4,
    )
    return bool(use_transformers_paged)


def read_recipe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields a recipe file sets, unchecked (`CBGRPOConfig.from_dict` checks them)."""
    import yaml  # transformers' own dependency (its HfArgumentParser reads YAML)

    with open(path) as f:
        values = yaml.safe_load(f)
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a YAML mapping of config fields (e.g. `num_generations: 8`), "
                         f"not {type(values).__name__}.")
    # PyYAML follows YAML 1.1, where `5e-5` (no dot) is a string, not a number: read it as the number it means.
    return {k: float(v) if isinstance(v, str) and _EXPONENT_FLOAT.fullmatch(v) else v for k, v in values.items()}


_EXPONENT_FLOAT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")
