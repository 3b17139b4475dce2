"""The notebooks on the GPUs their users have: every size of every notebook per tier in one table (`table`: a
notebook's parameters cell reads its row, ``env.sizes``), and the plan that checks each one without a GPU (`plan`,
`cbkit tiers`): does it fit, will the engine start, does each memory sweep's crossover lie inside its swept N. On
a GPU tier the notebooks fix the pool in bytes (``pool_share`` x what a training step leaves on the tier's smallest
GPU), as TRL's pool is a share of what its trainer leaves: the engine's default, half the free memory, is a pool no
notebook-sized ``generate()`` batch outgrows. docs/tiers.md has the table `cbkit tiers` prints.
"""

from __future__ import annotations

from cbkit.teach.tiers.plan import (
    PRESET_MACHINES,
    EngineStart,
    PresetPlan,
    TierPlan,
    engine_admission,
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
    CAPABILITY,
    CUDA_CONTEXT_BYTES,
    DRY_MODEL,
    GPU_MODEL,
    GPU_TIERS,
    LESSON_PAGE_SIZE,
    LOGITS_BUDGET_BYTES,
    MACHINES,
    NOTEBOOKS,
    POOL_SHARE,
    PROMPT_LEN,
    RECIPES,
    TIER_MEMORY,
    TIERS,
    GiB,
    NotebookSpec,
    Sizes,
    notebook_spec,
    sizes_for,
)

__all__ = ["CAPABILITY", "CUDA_CONTEXT_BYTES", "DRY_MODEL", "GPU_MODEL", "GPU_TIERS", "LESSON_PAGE_SIZE",
           "LOGITS_BUDGET_BYTES", "MACHINES", "NOTEBOOKS", "POOL_SHARE", "PRESET_MACHINES", "PROMPT_LEN",
           "RECIPES", "TIERS", "TIER_MEMORY", "EngineStart", "GiB", "NotebookSpec", "PresetPlan",
           "Sizes", "TierPlan", "engine_admission", "notebook_spec", "parameter_count",
           "plan_all", "plan_config", "plan_notebook", "plan_presets", "plan_recipes", "pool_bytes", "pool_config",
           "sizes_for", "tiers_report"]
