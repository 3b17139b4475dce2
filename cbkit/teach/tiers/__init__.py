"""The notebooks on the GPUs their users have: every size of every notebook, per tier, in one table, and the
plan that checks each one without a GPU (`cbkit tiers`).

A notebook's parameters cell reads its sizes from ``NOTEBOOKS`` (``env.sizes``), so what a facilitator checks
before a workshop is what the notebook will run. For every notebook and GPU (a T4's 14.74 GiB in fp16, an A100's
40 and 80 GiB in bf16) the check asks three questions, each answered by arithmetic, never by a run:

* **does it fit?** The planner's peak (`cbkit.measure.planner`) of every rollout the notebook makes, plus the
  weights, plus, where the notebook trains, what the training step holds (`planner.training_bytes`);
* **does it finish in time?** ~10 minutes on a T4, ~5 on an A100, by the roofline (`cbkit.measure.roofline`'s
  ``estimated_*_seconds``: the roof slowed to an assumed efficiency, never under a per-step launch floor), plus
  ``OVERHEAD_S`` for imports and loading (downloads excluded). An estimate until a GPU run replaces it;
* **does it show its phenomenon?** Each memory sweep's crossover (the first N at which the CB engine's peak is
  below ``generate()``'s, ``planner.crossover_n``) must lie inside the swept N, or the figure teaches the
  opposite of its text.

One module a concept: `table` (the sizes per tier and the GPUs' constants), `pool` (the model's config, its
parameters and the pool a notebook fixes), `plan` (one notebook on one GPU: `plan_notebook`, `TierPlan`, each engine
start's admission), `runtime` (its minutes by the roofline), `checks` (every notebook, recipe and sweep preset: what
`cbkit tiers` prints).

**The pool is a fixed price.** On a GPU the CB engine's default pool is half the free memory, 7 to 35 GiB,
which no notebook-sized ``generate()`` batch outgrows. TRL's benchmark shows the inversion because its pool is a
share (``max_memory_percent=0.4``) of what the *training step* leaves free. So on a GPU tier the notebooks fix
the pool in bytes: ``pool_share`` x (the tier's smallest GPU - the optimizer state a training step of the
rolled-out model holds), the same pool on a 40 and an 80 GiB A100, and the same crossover.

``CBKIT_TIER=t4|a100`` with ``CBKIT_PROFILE=ci`` runs a notebook's tier on a CPU at dry-run sizes
(``Sizes.dry``): every tier branch, preset and TRL config executes in CI, on a 2-layer random model.
"""

from __future__ import annotations

from cbkit.teach.tiers.checks import (
    PRESET_MACHINES,
    PresetPlan,
    plan_all,
    plan_presets,
    plan_recipes,
    tiers_report,
)
from cbkit.teach.tiers.plan import (
    EngineStart,
    TierPlan,
    engine_admission,
    plan_notebook,
)
from cbkit.teach.tiers.pool import parameter_count, plan_config, pool_bytes, pool_config
from cbkit.teach.tiers.runtime import estimated_train_step
from cbkit.teach.tiers.table import (
    BUDGET_S,
    CAPABILITY,
    CUDA_CONTEXT_BYTES,
    DRY_MODEL,
    GPU_MODEL,
    GPU_TIERS,
    LESSON_PAGE_SIZE,
    LOGITS_BUDGET_BYTES,
    MACHINES,
    NOTEBOOKS,
    OVERHEAD_S,
    POOL_SHARE,
    PROMPT_LEN,
    RECIPE_BUDGET_S,
    RECIPES,
    TIER_MEMORY,
    TIERS,
    GiB,
    NotebookSpec,
    Sizes,
    notebook_spec,
    sizes_for,
)

__all__ = [
    "BUDGET_S",
    "CAPABILITY",
    "CUDA_CONTEXT_BYTES",
    "DRY_MODEL",
    "GPU_MODEL",
    "GPU_TIERS",
    "LESSON_PAGE_SIZE",
    "LOGITS_BUDGET_BYTES",
    "MACHINES",
    "NOTEBOOKS",
    "OVERHEAD_S",
    "POOL_SHARE",
    "PRESET_MACHINES",
    "PROMPT_LEN",
    "RECIPES",
    "RECIPE_BUDGET_S",
    "TIERS",
    "TIER_MEMORY",
    "EngineStart",
    "GiB",
    "NotebookSpec",
    "PresetPlan",
    "Sizes",
    "TierPlan",
    "engine_admission",
    "estimated_train_step",
    "notebook_spec",
    "parameter_count",
    "plan_all",
    "plan_config",
    "plan_notebook",
    "plan_presets",
    "plan_recipes",
    "pool_bytes",
    "pool_config",
    "sizes_for",
    "tiers_report",
]
