"""The GRPO loop, top to bottom: prompts -> rollout -> rewards -> advantages -> old logprobs -> loss -> update.

Read `GRPOTrainer.step` first: it is the whole algorithm, one stage per line, and every stage is a method you
can call on its own (the tests do). The maths lives in `cbkit.train.objective` (checked against TRL 1.16's own code);
this file only moves data between the stages and makes them observable through `cbkit.train.hooks`.

What one step does
------------------
1. take `prompts_per_step` prompts (a seeded order, reshuffled each epoch; the position is checkpointed);
2. roll out N completions per prompt through any `RolloutBackend` (transformers' CB engine by default), each
   with its *sampling logprobs*; the rollout is validated where it enters;
3. score every completion with each reward function and sum them with their weights;
4. turn rewards into group-relative advantages (GRPO: group mean and std; RLOO: leave-one-out);
5. teacher-force the completions through the policy *before any update* ("old" logprobs). That forward also
   gives `logprob/*`: how far the engine's sampling logprobs are from the trainer's on the same weights;
6. importance-sampling (IS) weights exp(old - sampling) correct for the engine not being the training forward
   (other kernels, paged attention, maybe bf16); released TRL skips this on its CB path because it drops the
   engine's logprobs, cbkit keeps them;
7. `num_iterations` times: `gradient_accumulation_steps` micro-batches of policy forward + clipped loss +
   backward, then clip the gradient norm and take one AdamW step.

Policy logprobs divide the logits by the sampling temperature, as TRL's do: the ratio compares the policy with
itself at the temperature it was sampled at.

Top-p / top-k: a decision
-------------------------
With `top_p < 1` or `top_k > 0` the sampler draws from a *truncated* distribution, while TRL's trainer recomputes
logprobs from temperature only. Comparing the two, as TRL does, makes every IS ratio smaller than 1 by the mass
the truncation removed: not a kernel mismatch but a different distribution. Per token that quietly rescales
the learning rate; per sequence (TRL's default mode) the product over a long completion falls toward 0, and
`logprob/*` reports a large "mismatch" on a correct engine.

cbkit computes the IS reference, and the `logprob/*` metrics, under the *same processed distribution* the
sampler used (`objective.replayed_logprobs`: the run's temperature, top-k and top-p), so the ratio compares
like with like and is ~1 on unchanged weights. A sampled token the trainer's recomputed nucleus leaves out (a
rounding difference at the boundary is enough) is kept inside its own support rather than given -inf, which
would zero its ratio and, per sequence, the whole completion's loss; `logprob/outside_support_tokens` counts
them. The loss's policy ratio stays temperature-only, like TRL's: a truncated policy would give -inf to any token
that leaves the nucleus after an update. What this does not do
is correct for the truncation itself (tokens outside the nucleus are never sampled, no weight can fix that);
`logprob/temperature_only_max_abs_diff` reports its size. The trainer warns once when truncation is on.

What this loop simplifies, relative to TRL's GRPOTrainer, and why
-----------------------------------------------------------------
* One process, one device. Scale-out is TRL's job (`cbkit.trl.config`, `accelerate launch`), not a second
  distributed engine here.
* One rollout per step, `num_iterations` updates per rollout. TRL's `steps_per_generation` /
  `generation_batch_size` decouple these; fixing them keeps "step" meaning one thing.
* Old logprobs are always recomputed (one no-grad forward), even when `num_iterations == 1` where TRL reuses
  the detached current logprobs: the IS weights and `logprob/*` need them anyway, and the loop keeps one shape.
* Constant learning rate, AdamW (`optim`: fused by default, as TRL's): no scheduler, no warmup. Runs here are tens
  of steps.
* Dropout stays off (the model is kept in eval mode), like TRL's `disable_dropout=True`: the ratio must compare
  the same function, not two dropout masks.
* The reference model (beta > 0) is a frozen copy of the policy as loaded; no `sync_ref_model`.
* Text only, single turn, no tools; reward functions take `(completions, answers)` rather than TRL's kwargs.
  A reward that raises or returns a non-finite value stops the run with its name and the completion; TRL turns
  a None into NaN and the NaN into advantage 0.
* Full fp32 logits per chunk of `forward_chunk_rows` completions (each chunk forwarded, scored and back-propagated
  on its own, so the step's memory grows with the chunk, not with N; the rows taken longest first, so a chunk pads
  only to rows of about its own length; no vocabulary-streaming or Liger LM head, no padding-free packing): fine for
  the small models this kit trains on one machine;
  `cbkit.train.batch.micro_batches_for` picks `gradient_accumulation_steps` for a logits budget (the notebooks' GPU
  tiers do), or lower `max_completion_length`.
* Precision: the weights that train are fp32 on every device; the config's `dtype` is the precision the training
  forwards compute in, an autocast over those weights (`cbkit.models.load.training_precision`: 'auto' is bf16 where
  the GPU has it natively, fp32 elsewhere; fp16 is refused, as this loop does no loss scaling). Plain bf16 weights
  under AdamW would lose every update smaller than bf16's spacing, so a half-precision policy is refused. The rollout
  samples from the same fp32 weights.
* The loss variants, IS modes and what the objective leaves out are listed in `cbkit.train.objective`.

Checkpoints (`cbkit.train.checkpoint`) hold the model, optimizer, step, data position, RNG states and config; resuming
with a config that computes something else is refused with the list of differing fields.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from cbkit.models.load import training_precision
from cbkit.rollout import Rollout, RolloutBackend, SamplingParams, make_backend
from cbkit.rollout.engine import engine_is_idle
from cbkit.tasks.data import Problem
from cbkit.tasks.rewards import RewardFn, compute_rewards, resolve_rewards
from cbkit.train import checkpoint
from cbkit.train.batch import Batch, completion_logits
from cbkit.train.config import CBGRPOConfig
from cbkit.train.evaluate import build_held_out, eval_sampling, without_held_out
from cbkit.train.hooks import (
    CheckpointHook,
    JSONLHook,
    NaNGuardHook,
    ProgressBarHook,
    StepHooks,
    StepRecord,
    TrainState,
)
from cbkit.train.objective import (
    chunk_share,
    group_advantages,
    grpo_loss,
    importance_weights,
    policy_logprobs,
    replayed_logprobs,
)
from cbkit.train.offpolicy import STATE_FILE as OFFPOLICY_STATE
from cbkit.train.offpolicy import AsyncRollouts, LaggedRollouts, drift_metrics
from cbkit.train.setup import set_up_run

METRICS_FILE = "metrics.jsonl"


@dataclass
class Prepared:
    """Everything the updates of one step need, computed once per rollout (reused `num_iterations` times)."""

    batch: Batch
    advantages: Tensor  # [B]
    old_logps: Tensor  # [B, T] temperature-only, before any update: the policy ratio's denominator
    ref_logps: Tensor | None  # [B, T] reference model, only when beta > 0
    is_weights: Tensor | None  # [B, T], None when the correction is off
    loss_mask: Tensor  # [B, T] completion tokens that count in the loss
    metrics: dict[str, float]


class GRPOTrainer:
    """cbkit's GRPO trainer. `GRPOTrainer(config).train()` runs it; `step()` runs one step."""

    def __init__(
        self,
        config: CBGRPOConfig,
        policy: Any = None,
        backend: RolloutBackend | None = None,
        reward_funcs: Mapping[str, RewardFn] | Sequence[RewardFn] | None = None,
        hooks: Sequence[StepHooks] = (),
        problems: Sequence[Problem] | None = None,
    ) -> None:
        if policy is None:
            from cbkit.models.load import load_policy

            policy = load_policy(config.model, dtype="float32", seed=config.seed)  # `dtype` is the autocast, below
        model, tokenizer = policy  # a LoadedPolicy or a (model, tokenizer) pair
        check_fp32_weights(model)
        check_text_only(tokenizer, model, config.use_transformers_continuous_batching)  # before any prompt is built
        # The run set-up the sweep and the demo share: problems, prompt ids, stop and pad ids.
        run = set_up_run(config.model, config.data, config.num_problems, seed=config.seed, policy=policy,
                         problems=problems, system_prompt=config.system_prompt, options=config.data_options)
        # The held-out set is drawn first and its questions leave the training problems (cbkit.train.evaluate).
        self.held_out = build_held_out(config, run.tokenizer) if config.eval_steps else None
        if self.held_out is not None:
            kept = without_held_out(run.problems, self.held_out.problems)
            run.prompts = [run.prompts[i] for i, p in enumerate(run.problems) if p in kept]
            run.problems = kept
        self.run_setup = run
        self.model, self.tokenizer = run.model, run.tokenizer
        self.model.eval()  # dropout off for the whole run (see the module docstring)
        self.device = next(self.model.parameters()).device
        # The training forwards' autocast over the fp32 weights, or None (see the module docstring).
        self.autocast_dtype = training_precision(config.dtype, self.device)
        self.pad_token_id, self.stop_ids = run.pad_token_id, run.stop_ids
        # The attention the training forward must run with; a CB engine that leaves it switched would make the
        # forward silently non-causal (transformers #48296), so every forward checks it (`_check_attention`).
        self.attn_implementation = self.model.config._attn_implementation

        self.reward_funcs, weights = _resolve_rewards(config, reward_funcs)
        self.config = dataclasses.replace(config, reward_funcs=list(self.reward_funcs), reward_weights=weights)
        self.problems, self.prompt_ids = run.problems, run.prompts
        self.order = PromptOrder(len(self.problems), config.seed)

        backend_given = backend is not None
        if backend is None:
            backend = make_backend(config.backend, self.model, cb_config=config.cb_overrides(),
                                   pad_token_id=self.pad_token_id)
        if not isinstance(backend, RolloutBackend):
            raise TypeError(
                f"backend must implement cbkit.rollout.RolloutBackend (a `name` and "
                f"`generate(prompts, num_generations, sampling, *, prompt_names=None) -> Rollout`); got "
                f"{type(backend).__name__}."
            )
        self.backend = backend
        # Held-out evaluation runs through the CB engine whatever the training rollouts use, so runs that train
        # with generate() and with CB are scored by the same sampler; a CB training backend is reused.
        self.eval_backend = None
        if self.held_out is not None:
            self.eval_backend = backend if backend.name == "continuous" else make_backend(
                "continuous", self.model, cb_config=config.cb_overrides(), pad_token_id=self.pad_token_id)
        # Off-policy rollouts (cbkit.train.offpolicy): None is the on-policy loop, untouched.
        self.policy_version = 0  # optimizer updates so far: the version a rollout records for its tokens
        self.offpolicy = _offpolicy(self, backend_given=backend_given)
        self.ref_model = _frozen_copy(self.model) if config.beta > 0 else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay,
            fused=config.optim == "adamw_torch_fused",
        )
        self.truncates = config.top_p < 1 or config.top_k > 0
        if self.truncates:
            warnings.warn(
                f"top_p={config.top_p}, top_k={config.top_k}: the rollout samples from a truncated distribution. "
                "cbkit computes the importance-sampling reference under that same truncated distribution, so the "
                "IS ratio measures engine-vs-trainer mismatch only (TRL compares with temperature-only logprobs, "
                "which shrinks every ratio by the truncated mass). The loss's policy ratio stays temperature-only "
                "and the truncation itself is not corrected; logprob/temperature_only_max_abs_diff shows its size. "
                "See cbkit.train.grpo's docstring.",
                UserWarning,
                stacklevel=2,
            )

        output_dir = Path(config.output_dir) if config.output_dir else None
        self.state = TrainState(step=0, max_steps=config.max_steps, config=self.config, output_dir=output_dir)
        self.data_position = 0
        self._rng_at_step_end = checkpoint.capture_rng()
        self.hooks: list[StepHooks] = [NaNGuardHook()]
        if output_dir is not None:
            self.hooks.append(JSONLHook(output_dir / METRICS_FILE))
            if config.save_steps:
                self.hooks.append(CheckpointHook(self.save_checkpoint, config.save_steps))
        if not config.disable_tqdm:
            self.hooks.append(ProgressBarHook())
        self.hooks.extend(hooks)

    # --- the run --------------------------------------------------------------------------------------------

    def train(self, resume_from: str | Path | bool | None = None) -> TrainState:
        """Run until `max_steps`. `resume_from=True` resumes from the newest checkpoint in `output_dir`."""
        if resume_from:
            self.resume(resume_from)
        else:
            self._refuse_to_overwrite()
            seed_everything(self.config.seed)
            self._rng_at_step_end = checkpoint.capture_rng()
        status = "failed"
        try:
            for h in self.hooks:
                h.on_train_begin(self.state)
            if self.held_out is not None and self.state.step == 0:  # the step-0 point of every held-out curve
                record = StepRecord(0, self.evaluate())
                for h in self.hooks:
                    h.on_step_end(record)
            while self.state.step < self.config.max_steps:
                self.step()
            status = "finished"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self.state.status = status
            for h in self.hooks:
                h.on_train_end(self.state)
            self.close()
        return self.state

    def close(self) -> None:
        """Stop an async rollout engine's thread (a no-op for the on-policy loop); `train()` calls it at the end."""
        if self.offpolicy is not None:
            self.offpolicy.close()

    def step(self) -> StepRecord:
        """One GRPO step. Each line is a stage; each stage is a method below."""
        start = time.perf_counter()
        step = self.state.step + 1
        for h in self.hooks:
            h.on_step_begin(step)
        indices = self.order.indices(self.data_position, self.config.prompts_per_step)
        if self.offpolicy is None:
            rollout, offpolicy_metrics, scored = self.rollout(indices, step), {}, indices
        else:  # an older policy's rollout, or the one that decoded while the last step trained
            rollout, offpolicy_metrics, scored = self.offpolicy.rollout(self, indices, step)
        for h in self.hooks:
            h.on_rollout_end(rollout)
        rewards, metrics = self.score(rollout, [self.problems[i] for i in scored])
        metrics.update(offpolicy_metrics)
        train_start = time.perf_counter()  # training = old-logprob forward + updates: what the rollout is not
        prepared = self.prepare(rollout, rewards)
        metrics.update(prepared.metrics)
        metrics.update(self.optimize(prepared))
        if self.offpolicy is not None:
            metrics.update(self.offpolicy.after_step(self, step))
        metrics["train/seconds"] = time.perf_counter() - train_start
        metrics["step/seconds"] = time.perf_counter() - start
        if self.held_out is not None and (step % self.config.eval_steps == 0 or step == self.config.max_steps):
            metrics.update(self.evaluate())  # timed on its own: eval/seconds, not in step/seconds

        self.state.step, self.data_position = step, self.data_position + len(indices)
        self._rng_at_step_end = checkpoint.capture_rng()
        self.state.resumable = True
        record = StepRecord(step, metrics)
        try:
            for h in self.hooks:
                h.on_step_end(record)
        except Exception:
            self.state.resumable = False  # e.g. the NaN guard: this step's update is in the weights, keep it off disk
            raise
        return record

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy of the current weights (`cbkit.train.evaluate`): the run's evidence that it learns."""
        if self.held_out is None:
            raise ValueError("This run has no held-out set: set eval_steps > 0 in its config.")
        sampling = eval_sampling(self.sampling_params(0))
        return self.held_out.evaluate(self.eval_backend, sampling,
                                      lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                                      self.reward_funcs)

    # --- the stages -----------------------------------------------------------------------------------------

    def sampling_params(self, step: int) -> SamplingParams:
        c = self.config
        # A seed per (run, step): a resumed run draws exactly what the uninterrupted one would have.
        return self.run_setup.sampling(c.max_completion_length, temperature=c.temperature, top_p=c.top_p,
                                       top_k=c.top_k, seed=mix_seed(c.seed, step))

    def rollout(self, indices: Sequence[int], step: int, backend: RolloutBackend | None = None) -> Rollout:
        """N completions for each prompt, checked against the contract and against what was asked."""
        n = self.config.num_generations
        backend = self.backend if backend is None else backend
        rollout = backend.generate(
            [self.prompt_ids[i] for i in indices], n, self.sampling_params(step),
            prompt_names=[self.problems[i].id for i in indices],
        )
        rollout.validate()
        if rollout.num_generations != n or len(rollout.completions) != n * len(indices):
            raise ValueError(
                f"Backend {backend.name!r} returned {len(rollout.completions)} completions in groups of "
                f"{rollout.num_generations} for {len(indices)} prompts x num_generations={n}; expected "
                f"{n * len(indices)} in groups of {n}."
            )
        return rollout

    def score(self, rollout: Rollout, problems: Sequence[Problem]) -> tuple[Tensor, dict[str, Any]]:
        """Weighted sum of the reward functions per completion, plus reward/completion/rollout metrics."""
        texts = [self.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in rollout.completions]
        answers = [problems[c.group].answer for c in rollout.completions]
        summed, per_reward = compute_rewards(texts, answers, self.reward_funcs, self.config.reward_weights,
                                             num_generations=rollout.num_generations)
        total = torch.tensor(summed, dtype=torch.float64)
        metrics: dict[str, Any] = {k: torch.tensor(v, dtype=torch.float64).mean().item() for k, v in per_reward.items()}
        groups = total.view(-1, rollout.num_generations)
        lengths = torch.tensor([len(c.completion_ids) for c in rollout.completions], dtype=torch.float64)
        metrics.update({
            "reward/mean": total.mean().item(),
            "reward/std": total.std().item(),
            # Groups whose N rewards are all equal have advantage 0 everywhere: they teach nothing this step.
            "reward/zero_std_frac": (groups.std(dim=1) == 0).double().mean().item(),
            "completion/mean_length": lengths.mean().item(),
            "completion/max_length": int(lengths.max()),
            "completion/truncated_frac": sum(c.finish_reason == "length" for c in rollout.completions) / len(texts),
            "rollout/seconds": rollout.wall_s,
            "rollout/tokens_per_s": rollout.tokens_per_s,
            "rollout/completion_tokens": rollout.completion_tokens,
            "rollout/peak_mem_bytes": rollout.peak_mem_bytes,
            "rollout/backend": rollout.backend,
        })
        return total, metrics

    def prepare(self, rollout: Rollout, rewards: Tensor) -> Prepared:
        """Advantages, old (and reference) logprobs on the current weights, IS weights, the loss mask."""
        c = self.config
        advantages = group_advantages(rewards, c.num_generations, c.scale_rewards, c.advantage_estimator)
        batch = Batch.from_completions(rollout.completions, self.pad_token_id, self.device,
                                       with_logprobs=rollout.has_logprobs)
        old, old_processed, outside = self._old_logprobs(self.model, batch)
        ref = self._old_logprobs(self.ref_model, batch)[0] if self.ref_model is not None else None
        # The whole completion mask, truncated completions included: their weights never reach the loss when
        # they are masked, and `logprob/*` should describe every token the engine sampled.
        weights, metrics = importance_weights(
            old_processed, batch.sampling_logps, batch.completion_mask, c.importance_sampling_mode,
            c.clip_max, c.clip_min,
        )
        if self.truncates and batch.sampling_logps is not None:
            gap = (batch.sampling_logps - old).abs()[batch.completion_mask]
            metrics["logprob/temperature_only_max_abs_diff"] = gap.max().item()
            # Sampled tokens the trainer's own nucleus left out, put back into it (objective.replayed_logprobs).
            metrics["logprob/outside_support_tokens"] = float((outside & batch.completion_mask).sum().item())
        if self.offpolicy is not None:
            metrics.update(drift_metrics(old_processed, batch.sampling_logps, batch.completion_mask,
                                         c.importance_sampling_mode))
        if not c.importance_sampling_correction:
            weights, metrics["is/skipped"] = None, 1.0
        loss_mask = batch.completion_mask
        if c.mask_truncated_completions:
            loss_mask = loss_mask & ~batch.truncated.unsqueeze(-1)
        return Prepared(batch, advantages.float().to(self.device), old, ref, weights, loss_mask, metrics)

    def optimize(self, prepared: Prepared) -> dict[str, float]:
        """`num_iterations` optimizer updates on one prepared rollout; metrics averaged over them."""
        losses, norms, others = [], [], []
        for _ in range(self.config.num_iterations):
            metrics = self.accumulate_gradients(prepared)
            losses.append(metrics.pop("train/loss"))
            others.append(metrics)
            norms.append(self.optimizer_step())
        out = {k: sum(m[k] for m in others) / len(others) for k in others[0]}
        out.update({"train/loss": sum(losses) / len(losses), "train/grad_norm": sum(norms) / len(norms),
                    "train/learning_rate": self.optimizer.param_groups[0]["lr"]})
        return out

    def accumulate_gradients(self, prepared: Prepared) -> dict[str, float]:
        """Fresh gradients of one optimizer update, summed over `gradient_accumulation_steps` micro-batches."""
        c, p = self.config, prepared
        self._check_attention()
        self.optimizer.zero_grad(set_to_none=True)
        ga = c.gradient_accumulation_steps
        size = len(p.batch) // ga
        # dapo divides by the tokens of the whole update, not of one micro-batch: what makes accumulation exact.
        num_items = p.loss_mask.sum()
        loss_sum, sums = 0.0, {}
        for k in range(ga):
            micro_mask = p.loss_mask[k * size : (k + 1) * size]
            # A micro-batch a chunk of rows at a time, each chunk's loss scaled to its share of the micro-batch's
            # and back-propagated at once: only one chunk's activations and logits are alive (objective.chunk_share).
            for rows in _chunks(k * size, (k + 1) * size, c.forward_chunk_rows, p.batch.attention_mask):
                mb = p.batch.take(rows)
                t = mb.completion_width
                logps = policy_logprobs(completion_logits(self.model, mb, self.autocast_dtype), mb.completion_ids,
                                        c.temperature)
                loss, metrics = grpo_loss(
                    logps, p.old_logps[rows, :t], p.advantages[rows], p.loss_mask[rows, :t],
                    loss_type=c.loss_type, epsilon=c.epsilon, epsilon_high=c.epsilon_high, beta=c.beta,
                    ref_logps=None if p.ref_logps is None else p.ref_logps[rows, :t],
                    is_weights=None if p.is_weights is None else p.is_weights[rows, :t],
                    max_completion_length=c.max_completion_length, num_items_in_batch=num_items,
                    gradient_accumulation_steps=ga, kl_bias_correction=c.kl_bias_correction,
                )
                loss_share, token_share = chunk_share(c.loss_type, p.loss_mask[rows], micro_mask)
                (loss * loss_share).backward()
                loss_sum += loss.item() * loss_share
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value * token_share / ga
        return {"train/loss": loss_sum, **sums}

    def optimizer_step(self) -> float:
        """Clip the gradient norm, take one AdamW step; returns the norm before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        self.state.resumable = False  # from here until the step ends, the weights belong to no finished step
        self.optimizer.step()
        self.policy_version += 1
        if self.offpolicy is not None:
            self.offpolicy.after_update(self)
        return norm

    # --- checkpoints ----------------------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        if self.state.output_dir is None:
            raise ValueError("save_checkpoint needs config.output_dir.")
        path = checkpoint.save_checkpoint(
            self.state.output_dir, step, model=self.model, optimizer=self.optimizer, config=self.config,
            trainer_state={"data_position": self.data_position}, rng=self._rng_at_step_end,
            keep=self.config.save_total_limit,
        )
        if self.offpolicy is not None:  # the older weights the next rollout starts from
            torch.save(self.offpolicy.state_dict(), path / OFFPOLICY_STATE)
        return path

    def resume(self, resume_from: str | Path | bool) -> Path:
        """Load a checkpoint (True: the newest in output_dir) after checking it was made with this config."""
        if resume_from is True:
            if self.state.output_dir is None:
                raise ValueError("resume_from=True looks in config.output_dir, which is not set.")
            path = checkpoint.latest_checkpoint(self.state.output_dir)
            if path is None:
                raise FileNotFoundError(f"No checkpoint-<step> directory in {self.state.output_dir} to resume from.")
        else:
            path = Path(resume_from)
        checkpoint.check_same_config(checkpoint.read_config(path), self.config, path)
        trainer_state, rng = checkpoint.load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.state.step, self.data_position = trainer_state["step"], trainer_state["data_position"]
        self.state.resumed_from = path
        self.policy_version = self.state.step * self.config.num_iterations
        if self.offpolicy is not None:
            self.offpolicy.load_state_dict(torch.load(path / OFFPOLICY_STATE, weights_only=True), self)
        checkpoint.restore_rng(rng)
        self._rng_at_step_end = rng
        return path

    # --- helpers --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _old_logprobs(self, model, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """Temperature-only and sampler-processed logprobs [B, T], one no-grad forward per chunk of a micro-batch
        (`forward_chunk_rows`); and [B, T]
        True where a sampled token lay outside the trainer's replayed nucleus (kept in it, see `replayed_logprobs`)."""
        self._check_attention()
        c = self.config
        size = len(batch) // c.gradient_accumulation_steps
        plain = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=self.device)
        processed = plain.clone() if self.truncates else plain
        outside = torch.zeros(batch.completion_ids.shape, dtype=torch.bool, device=self.device)
        for rows in (r for start in range(0, len(batch), size)
                     for r in _chunks(start, start + size, c.forward_chunk_rows, batch.attention_mask)):
            mb = batch.take(rows)
            t = mb.completion_width
            logits = completion_logits(model, mb, self.autocast_dtype)
            plain[rows, :t] = policy_logprobs(logits, mb.completion_ids, c.temperature)
            if self.truncates:
                processed[rows, :t], outside[rows, :t] = replayed_logprobs(
                    logits, mb.completion_ids, c.temperature, c.top_k, c.top_p)
            del logits  # one chunk's logits alive at a time
        return plain, processed, outside

    def _check_attention(self) -> None:
        impl = self.model.config._attn_implementation
        if impl != self.attn_implementation or not engine_is_idle(self.model):
            raise RuntimeError(
                f"The model's attention is {impl!r} (it was {self.attn_implementation!r} when training began) or a "
                "continuous batching engine is still running on it. A plain forward in that state can run without "
                "a causal mask (transformers issue #48296), so the loss would be silently wrong. Stop the CB "
                "manager (which restores the attention implementation) before a training forward."
            )

    def _refuse_to_overwrite(self) -> None:
        out = self.state.output_dir
        if out is None:
            return
        metrics = out / METRICS_FILE
        if checkpoint.checkpoints(out) or (metrics.exists() and metrics.stat().st_size > 0):
            raise FileExistsError(
                f"{out} already holds a run (checkpoints or {METRICS_FILE}). Resume it with resume_from=True "
                "(cbkit train --resume), or choose an empty output_dir."
            )


class PromptOrder:
    """Which problem comes at each position: a seeded shuffle per epoch, so a position alone decides it."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError("No problems to train on: the dataset is empty.")
        self.n, self.seed = n, seed
        self._epochs: dict[int, list[int]] = {}

    def indices(self, position: int, count: int) -> list[int]:
        return [self._epoch(p // self.n)[p % self.n] for p in range(position, position + count)]

    def _epoch(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            order = list(range(self.n))
            random.Random(mix_seed(self.seed, epoch)).shuffle(order)
            self._epochs[epoch] = order
        return self._epochs[epoch]


# --- input checks ---------------------------------------------------------------------------------------------


def check_text_only(processing_class: Any, model: Any, continuous_batching: bool) -> None:
    """Refuse multimodal processors and models: rollouts here are token ids in, token ids out."""
    parts = [a for a in ("image_processor", "video_processor", "feature_extractor", "audio_processor")
             if getattr(processing_class, a, None) is not None]
    vision = getattr(getattr(model, "config", None), "vision_config", None) is not None
    if parts or vision:
        what = f"{type(processing_class).__name__} (has {', '.join(parts)})" if parts else "a vision-language model"
        engine = ("transformers' continuous batching engine takes token ids only, no pixel values"
                  if continuous_batching else "cbkit's rollouts carry token ids only")
        raise ValueError(
            f"Got {what}: cbkit trains text-only policies; {engine}. Use a text-only model and its tokenizer, "
            "or TRL's GRPOTrainer (cbkit.trl.config) for multimodal GRPO."
        )


def _chunks(start: int, stop: int, rows: int | None, attention_mask: Tensor) -> list[Tensor]:
    """Rows [start, stop) longest first (real length: prompt + completion tokens, ``attention_mask``), cut into
    chunks of at most `rows` (None: one chunk); the last may be shorter. A chunk is trimmed to its longest row
    (`Batch.take`), so rows of about one length pad little where chunks in rollout order pad each to its longest
    row (docs/measuring.md, "The update against its roof"). Longest first, so each later chunk's tensors fit in the memory the widest one freed. The sort is stable: a
    rerun forms the same chunks, and the loss is the same sum in another order."""
    order = start + torch.argsort(attention_mask[start:stop].sum(-1), descending=True, stable=True)
    step = stop - start if rows is None else rows
    return [order[i : i + step] for i in range(0, stop - start, step)]


def mix_seed(seed: int, *counters: int) -> int:
    """One seed per (run seed, counter, ...): a stream per step, epoch or process that a rerun draws again, and
    that two runs with different seeds do not share. Below 2**31 - 1, which every sampler accepts."""
    for c in counters:
        seed = seed * 1_000_003 + int(c)
    return seed % (2**31 - 1)


def seed_everything(seed: int) -> None:
    """torch, python `random` and numpy (if installed) from one seed: what a fresh run starts from."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def check_fp32_weights(model: torch.nn.Module) -> None:
    """Refuse a policy whose floating-point weights are not all fp32: AdamW on bf16 weights rounds away the small
    updates GRPO makes, fp16 moments underflow. Lower precision belongs in the config's `dtype`, as an autocast."""
    half = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if half:
        raise ValueError(
            f"GRPOTrainer trains fp32 weights, but this policy has {', '.join(half)} weights. Load it with "
            "load_policy(..., dtype='float32') (or call model.float()), and choose the training forwards' precision "
            "with the config's dtype ('auto': bf16 autocast where the GPU has native bf16).")


def _offpolicy(trainer: GRPOTrainer, backend_given: bool):
    """The off-policy rollout source the config asks for, or None for the on-policy loop."""
    c = trainer.config
    if not (c.rollout_staleness or c.async_rollouts):
        return None
    if backend_given:
        raise ValueError("rollout_staleness > 0 and async_rollouts=True sample from a copy of the policy's weights "
                         "with a backend cbkit builds on that copy; pass no backend (backend=None).")
    return AsyncRollouts(trainer) if c.async_rollouts else LaggedRollouts(trainer, c.rollout_staleness)


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def _resolve_rewards(
    config: CBGRPOConfig, reward_funcs: Mapping[str, RewardFn] | Sequence[RewardFn] | None
) -> tuple[dict[str, RewardFn], list[float]]:
    """Reward functions by name, and one weight each (`cbkit.tasks.rewards.resolve_rewards`: the config's names of
    built-ins unless callables are passed)."""
    return resolve_rewards(config.reward_funcs if reward_funcs is None else reward_funcs, config.reward_weights)
