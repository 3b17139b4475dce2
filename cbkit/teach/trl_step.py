"""TRL's own step in the notebooks: its config overrides (04), and one step of *stock* `trl.GRPOTrainer` on its CB
path, recording the logprobs it drops (02)."""

from __future__ import annotations

import copy
from typing import Any

from cbkit.teach.notebook import NotebookEnv
from cbkit.telemetry import release_memory


def trl_step_overrides(env: NotebookEnv) -> dict[str, Any]:
    """The notebooks' `GRPOConfig` overrides: no reports or saves, and the checkpointing TRL turns on off."""
    return {"report_to": [], "logging_steps": 1, "save_strategy": "no", "activation_checkpointing": False,
            "dataloader_pin_memory": env.device == "cuda"}


def stock_trl_cb_rollout(model: Any, tokenizer: Any, reward_funcs: Any, dataset: Any, cfg: Any,
                         **overrides: Any) -> dict[str, Any]:
    """One step of *stock* ``trl.GRPOTrainer``'s CB path on a copy of ``model``: the completions' count and tokens, the
    logprobs its rollout returned (that path sets them to None) and its ``sampling/*`` metrics (absent without them)."""
    from trl import GRPOTrainer as StockGRPOTrainer

    from cbkit.trl.config import trl_grpo_config, trl_rewards

    funcs, weights = trl_rewards(reward_funcs, cfg=cfg)
    args = trl_grpo_config(cfg, **({"reward_weights": weights} if weights is not None else {}), **overrides)
    if not args.use_transformers_continuous_batching:
        raise ValueError("stock_trl_cb_rollout shows TRL's CB path: the config needs "
                         "use_transformers_continuous_batching=True.")
    cb = args.transformers_continuous_batching_config
    if model.device.type == "cpu" and cb is not None and "num_blocks" not in cb:
        # Stock TRL hands the engine max_memory_percent, on a CPU a share of host RAM (gigabytes of zeroed KV); the
        # pool cbkit's own CPU engine gets instead: every completion of the step at its longest prompt and the limit.
        from cbkit.rollout.engine_config import page_size, workload_blocks

        longest = max(len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]) for row in dataset)
        rows = [[0] * longest] * (args.per_device_train_batch_size * args.gradient_accumulation_steps)
        blocks = workload_blocks(rows, args.max_completion_length, page_size(cb))
        args.transformers_continuous_batching_config = {**cb, "num_blocks": blocks}
    trainer = StockGRPOTrainer(model=copy.deepcopy(model), reward_funcs=funcs, args=args, train_dataset=dataset,
                               processing_class=tokenizer)
    seen = _train_recording(trainer)
    del trainer  # and its copy of the model, with the heap they used
    release_memory()
    return seen


def _train_recording(trainer: Any) -> dict[str, Any]:
    """Trains one step, recording what ``_generate_single_turn`` returns; apart, so nothing keeps the trainer."""
    from cbkit.trl.trainers import plain_forward

    seen: dict[str, Any] = {"completions": 0, "tokens": 0}
    generate = trainer._generate_single_turn

    def recording(*a: Any, **k: Any):
        # TRL's own CB generation, minus accelerate's mixed-precision wrapper around the forward (bf16=True where bf16
        # is native), which would call .float() on the engine's PagedAttentionCache; training keeps the wrapper.
        with plain_forward(trainer.model):
            completion_ids, logprobs = generate(*a, **k)
        seen["completions"] += len(completion_ids)  # over every call of the step
        seen["tokens"] += sum(len(c) for c in completion_ids)
        seen["logprobs"] = logprobs
        return completion_ids, logprobs

    trainer._generate_single_turn = recording
    trainer.train()
    logs = trainer.state.log_history[0] if trainer.state.log_history else {}
    seen["sampling_metrics"] = {k: v for k, v in logs.items() if k.startswith("sampling/")}
    seen["trainer"] = type(trainer).__module__ + "." + type(trainer).__name__
    return seen
