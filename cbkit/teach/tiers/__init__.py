"""The notebooks on the GPUs their users have: every size of every notebook, per tier, in one table (`table`), and
the plan that checks each one without a GPU (`plan`, `cbkit tiers`).

A notebook's parameters cell reads its sizes from ``NOTEBOOKS`` (``env.sizes``), so what a facilitator checks before
a workshop is what the notebook will run. For every notebook and GPU (a T4's 14.74 GiB in fp16, an A100's 40 and 80
GiB in bf16) the check asks, by arithmetic, never by a run: does it fit (the planner's peak of every rollout, the
weights, the training step where it trains, and transformers' own admission check of every CB engine start)? Does it
finish in time (the roofline's estimate, ~10 minutes on a T4, ~5 on an A100)? Does each memory sweep's crossover
(``planner.crossover_n``) lie inside the swept N, or the figure teaches the opposite of its text?

**The pool is a fixed price.** On a GPU the engine's default pool is half the free memory, which no notebook-sized
``generate()`` batch outgrows; TRL's benchmark shows the inversion because its pool is a share of what the *training
step* leaves free. So on a GPU tier the notebooks fix the pool in bytes: ``pool_share`` x (the tier's smallest GPU -
the optimizer state a training step holds), the same pool and crossover on a 40 and an 80 GiB A100.

``CBKIT_TIER=t4|a100`` with ``CBKIT_PROFILE=ci`` runs a notebook's tier on a CPU at dry-run sizes (``Sizes.dry``).
"""

from __future__ import annotations

from cbkit.teach.tiers.plan import (
    PRESET_MACHINES,
    EngineStart,
    PresetPlan,
    TierPlan,
    engine_admission,
    estimated_train_step,
    parameter_count,
    plan_all,
    plan_config,
    plan_notebook,
    plan_presets,
    plan_recipes,
    pool_bytes,
    pool_config,
    tiers_report,
)
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

__all__ = ["BUDGET_S", "CAPABILITY", "CUDA_CONTEXT_BYTES", "DRY_MODEL", "GPU_MODEL", "GPU_TIERS", "LESSON_PAGE_SIZE",
           "LOGITS_BUDGET_BYTES", "MACHINES", "NOTEBOOKS", "OVERHEAD_S", "POOL_SHARE", "PRESET_MACHINES", "PROMPT_LEN",
           "RECIPES", "RECIPE_BUDGET_S", "TIERS", "TIER_MEMORY", "EngineStart", "GiB", "NotebookSpec", "PresetPlan",
           "Sizes", "TierPlan", "engine_admission", "estimated_train_step", "notebook_spec", "parameter_count",
           "plan_all", "plan_config", "plan_notebook", "plan_presets", "plan_recipes", "pool_bytes", "pool_config",
           "sizes_for", "tiers_report"]
