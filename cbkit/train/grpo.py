"""The GRPO loop, top to bottom: prompts -> rollout -> rewards -> advantages -> old logprobs -> loss -> update.

Read `GRPOTrainer.step` first: it is the whole algorithm, one stage per line, and every stage is a method you
can call on its own (the tests do). The maths lives in `cbkit.train.objective` (checked against TRL 1.16's own code);
this file only moves data between the stages and makes them observable through `cbkit.train.hooks`.

Set-up happens once, before the trainer: `cbkit.train.setup.set_up_run` loads the policy and problems and builds
the chat prompt ids, stop and pad ids; `GRPOTrainer(config, run)` takes that, or calls it once itself.

What one step does
------------------
1. take `prompts_per_step` prompts (a seeded order, reshuffled each epoch; the position is checkpointed);
2. roll out N completions per prompt, each with its *sampling logprobs*, from the run's rollout source
   (`cbkit.train.rollouts`: on-policy through any `RolloutBackend`, transformers' CB engine by default; or lagged,
   or async, `cbkit.train.offpolicy`); the rollout is validated once, where it enters;
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

Top-p and top-k: the IS reference is computed under the sampler's own truncated distribution, the loss's ratio
at temperature only; `cbkit.train.objective` argues the decision. The trainer warns once when truncation is on.

What this loop simplifies, relative to TRL's GRPOTrainer, and why
-----------------------------------------------------------------
* One process, one device. Scale-out is TRL's job (`cbkit.trl.config`, `accelerate launch`).
* One rollout per step, `num_iterations` updates per rollout (TRL's `steps_per_generation` decouples them; fixing
  them keeps "step" meaning one thing). Old logprobs are always recomputed (one no-grad forward), even when TRL
  would reuse the detached current ones: the IS weights and `logprob/*` need them anyway.
* Constant learning rate, AdamW (`optim`: fused by default, as TRL's): no scheduler, no warmup.
* Dropout stays off (eval mode), like TRL's `disable_dropout=True`: the ratio must compare one function, not two
  dropout masks. The reference model (beta > 0) is a frozen copy of the policy as loaded; no `sync_ref_model`.
* Text only, single turn, no tools; reward functions take `(completions, answers)`. A reward that raises or
  returns a non-finite value stops the run with its name and the completion (TRL turns it into advantage 0).
* Full fp32 logits per chunk of `forward_chunk_rows` completions, each chunk forwarded, scored and back-propagated
  on its own (memory grows with the chunk, not with N; rows longest first, `logprobs.chunked_logits`); no Liger
  LM head, no padding-free packing. `cbkit.train.batch.micro_batches_for` sizes `gradient_accumulation_steps`.
* Precision: the weights that train are fp32 on every device (AdamW on bf16 weights loses every update smaller
  than bf16's spacing, so a half-precision policy is refused); the config's `dtype` is an autocast over them
  (`cbkit.models.load.training_precision`: 'auto' is bf16 where the GPU has it natively; fp16 is refused, as this
  loop does no loss scaling). The rollout samples from the same fp32 weights.
* The loss variants, IS modes and what the objective leaves out are listed in `cbkit.train.objective`.

Checkpoints (`cbkit.train.checkpoint`) hold the model, optimizer, step, data position, RNG states and config; resuming
with a config that computes something else is refused with the list of differing fields.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from cbkit.models.load import training_precision
from cbkit.rollout import Rollout, RolloutBackend, SamplingParams, make_backend
from cbkit.tasks.data import Problem
from cbkit.tasks.rewards import RewardFn, compute_rewards, resolve_rewards
from cbkit.telemetry import seconds_since
from cbkit.train import checkpoint
from cbkit.train.batch import Batch, check_causal_forward
from cbkit.train.config import CBGRPOConfig
from cbkit.train.evaluate import build_held_out, eval_sampling, without_held_out
from cbkit.train.hooks import RunStatus, StepHooks, StepRecord, TrainState, default_hooks
from cbkit.train.logprobs import chunked_logits
from cbkit.train.objective import (
    Estimator,
    ISMode,
    LossType,
    ScaleRewards,
    chunk_share,
    group_advantages,
    grpo_loss,
    importance_weights,
    policy_logprobs,
    replayed_logprobs,
    warn_if_truncated,
)
from cbkit.train.offpolicy import drift_metrics, make_rollout_source
from cbkit.train.order import PromptOrder, mix_seed, seed_everything
from cbkit.train.rollouts import RolloutRequest, RolloutSource, SourcedRollout, check_backend, check_entry
from cbkit.train.setup import RunSetup, set_up_for_config

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
        run: RunSetup | None = None,
        *,
        backend: RolloutBackend | None = None,
        rollouts: RolloutSource | None = None,
        reward_funcs: Mapping[str, RewardFn] | Sequence[RewardFn] | None = None,
        hooks: Sequence[StepHooks] = (),
        policy: Any = None,
        problems: Sequence[Problem] | None = None,
    ) -> None:
        """`run`: what `set_up_run` returned; its policy, problems and prompt ids are what this trainer trains on.
        Without it the trainer calls `set_up_run` once, from the config's model and data (on `policy` and `problems`
        when given). `backend` samples the on-policy rollouts (None: the config's, built on the policy); `rollouts`
        replaces the whole rollout source (`cbkit.train.rollouts.RolloutSource`; None: the one the config asks for)."""
        run = set_up_for_config(config, run, policy=policy, problems=problems)
        self.run_setup = run
        self.model, self.tokenizer = run.model, run.tokenizer
        self.model.eval()  # dropout off for the whole run (see the module docstring)
        self.device = next(self.model.parameters()).device
        # The training forwards' autocast over the fp32 weights, or None (see the module docstring).
        self.autocast_dtype = training_precision(config.dtype, self.device)
        self.pad_token_id, self.stop_ids = run.pad_token_id, run.stop_ids
        # The attention the training forward must run with; a CB engine that leaves it switched would make the
        # forward silently non-causal (transformers #48296), so every forward checks it (`check_causal_forward`).
        self.attn_implementation = self.model.config._attn_implementation

        self.reward_funcs, weights = resolve_rewards(
            config.reward_funcs if reward_funcs is None else reward_funcs, config.reward_weights)
        self.config = dataclasses.replace(config, reward_funcs=list(self.reward_funcs), reward_weights=weights)
        # The held-out set is drawn first and its questions leave the training problems (cbkit.train.evaluate).
        self.held_out = build_held_out(config, run.tokenizer) if config.eval_steps else None
        kept = run.problems if self.held_out is None else without_held_out(run.problems, self.held_out.problems)
        self.problems = list(kept)
        self.prompt_ids = [ids for p, ids in zip(run.problems, run.prompts, strict=True) if p in kept]
        self.order = PromptOrder(len(self.problems), config.seed)

        backend_given = backend is not None
        if backend is None:
            backend = make_backend(config.backend, self.model, cb_config=config.cb_overrides(),
                                   pad_token_id=self.pad_token_id)
        self.backend = check_backend(backend)
        # Held-out evaluation runs through the CB engine whatever the training rollouts use, so runs that train
        # with generate() and with CB are scored by the same sampler; a CB training backend is reused.
        self.eval_backend = None
        if self.held_out is not None:
            self.eval_backend = backend if backend.name == "continuous" else make_backend(
                "continuous", self.model, cb_config=config.cb_overrides(), pad_token_id=self.pad_token_id)
        self.policy_version = 0  # optimizer updates so far: the version a rollout records for its tokens
        self.rollouts = make_rollout_source(self.config, self.model, backend, given=rollouts, backend_given=backend_given,
                                            max_prompt_len=max(map(len, self.prompt_ids)))
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if config.beta > 0 else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay,
            fused=config.optim == "adamw_torch_fused",
        )
        self.truncates = warn_if_truncated(config.top_p, config.top_k)

        output_dir = Path(config.output_dir) if config.output_dir else None
        self.state = TrainState(step=0, max_steps=config.max_steps, config=self.config, output_dir=output_dir)
        self.data_position = 0
        self._rng_at_step_end = checkpoint.capture_rng()
        self.hooks = default_hooks(self.config, output_dir / METRICS_FILE if output_dir else None,
                                   self.save_checkpoint) + list(hooks)

    # --- the run --------------------------------------------------------------------------------------------

    def train(self, resume_from: str | Path | bool | None = None) -> TrainState:
        """Run until `max_steps`. `resume_from=True` resumes from the newest checkpoint in `output_dir`."""
        if resume_from:
            self.resume(resume_from)
        else:
            checkpoint.refuse_to_overwrite(self.state.output_dir, METRICS_FILE)
            seed_everything(self.config.seed)
            self._rng_at_step_end = checkpoint.capture_rng()
        status: RunStatus = "failed"
        try:
            for h in self.hooks:
                h.on_train_begin(self.state)
            if self.held_out is not None and self.state.step == 0:  # the step-0 point of every held-out curve
                record = StepRecord(0, {**self.evaluate()})
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
        """Release what the rollout source holds (an async engine's thread, snapshot files); `train()` calls it."""
        self.rollouts.close()

    def step(self) -> StepRecord:
        """One GRPO step. Each line is a stage; each stage is a method below."""
        start = time.perf_counter()
        step = self.state.step + 1
        for h in self.hooks:
            h.on_step_begin(step)
        indices = self.order.indices(self.data_position, self.config.prompts_per_step)
        got = self.rollout(indices, step)  # from the run's rollout source (on-policy, lagged, async), checked
        for h in self.hooks:
            h.on_rollout_end(got.rollout)
        rewards, metrics = self.score(got.rollout, [self.problems[i] for i in got.indices])
        metrics.update(got.metrics)
        train_start = time.perf_counter()  # training = old-logprob forward + updates: what the rollout is not
        prepared = self.prepare(got.rollout, rewards)
        metrics.update(prepared.metrics)
        metrics["train/prepare_seconds"] = seconds_since(train_start, self.device)
        update_start = time.perf_counter()
        metrics.update(self.optimize(prepared))
        metrics["train/update_seconds"] = seconds_since(update_start, self.device)
        metrics.update(self.rollouts.after_step(self.policy_version))
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
        assert self.eval_backend is not None  # built in __init__ whenever there is a held-out set
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

    def rollout(self, indices: Sequence[int], step: int) -> SourcedRollout:
        """N completions for each prompt, from the run's rollout source; checked once, here, where they enter."""
        ahead = self.order.indices(self.data_position + len(indices), self.config.prompts_per_step)
        # The next step's prompts too: a source that decodes ahead (async) queues them now.
        request = self._request(indices, step, self._request(ahead, step + 1) if step < self.config.max_steps else None)
        return check_entry(self.rollouts.rollout(request), request)

    def _request(self, indices: Sequence[int], step: int, following: RolloutRequest | None = None) -> RolloutRequest:
        return RolloutRequest(list(indices), [self.prompt_ids[i] for i in indices],
                              [self.problems[i].id for i in indices], self.config.num_generations,
                              self.sampling_params(step), step, self.policy_version, following)

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
        # The config keeps these as plain str (a recipe's YAML value); CBGRPOConfig._check has held each to its
        # objective Literal's values.
        advantages = group_advantages(rewards, c.num_generations, cast(ScaleRewards, c.scale_rewards),
                                      cast(Estimator, c.advantage_estimator))
        batch = Batch.from_completions(rollout.completions, self.pad_token_id, self.device,
                                       with_logprobs=rollout.has_logprobs)
        old, old_processed, outside = self._old_logprobs(self.model, batch)
        ref = self._old_logprobs(self.ref_model, batch)[0] if self.ref_model is not None else None
        # The whole completion mask, truncated completions included: their weights never reach the loss when
        # they are masked, and `logprob/*` should describe every token the engine sampled.
        weights: Tensor | None
        weights, metrics = importance_weights(
            old_processed, batch.sampling_logps, batch.completion_mask, cast(ISMode, c.importance_sampling_mode),
            c.clip_max, c.clip_min,
        )
        if self.truncates and batch.sampling_logps is not None:
            gap = (batch.sampling_logps - old).abs()[batch.completion_mask]
            metrics["logprob/temperature_only_max_abs_diff"] = gap.max().item()
            # Sampled tokens the trainer's own nucleus left out, put back into it (objective.replayed_logprobs).
            metrics["logprob/outside_support_tokens"] = float((outside & batch.completion_mask).sum().item())
        if any(comp.policy_versions is not None for comp in rollout.completions):  # sampled by recorded versions
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
        loss_type = cast(LossType, c.loss_type)  # held to LossType's values by CBGRPOConfig._check
        check_causal_forward(self.model, self.attn_implementation)
        self.optimizer.zero_grad(set_to_none=True)
        ga = c.gradient_accumulation_steps
        size = len(p.batch) // ga
        # dapo divides by the tokens of the whole update, not of one micro-batch: what makes accumulation exact.
        num_items = p.loss_mask.sum()
        loss_sum, sums = 0.0, dict[str, float]()
        for k in range(ga):
            micro_mask = p.loss_mask[k * size : (k + 1) * size]
            # A micro-batch a chunk of rows at a time, each chunk's loss scaled to its share of the micro-batch's
            # and back-propagated at once: only one chunk's activations and logits are alive (objective.chunk_share).
            for rows, mb, logits in chunked_logits(self.model, p.batch, c.forward_chunk_rows, start=k * size,
                                                   stop=(k + 1) * size, autocast_dtype=self.autocast_dtype):
                t = mb.completion_width
                logps = policy_logprobs(logits, mb.completion_ids, c.temperature)
                del logits  # its graph lives on in logps until this chunk's backward
                loss, metrics = grpo_loss(
                    logps, p.old_logps[rows, :t], p.advantages[rows], p.loss_mask[rows, :t],
                    loss_type=loss_type, epsilon=c.epsilon, epsilon_high=c.epsilon_high, beta=c.beta,
                    ref_logps=None if p.ref_logps is None else p.ref_logps[rows, :t],
                    is_weights=None if p.is_weights is None else p.is_weights[rows, :t],
                    max_completion_length=c.max_completion_length, num_items_in_batch=num_items,
                    gradient_accumulation_steps=ga, kl_bias_correction=c.kl_bias_correction,
                )
                loss_share, token_share = chunk_share(loss_type, p.loss_mask[rows], micro_mask)
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
        self.rollouts.after_update(self.policy_version)
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
        self.rollouts.save(path)  # e.g. the older weights the next rollout starts from
        return path

    def resume(self, resume_from: str | Path | bool) -> Path:
        """Load a checkpoint (True: the newest in output_dir) after checking it was made with this config."""
        path = checkpoint.resume_path(self.state.output_dir, resume_from)
        checkpoint.check_same_config(checkpoint.read_config(path), self.config, path)
        trainer_state, rng = checkpoint.load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.state.step, self.data_position = trainer_state["step"], trainer_state["data_position"]
        self.state.resumed_from = path
        self.policy_version = self.state.step * self.config.num_iterations
        self.rollouts.load(path, self.policy_version)
        checkpoint.restore_rng(rng)
        self._rng_at_step_end = rng
        return path

    @torch.no_grad()
    def _old_logprobs(self, model, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """Temperature-only and sampler-processed logprobs [B, T], one no-grad forward per chunk (`forward_chunk_rows`),
        and True where a sampled token lay outside the trainer's replayed nucleus (kept in it: `replayed_logprobs`)."""
        check_causal_forward(self.model, self.attn_implementation)
        c = self.config
        size = len(batch) // c.gradient_accumulation_steps
        plain = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=self.device)
        processed = plain.clone() if self.truncates else plain
        outside = torch.zeros(batch.completion_ids.shape, dtype=torch.bool, device=self.device)
        for rows, mb, logits in (chunk for start in range(0, len(batch), size)
                                 for chunk in chunked_logits(model, batch, c.forward_chunk_rows, start=start,
                                                             stop=start + size, autocast_dtype=self.autocast_dtype)):
            t = mb.completion_width
            plain[rows, :t] = policy_logprobs(logits, mb.completion_ids, c.temperature)
            if self.truncates:
                processed[rows, :t], outside[rows, :t] = replayed_logprobs(
                    logits, mb.completion_ids, c.temperature, c.top_k, c.top_p)
            del logits  # one chunk's logits alive at a time
        return plain, processed, outside
