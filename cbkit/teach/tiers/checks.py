"""Every notebook and recipe on every GPU, and the sweep's GPU presets: what `cbkit tiers` checks and prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cbkit.measure import roofline
from cbkit.rollout.admission import Admission, admission
from cbkit.teach.tiers.plan import TierPlan, plan_notebook
from cbkit.teach.tiers.pool import device_bytes, parameter_count, plan_config
from cbkit.teach.tiers.table import (
    CAPABILITY,
    CUDA_CONTEXT_BYTES,
    MACHINES,
    NOTEBOOKS,
    OVERHEAD_S,
    PROMPT_LEN,
    RECIPES,
)
from cbkit.telemetry import fmt_bytes


def plan_all(notebooks: Sequence[str] | None = None, machines: Sequence[str] | None = None) -> list[TierPlan]:
    return [plan_notebook(nb, m) for nb in (notebooks or list(NOTEBOOKS)) for m in (machines or list(MACHINES))]


def plan_recipes(machines: Sequence[str] | None = None) -> list[TierPlan]:
    """The learning recipes (``RECIPES``) on every GPU: an estimate until a GPU runs them."""
    return [plan_notebook(r, m) for r in RECIPES for m in (machines or list(MACHINES))]


# --- the sweep's GPU presets -------------------------------------------------------------------------------------

# The GPUs each `cbkit sweep --preset` is meant for (cbkit.measure.presets.PRESET_NEEDS), checked on the smallest.
PRESET_MACHINES = {"trl-benchmark": "a100-40", "a100": "a100-40", "t4": "t4"}


@dataclass
class PresetPlan:
    preset: str
    machine: str
    admission: Admission
    requests: int  # the largest point's requests
    full_length: int  # tokens one request holds at full length
    page: int  # tokens per KV page
    generate_bytes: int  # generate()'s planned peak at the largest point, above the weights (`planner.plan`)
    free_bytes: int  # what the GPU has left for it: total less the CUDA context, the weights and the trainer's state

    @property
    def ok(self) -> bool:
        return self.admission.fits and self.generate_bytes <= self.free_bytes

    def line(self) -> str:
        a = self.admission
        held = min(self.requests, (a.num_blocks or 0) * self.page // self.full_length) if a.fits else 0
        return (f"--preset {self.preset:14} {self.machine:8} {a.line()}; its pool holds {held} of the largest point's "
                f"{self.requests} requests at full length; generate() needs {fmt_bytes(self.generate_bytes)} of "
                f"{fmt_bytes(self.free_bytes)} | {'ok' if self.ok else 'FAIL'}")


def plan_presets() -> list[PresetPlan]:
    """Each sweep preset's largest point on its GPU, through both backends it runs: the CB engine's admission with the
    preset's own CB settings, and `generate()`'s planned peak in what the GPU has left. A preset that holds a
    trainer's state (`trainer_state`, TRL's setting) has that state resident beside the weights: gradients and
    AdamW's two moments in the weights' dtype (`rollout_timing.trainer_state_bytes`), 6 bytes a parameter in bf16."""
    import torch

    from cbkit.measure.planner import plan
    from cbkit.measure.presets import PRESETS
    from cbkit.measure.rollout_timing import TRAINER_STATE_COPIES
    from cbkit.measure.sweep_config import DEFAULT_NS
    from cbkit.rollout.engine_config import page_size

    out = []
    for name, preset in PRESETS.items():
        machine = PRESET_MACHINES[name]
        config = plan_config(preset["model"])
        params = parameter_count(config)
        dtype = getattr(torch, preset["dtype"])
        resident = dtype.itemsize * params
        if preset.get("trainer_state"):
            resident += TRAINER_STATE_COPIES * dtype.itemsize * params
        n = max(preset.get("ns", DEFAULT_NS))
        requests, new = preset["num_prompts"] * n, preset["max_new_tokens"]
        pool = dict(preset.get("cb_config", {}))
        total = device_bytes(machine)
        a = admission(config, pool, dtype=dtype, rows=[range(PROMPT_LEN)] * requests, max_new_tokens=new,
                      total_bytes=total, used_bytes=CUDA_CONTEXT_BYTES + resident, capability=CAPABILITY[machine])
        free = total - CUDA_CONTEXT_BYTES - resident
        generate = plan(config, num_prompts=preset["num_prompts"], num_generations=n, prompt_len=PROMPT_LEN,
                        max_new_tokens=new, dtype_bytes=dtype.itemsize, budget_bytes=free, device="cuda").generate
        out.append(PresetPlan(name, machine, a, requests, PROMPT_LEN + new, page_size(pool), generate.peak_bytes,
                              free))
    return out


def tiers_report(plans: Sequence[TierPlan]) -> str:
    """One line a notebook and GPU, then what is wrong with each failing one and the assumptions."""
    lines = [p.line() for p in plans]
    for p in plans:
        lines += [f"  {p.notebook} on {p.machine}: {problem}" for problem in p.problems()]
    lines += [
        "",
        f"Runtime: an estimate, not a measurement. Each decode step at {roofline.DECODE_EFFICIENCY:.0%} of the "
        f"lower roof (datasheet peaks), never under {roofline.LAUNCH_S_PER_LAYER * 1e3:.2f} ms a layer (HF's eager "
        f"kernel launches, from TRL PR #5765's 41.12 s for 2048 steps of a 16-layer model on an A100); training at "
        f"{roofline.TRAIN_EFFICIENCY:.0%} of the matmul peak; plus {OVERHEAD_S} s of imports and loading; downloads "
        "excluded. Memory: the planner's peak of every rollout (generate() held until its longest row ends, the CB "
        f"pool fixed at its share of the tier's smallest GPU), prompts of {PROMPT_LEN} tokens, plus the weights "
        "and, where the notebook trains, the optimizer state, one micro-batch's logits and its activations.",
    ]
    return "\n".join(lines)
