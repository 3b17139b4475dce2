"""The GRPO loop, top to bottom: prompts -> rollout -> rewards -> advantages -> old logprobs -> loss -> update.
Read `GRPOTrainer.step` first; what varies between runs is an object built once (rollout source, held-out set), not
a branch. Against TRL's GRPOTrainer: one device, constant learning rate, text only, fp32 weights under an autocast."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
import warnings
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
from cbkit.train import checkpoint, objective
from cbkit.train.batch import Batch, check_causal_forward
from cbkit.train.config import CBGRPOConfig
from cbkit.train.evaluate import HeldOut, without_held_out
from cbkit.train.hooks import StepHooks, StepRecord, TrainState, default_hooks, emit
from cbkit.train.logprobs import chunked_logits
from cbkit.train.offpolicy import make_rollout_source
from cbkit.train.order import PromptOrder, mix_seed
from cbkit.train.rollouts import RolloutRequest, RolloutSource, SourcedRollout, check_backend, check_entry
from cbkit.train.setup import RunSetup, set_up_for_config


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

    def __init__(self, config: CBGRPOConfig, run: RunSetup | None = None, *, backend: RolloutBackend | None = None,
                 rollouts: RolloutSource | None = None,
                 reward_funcs: Mapping[str, RewardFn] | Sequence[RewardFn] | None = None,
                 hooks: Sequence[StepHooks] = (), policy: Any = None, problems: Sequence[Problem] | None = None) -> None:
        """`run`: `set_up_run`'s set-up (else made on `policy`/`problems`); `backend` samples on-policy rollouts (None:
        the config's); `rollouts` replaces the whole rollout source."""
        self.run_setup = run = set_up_for_config(config, run, policy=policy, problems=problems)
        self.model, self.tokenizer, self.pad_token_id = run.model, run.tokenizer, run.pad_token_id
        self.model.eval()  # dropout off for the whole run
        self.device = next(self.model.parameters()).device
        self.autocast_dtype = training_precision(config.dtype, self.device)  # over the fp32 weights, or None
        # A CB engine that leaves the attention switched makes a forward silently non-causal (transformers #48296).
        self.attn_implementation = self.model.config._attn_implementation
        self.reward_funcs, weights = resolve_rewards(
            config.reward_funcs if reward_funcs is None else reward_funcs, config.reward_weights)
        self.config = c = dataclasses.replace(config, reward_funcs=list(self.reward_funcs), reward_weights=weights)
        self.truncates = c.top_p < 1 or c.top_k > 0
        if self.truncates:
            warnings.warn(f"top_p={c.top_p}, top_k={c.top_k}: the rollout samples from a truncated distribution; the "
                          "IS reference is taken under it, the loss's ratio is temperature-only and the truncation is "
                          "not corrected (logprob/temperature_only_max_abs_diff shows its size).", stacklevel=2)

        self.backend = check_backend(backend if backend is not None else make_backend(
            c.backend, self.model, cb_config=c.cb_overrides(), pad_token_id=self.pad_token_id))
        # The held-out set is drawn first; its questions leave the training problems.
        self.held_out = HeldOut(c, run, self.backend, self.sampling_params(0), self.reward_funcs)
        self.problems = without_held_out(run.problems, self.held_out.problems)
        self.prompt_ids = [ids for p, ids in zip(run.problems, run.prompts, strict=True) if p in self.problems]
        self.order = PromptOrder(len(self.problems), c.seed)
        self.rollouts = make_rollout_source(c, self.model, self.backend, given=rollouts,
                                            backend_given=backend is not None,
                                            max_prompt_len=max(map(len, self.prompt_ids)))
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if c.beta > 0 else None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=c.learning_rate,
            betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_epsilon, weight_decay=c.weight_decay,
            fused=c.optim == "adamw_torch_fused")
        self.policy_version = 0  # optimizer updates so far: the version a rollout records for its tokens
        self.state = TrainState(step=0, config=c, output_dir=Path(c.output_dir) if c.output_dir else None)
        self.hooks = default_hooks(c, self.state.output_dir, functools.partial(checkpoint.save, self)) + list(hooks)

    def train(self, resume_from: str | Path | bool | None = None) -> TrainState:
        """Run until `max_steps`. `resume_from=True` resumes from the newest checkpoint in `output_dir`."""
        checkpoint.start(self, resume_from)  # a fresh run, or exactly where a checkpoint left it
        try:
            for h in self.hooks:
                h.on_train_begin(self.state)
            for record in self.held_out.before_training(self.state.step):  # step 0 of every held-out curve
                emit(self.hooks, self.state, record)
            while self.state.step < self.config.max_steps:
                self.step()
            self.state.status = "finished"
        except BaseException as error:
            self.state.status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
            raise
        finally:
            for h in self.hooks:
                h.on_train_end(self.state)
            self.close()
        return self.state

    def close(self) -> None:
        """Release what the rollout source holds (an async engine's thread, snapshot files); `train()` calls it."""
        self.rollouts.close()

    def step(self) -> StepRecord:
        """One GRPO step: a stage a line, each a method below."""
        start, step = time.perf_counter(), self.state.step + 1
        for h in self.hooks:
            h.on_step_begin(step)
        indices = self.order.indices(self.state.data_position, self.config.prompts_per_step)
        got = self.rollout(indices, step)  # from the run's rollout source, checked where it enters
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
        metrics.update(self.held_out.after_step(step))  # eval/* when due, timed on its own (eval/seconds)
        self.state.finish_step(step, len(indices))
        return emit(self.hooks, self.state, StepRecord(step, metrics))

    def sampling_params(self, step: int) -> SamplingParams:
        c = self.config  # a seed per (run, step): a resumed run draws what the uninterrupted one would have
        return self.run_setup.sampling(c.max_completion_length, temperature=c.temperature, top_p=c.top_p,
                                       top_k=c.top_k, seed=mix_seed(c.seed, step))

    def rollout(self, indices: Sequence[int], step: int) -> SourcedRollout:
        """N completions per prompt from the rollout source; the request names the next step's prompts too."""
        ahead = self.order.indices(self.state.data_position + len(indices), self.config.prompts_per_step)
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
            "reward/mean": total.mean().item(), "reward/std": total.std().item(),
            # Groups whose N rewards are all equal have advantage 0 everywhere: they teach nothing this step.
            "reward/zero_std_frac": (groups.std(dim=1) == 0).double().mean().item(),
            "completion/mean_length": lengths.mean().item(), "completion/max_length": int(lengths.max()),
            "completion/truncated_frac": sum(c.finish_reason == "length" for c in rollout.completions) / len(texts),
            "rollout/seconds": rollout.wall_s, "rollout/tokens_per_s": rollout.tokens_per_s,
            "rollout/completion_tokens": rollout.completion_tokens, "rollout/peak_mem_bytes": rollout.peak_mem_bytes,
            "rollout/backend": rollout.backend})
        return total, metrics

    def prepare(self, rollout: Rollout, rewards: Tensor) -> Prepared:
        """Advantages, old (and reference) logprobs on the current weights, IS weights, the loss mask."""
        c = self.config
        advantages = objective.group_advantages(rewards, c.num_generations, c.scale_rewards, c.advantage_estimator)
        batch = Batch.from_completions(rollout.completions, self.pad_token_id, self.device,
                                       with_logprobs=rollout.has_logprobs)
        old, old_processed, outside = self._old_logprobs(self.model, batch)
        ref = self._old_logprobs(self.ref_model, batch)[0] if self.ref_model is not None else None
        weights: Tensor | None
        weights, metrics = objective.importance_weights(old_processed, batch.sampling_logps, batch.completion_mask,
                                                        c.importance_sampling_mode, c.clip_max, c.clip_min)
        if self.truncates and batch.sampling_logps is not None:
            gap = (batch.sampling_logps - old).abs()[batch.completion_mask]
            metrics["logprob/temperature_only_max_abs_diff"] = gap.max().item()
            # Sampled tokens the trainer's own nucleus left out, put back into it (objective.replayed_logprobs).
            metrics["logprob/outside_support_tokens"] = float((outside & batch.completion_mask).sum().item())
        metrics.update(self.rollouts.drift(old_processed, batch.sampling_logps, batch.completion_mask,
                                           c.importance_sampling_mode))
        if not c.importance_sampling_correction:
            weights, metrics["is/skipped"] = None, 1.0
        loss_mask = batch.completion_mask & ~(batch.truncated.unsqueeze(-1) & c.mask_truncated_completions)
        return Prepared(batch, advantages.float().to(self.device), old, ref, weights, loss_mask, metrics)

    def optimize(self, prepared: Prepared) -> dict[str, float]:
        """`num_iterations` optimizer updates on one prepared rollout; metrics averaged over them."""
        updates = []
        for _ in range(self.config.num_iterations):
            metrics = self.accumulate_gradients(prepared)
            metrics["train/grad_norm"] = self.optimizer_step()
            updates.append(metrics)
        out = {k: sum(m[k] for m in updates) / len(updates) for k in updates[0]}
        return {**out, "train/learning_rate": self.optimizer.param_groups[0]["lr"]}

    def accumulate_gradients(self, prepared: Prepared) -> dict[str, float]:
        """Fresh gradients of one optimizer update, summed over `gradient_accumulation_steps` micro-batches."""
        c, p = self.config, prepared
        loss_type = cast(Any, c.loss_type)
        check_causal_forward(self.model, self.attn_implementation)
        self.optimizer.zero_grad(set_to_none=True)
        ga = c.gradient_accumulation_steps
        size = len(p.batch) // ga
        # dapo divides by the tokens of the whole update, not of one micro-batch: what makes accumulation exact.
        num_items = p.loss_mask.sum()
        loss_sum, sums = 0.0, dict[str, float]()
        for k in range(ga):
            micro_mask = p.loss_mask[k * size : (k + 1) * size]
            # A chunk of rows at a time, each chunk's loss scaled to its share and back-propagated at once.
            for rows, mb, logits in chunked_logits(self.model, p.batch, c.forward_chunk_rows, start=k * size,
                                                   stop=(k + 1) * size, autocast_dtype=self.autocast_dtype):
                t = mb.completion_width
                logps = objective.policy_logprobs(logits, mb.completion_ids, c.temperature)
                del logits  # its graph lives on in logps until this chunk's backward
                loss, metrics = objective.grpo_loss(
                    logps, p.old_logps[rows, :t], p.advantages[rows], p.loss_mask[rows, :t],
                    loss_type=loss_type, epsilon=c.epsilon, epsilon_high=c.epsilon_high, beta=c.beta,
                    ref_logps=None if p.ref_logps is None else p.ref_logps[rows, :t],
                    is_weights=None if p.is_weights is None else p.is_weights[rows, :t],
                    max_completion_length=c.max_completion_length, num_items_in_batch=num_items,
                    gradient_accumulation_steps=ga, kl_bias_correction=c.kl_bias_correction)
                loss_share, token_share = objective.chunk_share(loss_type, p.loss_mask[rows], micro_mask)
                (loss * loss_share).backward()
                loss_sum += loss.item() * loss_share
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value * token_share / ga
        return {"train/loss": loss_sum, **sums}

    def optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        self.state.resumable = False  # from here until the step ends, the weights belong to no finished step
        self.optimizer.step()
        self.policy_version += 1
        self.rollouts.after_update(self.policy_version)
        return norm

    @torch.no_grad()
    def _old_logprobs(self, model, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """Temperature-only and sampler-processed logprobs [B, T], and where a token lay outside the trainer's nucleus."""
        check_causal_forward(self.model, self.attn_implementation)
        c = self.config
        size = len(batch) // c.gradient_accumulation_steps
        plain = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=self.device)
        processed = plain.clone() if self.truncates else plain
        outside = torch.zeros(batch.completion_ids.shape, dtype=torch.bool, device=self.device)
        for start in range(0, len(batch), size):
            for rows, mb, logits in chunked_logits(model, batch, c.forward_chunk_rows, start=start,
                                                   stop=start + size, autocast_dtype=self.autocast_dtype):
                t = mb.completion_width
                plain[rows, :t] = objective.policy_logprobs(logits, mb.completion_ids, c.temperature)
                if self.truncates:
                    processed[rows, :t], outside[rows, :t] = objective.replayed_logprobs(
                        logits, mb.completion_ids, c.temperature, c.top_k, c.top_p)
                del logits  # one chunk's logits alive at a time
        return plain, processed, outside
