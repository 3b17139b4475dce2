"""`cbkit tiers` without a GPU: does each notebook fit each GPU (the planner's peak; weight copies in a Colab runtime's
RAM), and does each CB engine start pass transformers' own check (`rollout.admission`) with what is held beside it?"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbkit.measure import roofline
from cbkit.measure.planner import TRAIN_STATE_BYTES_PER_PARAM, plan, training_bytes
from cbkit.models.load import load_config
from cbkit.rollout.admission import Admission, admission, pool_blocks
from cbkit.rollout.engine_config import workload_blocks
from cbkit.teach.tiers import table
from cbkit.telemetry import fmt_bytes
from cbkit.train.batch import logits_bytes, micro_batches_for
from cbkit.train.snapshots import place_for_tier


def plan_config(model: str) -> Any:  # a real transformers config without weights: the admission check builds on it
    if model == table.GPU_MODEL:  # its config.json's shape, so that planning the GPU tiers needs no download
        from transformers import Qwen2Config

        return Qwen2Config(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    return load_config(model)


def parameter_count(config: Any) -> int:
    """Weights of a config: its matmul weights, plus the embedding where untied (norms and biases left out)."""
    shape = roofline.Shape.of(config)
    return shape.matmul_params + (0 if getattr(config, "tie_word_embeddings", True) else shape.vocab * shape.hidden)


def pool_bytes(config: Any, tier: str, share: float) -> int:
    """``share`` x what a training step of this model (16 bytes a parameter) leaves free on the tier's smallest GPU."""
    if not 0 < share <= 1:
        raise ValueError(f"pool_share is a share of free memory in (0, 1], got {share}.")
    state = TRAIN_STATE_BYTES_PER_PARAM * parameter_count(config)
    return int(share * (table.TIER_MEMORY[tier] - state))


def pool_config(config: Any, sizes: table.Sizes, tier: str, *, dtype_bytes: int, rows: Sequence[Sequence[int]] = (),
                max_new_tokens: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """The pool a notebook runs and `plan_notebook` plans (``{}``: cbkit's default); a dry run caps a GPU tier's pool
    at half the ``rows`` at full length, so that some wait."""
    page, new = table.LESSON_PAGE_SIZE, max_new_tokens or sizes.max_new_tokens
    if sizes.pool_share is not None and tier in table.GPU_TIERS:
        blocks = pool_blocks(config, pool_bytes(config, tier, sizes.pool_share), page_size=page, dtype_bytes=dtype_bytes)
        if dry_run and rows:
            blocks = min(blocks, workload_blocks(rows[: max(1, len(rows) // 2)], max_new_tokens or 1, page))
    elif tier in table.GPU_TIERS:  # the plan has no prompts: it sizes the same pool from prompts of twice the mean
        blocks = workload_blocks([range(2 * table.PROMPT_LEN)] * (len(rows) or sizes.prompts * sizes.n), new, page)
    elif sizes.pool_sequences is not None and rows:
        blocks = workload_blocks([rows[0]] * sizes.pool_sequences, new, page)
    else:
        return {}
    return {"page_size": page, "num_blocks": blocks}


@dataclass(frozen=True)
class EngineStart:  # one CB engine start: its requests of `PROMPT_LEN` tokens, what is beside it, the verdict
    what: str
    requests: int
    new_tokens: int
    dtype_bytes: int  # the weights the engine runs: its KV pool's dtype
    resident_bytes: int  # beside it on the GPU, besides the CUDA context
    admission: Admission


@dataclass
class TierPlan:
    notebook: str
    tier: str
    machine: str
    peak_bytes: int
    memory_bytes: int  # what tensors may use: CUDA's total less the context
    parts: dict[str, int]  # the peak by part
    pool: dict[str, int]  # the pool planned: `pool_config`'s, which the notebook allocates
    starts: list[EngineStart]
    host_bytes: int = 0  # weight copies in host memory, against `COLAB_RAM_BYTES`

    def problems(self) -> list[str]:
        out = []
        if self.host_bytes > table.COLAB_RAM_BYTES:
            out.append(f"does not fit in host RAM: {fmt_bytes(self.host_bytes)} of weight copies > "
                       f"{fmt_bytes(table.COLAB_RAM_BYTES)}; keep them on disk (snapshots.TIER_PLACES)")
        if self.peak_bytes > self.memory_bytes:
            big = max(self.parts, key=self.parts.__getitem__)
            out.append(f"does not fit: planned {fmt_bytes(self.peak_bytes)} > {fmt_bytes(self.memory_bytes)}, "
                       f"{big} the largest part: lower N, the prompts, max_new_tokens or the model")
        out += [f"the CB engine would not start for {s.what}: {s.admission.error}; shrink the pool (pool_share, N) or "
                "what is resident beside it" for s in self.starts if not s.admission.fits]
        return out

    def line(self) -> str:  # one row of `cbkit tiers`' table; the tightest engine start shows
        a = min((s.admission for s in self.starts), key=lambda a: a.available_bytes - a.footprint_bytes)
        return (f"{self.notebook:23} {self.machine:8} {fmt_bytes(self.peak_bytes):>10} of "
                f"{fmt_bytes(self.memory_bytes):>9} {fmt_bytes(self.host_bytes):>10} {fmt_bytes(a.footprint_bytes):>10}"
                f" of {fmt_bytes(a.available_bytes):>9}  {'FAIL' if self.problems() else 'ok'}")


def plan_notebook(name: str, machine: str) -> TierPlan:
    """One notebook on one GPU of ``MACHINES``: its planned peak by part and every CB engine start it makes."""
    tier, rollout_dtype = table.MACHINES[machine]
    spec = table.notebook_spec(name)
    s = spec.sizes[tier]
    config = plan_config(s.model)
    params = parameter_count(config)
    fp32 = spec.kind in ("train", "logprobs")  # these roll out from their fp32 weights; the others load rollout_dtype
    weight_bytes, dtype = (4, torch.float32) if fp32 else (2, getattr(torch, rollout_dtype))
    pool = pool_config(config, s, tier, dtype_bytes=weight_bytes)
    if spec.kind == "rollout":  # 01 sizes its own pool: a share of its rows at full length (its parameters cell)
        page, share, budget = table.NB01_POOL
        own = [range(table.PROMPT_LEN)] * int(s.prompts * s.n * share)
        pool = {"page_size": page, "num_blocks": workload_blocks(own, s.max_new_tokens, page), "max_batch_tokens": budget}
    memory = table.DEVICE_BYTES[machine] - table.CUDA_CONTEXT_BYTES
    parts = {"weights": weight_bytes * params}
    place = place_for_tier(tier)  # where the tier keeps copies of the weights
    if spec.weight_copies and place == "device":
        parts["copies of the weights on the GPU"] = spec.weight_copies * 4 * params
    if spec.async_run:
        parts["the async engine's weight snapshot"] = 4 * params
    host = 4 * params * (spec.host_copies + (spec.weight_copies if place == "host" else 0))
    loaded = sum(parts.values())
    peaks = [0]
    starts: list[EngineStart] = []

    def rollout(prompts: int, n: int, backend: str = "continuous", *, what: str = "", resident: int = loaded) -> None:
        p = plan(config, num_prompts=prompts, num_generations=n, max_new_tokens=s.max_new_tokens, cb_config=pool,
                 prompt_len=table.PROMPT_LEN, dtype_bytes=weight_bytes, device="cuda", budget_bytes=memory - parts["weights"])
        peaks.append((p.generate if backend == "generate" else p.continuous).peak_bytes)
        if backend != "generate":
            verdict = admission(config, pool, dtype=dtype, rows=[range(table.PROMPT_LEN)] * (prompts * n),
                                max_new_tokens=s.max_new_tokens, total_bytes=table.DEVICE_BYTES[machine],
                                used_bytes=table.CUDA_CONTEXT_BYTES + resident, capability=table.CAPABILITY[machine])
            starts.append(EngineStart(what, prompts * n, s.max_new_tokens, weight_bytes, resident, verdict))

    if spec.kind == "train":
        rows = s.prompts * s.n
        ga = micro_batches_for(rows, s.max_new_tokens, config.vocab_size, table.LOGITS_BUDGET_BYTES[tier])
        train = training_bytes(params, micro_batch_rows=rows // ga, tokens_per_row=table.PROMPT_LEN + s.max_new_tokens,
                               completion_len=s.max_new_tokens, config=config, autocast=tier == "a100")
        trainer = train["optimizer_state"] - 4 * params  # gradients and AdamW's moments, resident from step 2 on
        held = s.steps > 1
        for backend in sorted(set(spec.train_runs)):
            rollout(s.prompts, s.n, backend, resident=loaded + trainer * held,
                    what="a step's rollout" + (", the trainer's state resident" if held else ""))
        if s.eval_every:
            rollout(s.eval_prompts, s.eval_n, what="the held-out evaluation", resident=loaded + trainer)
        parts.update({"optimizer state": trainer, "loss logits": train["logits"], "activations": train["activations"]})
    elif spec.kind == "logprobs":  # section 2 samples from a bf16 copy beside the fp32 policy, in a second engine
        rollout(s.prompts, s.n, what="the rollout, the bf16 copy resident", resident=loaded + 2 * params)
        parts.update({"the bf16 copy and its rollout": 2 * params + max(peaks), "teacher-forced logits":
                      3 * logits_bytes(min(16, s.prompts * s.n), s.max_new_tokens, config.vocab_size) // 4})
    else:  # 03 sweeps N through both backends; 01 rolls out once through each
        for n in s.sweep_ns or (s.n,):
            rollout(s.prompts, n, "generate")
            rollout(s.prompts, n, what=f"the rollout at N={n}")
    parts["the rollout"] = max(peaks)
    return TierPlan(name, tier, machine, sum(parts.values()), memory, parts, pool, starts, host)
