"""TRL's trainers with CB rollouts that keep the engine's sampling logprobs. Released TRL asks the CB engine for no
logprobs and gates its IS correction on vLLM; `CBLogprobGRPOTrainer` makes the smallest change that lets it run."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation

from cbkit.models.load import pretrained_kwargs
from cbkit.rollout.base import SamplingParams
from cbkit.rollout.engine import Engine, to_completions
from cbkit.train.order import mix_seed
from cbkit.trl.config import trl_grpo_config, trl_rewards


class CBLogprobGRPOTrainer(GRPOTrainer):
    """TRL's CB branch through cbkit's engine (a seed per call), and `use_vllm` as the gate of TRL's IS lines."""

    args: Any  # a GRPOConfig (the type checker reads Trainer's TrainingArguments)
    _cb_calls = 0  # rollouts so far in this process: part of each call's engine seed
    _cb_engine: Engine | None = None
    _is_gate_open = False

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completion ids cut after the first stop id, and their sampling logprobs, from cbkit's engine, one per row
        of `prompt_ids` (already repeated N times; text only: TRL refuses a multimodal processor on the CB path)."""
        max_new_tokens = self.max_completion_length
        if max_new_tokens is None:
            raise ValueError("max_completion_length=None: CB rollouts through cbkit's engine need a cap on the "
                             "completion length; set max_completion_length in the TRL config.")
        rows = [list(p) for p in prompt_ids]
        unwrap = unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                             gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                             gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
        with (profiling_context(self, "transformers.generate_batch"), unwrap as unwrapped, torch.no_grad(),
              self._dist.summon_full_params(self.model_wrapped, recurse=False)):
            # TRL casts the model itself to bf16 for good; the bridge samples from half copies instead.
            half = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
            keep = unwrapped.lm_head if getattr(self.args, "cast_lm_head_to_fp32", False) else None
            was_training = unwrapped.training
            seed = mix_seed(int(self.args.seed), self.accelerator.process_index, self._cb_calls)
            self._cb_calls += 1
            if self._cb_engine is None or self._cb_engine.model is not unwrapped:
                self._cb_engine = Engine(unwrapped, self.args.transformers_continuous_batching_config)
            with half_weights_for_rollout(unwrapped, half, keep=keep), plain_forward(unwrapped):
                outputs, _ = self._cb_engine.run(rows, self.generation_config, max_new_tokens=max_new_tokens,
                                                 seed=seed)
            unwrapped.train(was_training)
        sampling = SamplingParams(max_new_tokens=max_new_tokens, eos_token_id=tuple(self.eos_token_ids))
        completions = to_completions(rows, outputs, 1, sampling)  # raises where the engine returned no logprobs
        return [list(c.completion_ids) for c in completions], [list(c.sampling_logprobs or ()) for c in completions]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's `train`, then the model's own `forward` back (accelerate's wrapper breaks later CB rollouts)."""
        names = ("forward", "_original_forward")
        found = {k: v for k, v in self.model.__dict__.items() if k in names}
        try:
            return super().train(*args, **kwargs)
        finally:
            for k in names:
                self.model.__dict__.pop(k, None)
            self.model.__dict__.update(found)

    def __init__(self, model, reward_funcs=None, args=None, *pos, **kwargs):
        if args is None or not getattr(args, "use_transformers_continuous_batching", False):
            raise ValueError("CBLogprobGRPOTrainer is for the continuous batching path: pass args with "
                             "use_transformers_continuous_batching=True (trl_grpo_config sets it).")
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        # TRL checks this in __init__ only when use_vllm is True (grpo_trainer.py, `loss_type == "vespo"`).
        if (self.loss_type == "vespo" and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError(f"loss_type='vespo' needs importance_sampling_mode 'token_truncate' or 'token_mask', "
                             f"got {self.vllm_importance_sampling_mode!r}.")
        truncated = (self.top_p is not None and self.top_p < 1.0) or (self.top_k or 0) > 0 or self.min_p
        if self.vllm_importance_sampling_correction and truncated:
            warnings.warn(f"IS correction with top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}: the sampling "
                          "logprobs are of the truncated distribution, TRL's of the full one, so the IS ratio is "
                          "biased below 1. Use top_p=1.0, top_k=0 for an unbiased correction.", stacklevel=2)

    # The gate: `use_vllm` reads True only where TRL computes and applies the IS ratio.
    @property
    def use_vllm(self) -> bool:
        return self._is_gate_open

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        if value:  # TRL's __init__ assigns args.use_vllm
            raise ValueError("use_vllm=True: TRL's vLLM path already returns sampling logprobs and runs the IS "
                             "correction; use trl.GRPOTrainer (build_trainer picks it), or set use_vllm=False.")

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
        # out[4]: the per-token sampling logprobs (None from a rollout_func that has none). Open the gate for the
        # rest of _generate_and_score_completions (TRL's one caller) only when there is something to correct with.
        self._is_gate_open = out[4] is not None and bool(self.vllm_importance_sampling_correction)
        return out

    def _generate_and_score_completions(self, inputs):
        with self._gate(False):  # closed again on the way out, whatever _generate opened
            return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model, inputs):
        with self._gate("importance_sampling_ratio" in inputs):
            return super()._compute_loss(model, inputs)


@contextmanager
def half_weights_for_rollout(model: torch.nn.Module, dtype: torch.dtype | None, *,
                             keep: torch.nn.Module | None = None) -> Iterator[None]:
    """Inside the block ``model``'s float weights are ``dtype`` copies (``keep``'s stay), after it the fp32 tensors
    again: TRL's in-place ``model.to(dtype)`` would round away every update under half of bf16's spacing."""
    kept = {id(t) for t in (*keep.parameters(), *keep.buffers())} if keep is not None else set()
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in (*model.parameters(), *model.buffers()):
        if dtype is not None and t.is_floating_point() and t.dtype != dtype and id(t) not in kept:
            saved.append((t, t.data))
            t.data = t.data.to(dtype)
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data


@contextmanager
def plain_forward(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s own ``forward`` inside the block: accelerate's mixed-precision one calls ``.float()`` on the CB
    engine's ``PagedAttentionCache`` and kills its loop."""
    # Without the instance's wrapper, the class's forward shows through.
    wrapped = model.__dict__.pop("forward", None) if "_original_forward" in model.__dict__ else None
    try:
        yield
    finally:
        if wrapped is not None:
            model.forward = wrapped


def build_trainer(model, tokenizer, reward_funcs, train_dataset, cfg: Any = None, *, output_dir: str = "cbkit-trl",
                  reward_weights: Mapping[str, float] | Sequence[float] | None = None, answer_column: str = "answer",
                  eval_dataset=None, callbacks=None, **overrides: Any):
    """TRL's GRPO trainer for a cbkit run, the bridge's on the CB path; `overrides`: GRPOConfig arguments."""
    funcs, weights = trl_rewards(reward_funcs, reward_weights, cfg, answer_column)
    if weights is not None:
        overrides = {**overrides, "reward_weights": weights}
    if eval_dataset is None:  # the config's eval_steps needs a held-out set TRL can read: none given, none evaluated
        overrides = {"eval_strategy": "no", "eval_on_start": False, **overrides}
    args = trl_grpo_config(cfg, output_dir, **overrides)
    if isinstance(model, str):  # TRL loads it with these: hub kernels off as in cbkit's loads, unless the caller says
        args.model_init_kwargs = {**pretrained_kwargs(), **(args.model_init_kwargs or {})}
    cls = CBLogprobGRPOTrainer if args.use_transformers_continuous_batching and not args.use_vllm else GRPOTrainer
    return cls(model=model, reward_funcs=funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
               processing_class=tokenizer, callbacks=callbacks)


def is_metrics(logs: Mapping[str, float]) -> dict[str, float]:
    """TRL's importance-sampling metrics from a log record (empty when the correction did not run)."""
    return {k: v for k, v in logs.items() if k.startswith("sampling/") and not math.isnan(float(v))}
