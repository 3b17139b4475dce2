"""What a plan reads of a notebook's model and pool at a tier: the model's config without weights (`plan_config`), its
parameters, and the CB pool the notebook fixes (`pool_config`: the notebook runs it, `plan_notebook` plans with it)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from cbkit.measure import roofline
from cbkit.measure.planner import pool_blocks, training_bytes
from cbkit.teach.tiers.table import (
    CUDA_TOTAL_BYTES,
    GPU_MODEL,
    GPU_TIERS,
    LESSON_PAGE_SIZE,
    PROMPT_LEN,
    TIER_MEMORY,
    Sizes,
)

# The hub models' config.json (the numbers the plan reads), so that planning needs no download: Qwen2.5-0.5B-Instruct
# (the notebooks' GPU model) and SmolLM2-360M-Instruct (the sweep's t4 preset). Llama-3.2-1B-Instruct (the a100
# preset) has the shape of `llama-1b-random`, which cbkit builds in code.
_PLAN_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    GPU_MODEL: ("Qwen2Config", dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                                    num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                                    tie_word_embeddings=True)),
    "HuggingFaceTB/SmolLM2-360M-Instruct": ("LlamaConfig", dict(
        num_hidden_layers=32, hidden_size=960, intermediate_size=2560, num_attention_heads=15, num_key_value_heads=5,
        head_dim=64, vocab_size=49152, tie_word_embeddings=True)),
}
_SAME_SHAPE = {"meta-llama/Llama-3.2-1B-Instruct": "llama-1b-random"}


@functools.cache
def plan_config(model: str) -> Any:
    """The config a plan reads, without weights: written out for the GPU model (a real transformers config, which
    the engine's admission check builds its cache from), else `models.load.load_config`."""
    if model in _PLAN_CONFIGS:
        import transformers

        kind, values = _PLAN_CONFIGS[model]
        return getattr(transformers, kind)(**values)
    from cbkit.models.load import load_config

    return load_config(_SAME_SHAPE.get(model, model))


def device_bytes(machine: str) -> int:
    """A checked GPU's total memory as CUDA reports it where known (`CUDA_TOTAL_BYTES`), else roofline's datasheet."""
    return CUDA_TOTAL_BYTES.get(machine) or roofline.GPUS[machine].total_memory()


def parameter_count(config: Any) -> int:
    """Weights of a config: its matmul weights plus the embedding where it is not tied to the LM head (norms and
    biases, well under 1%, left out)."""
    shape = roofline.Shape.of(config)
    tied = getattr(config, "tie_word_embeddings", True)
    return shape.matmul_params + (0 if tied else shape.vocab * shape.hidden)


def pool_bytes(config: Any, tier: str, share: float, *, memory_bytes: int | None = None) -> int:
    """``share`` x what a training step of this model leaves free on the tier's smallest GPU: its memory less the
    optimizer state (16 bytes a parameter, `planner.training_bytes`). A model too large to train there (a 1B on a
    T4) gets the share of what its bf16/fp16 weights leave."""
    memory = memory_bytes or TIER_MEMORY[tier]
    params = parameter_count(config)
    state = training_bytes(params, micro_batch_rows=0, tokens_per_row=0, completion_len=1, config=config,
                           autocast=True)["optimizer_state"]
    left = memory - state if state < memory / 2 else memory - 2 * params
    if not 0 < share <= 1:
        raise ValueError(f"pool_share is a share of free memory in (0, 1], got {share}.")
    return int(share * left)


def pool_config(config: Any, sizes: Sizes, tier: str, *, dtype_bytes: int, rows: Sequence[Sequence[int]] = (),
                max_new_tokens: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """The CB engine settings that fix a notebook's pool: ``{}`` (cbkit's default) where the sizes fix none. The one
    rule for it: the notebook runs it (`NotebookEnv.pool_config`) and `plan_notebook` plans with it.

    GPU tiers: `pool_bytes` as ``num_blocks`` of ``LESSON_PAGE_SIZE`` tokens, or without a ``pool_share`` every request
    (``rows``, else prompts x n of the sizes) at full length. On a dry run the pool is the same share
    of a tier's GPU, capped to hold half the requests ``rows`` at full length, so that a CPU does not allocate
    gigabytes and the waiting still happens. CPU: ``pool_sequences`` sequences of the first row at full length."""
    from cbkit.rollout.engine_config import workload_blocks

    page = LESSON_PAGE_SIZE
    if sizes.pool_share is not None and tier in GPU_TIERS:
        blocks = pool_blocks(config, pool_bytes(config, tier, sizes.pool_share), page_size=page,
                             dtype_bytes=dtype_bytes)
        if dry_run and rows:
            blocks = min(blocks, workload_blocks(rows[: max(1, len(rows) // 2)], max_new_tokens or 1, page))
        return {"page_size": page, "num_blocks": blocks}
    if tier in GPU_TIERS:  # every request at full length: a share of free memory would be gigabytes
        # Each request gets room for a prompt twice the mean, whatever the rows' own lengths: the plan, which has no
        # prompts, then sizes the very pool the notebook allocates. A longer prompt waits for a request to end.
        requests = len(rows) or sizes.prompts * sizes.n
        return {"page_size": page, "num_blocks": workload_blocks([range(2 * PROMPT_LEN)] * requests,
                                                                 max_new_tokens or sizes.max_new_tokens, page)}
    if sizes.pool_sequences is not None and rows:
        return {"page_size": page, "num_blocks": workload_blocks([rows[0]] * sizes.pool_sequences,
                                                                 max_new_tokens or sizes.max_new_tokens, page)}
    return {}

