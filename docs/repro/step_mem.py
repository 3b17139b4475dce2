"""One full GRPO step of the sweep's (`cbkit sweep --full-step`), phase by phase: the process's peak RSS in each phase
above the step's starting point, beside the step planner's terms (`planner.step_peak_bytes`).

The step is the sweep's own (`measure_full_step`'s trainer, backend, replayed GSM8K lengths and 4-row chunks), run
stage by stage: the rollout, the old-logprob forward (`prepare`), each chunk's forward + backward, the optimizer step.
Between phases the kernel's high-water mark (VmHWM) is read and reset (/proc/self/clear_refs "5"), so each phase's
peak is its own; the resident memory at each phase's end is printed too (what the next phase starts from). Memory
does not depend on the machine's load, so it runs at nice 19 with one thread beside other work:

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python docs/repro/step_mem.py generate,continuous 8,32,64
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python docs/repro/step_mem.py continuous-async 8

(``continuous-async``: the sweep's async row, two steps, each stage of each step marked.)

``--saved`` instead counts what autograd keeps for the backward of one 4-row training forward (231 tokens a row, as
the N=8 step's longest chunk), by storage and by module of one layer, beside `planner.activation_bytes_per_token`:

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python docs/repro/step_mem.py generate 8 --saved

One JSON line per step (backend and N) with its phases and the plan; results: docs/measuring.md.
"""

import argparse
import gc
import json
from pathlib import Path

import torch

import cbkit.train.grpo as grpo
from cbkit.measure.planner import step_peak_bytes, training_bytes
from cbkit.measure.sweep import (
    AFTER_THE_ROLLOUT,
    ASYNC_BACKEND,
    SweepConfig,
    _planned,
    _planned_step,
    _Replayed,
    _step_config,
)
from cbkit.telemetry import _high_water_mark, resident_bytes, return_freed_memory_to_os
from cbkit.train.grpo import GRPOTrainer
from cbkit.train.setup import set_up_run

ap = argparse.ArgumentParser()
ap.add_argument("backends")
ap.add_argument("ns")
ap.add_argument("--saved", action="store_true", help="count the tensors autograd saves in one training forward")
args = ap.parse_args()
torch.set_num_threads(1)


def saved_tensors(rows: int = 4, width: int = 231, completion: int = 94) -> None:
    from cbkit.measure.planner import activation_bytes_per_token
    from cbkit.models.load import load_policy

    model = load_policy("smollm2-offline").model
    ids = torch.randint(0, model.config.vocab_size, (rows, width))
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, :20] = 0  # a padded row, as the loop's batches have: transformers then passes SDPA a mask
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen, by_module = ["model"], {}, []
    for name, m in model.model.layers[3].named_modules():
        m.register_forward_pre_hook(lambda mod, a, name=name: where.append(name or "layer"))
        m.register_forward_hook(lambda mod, a, o: (where.pop(), None)[1])

    def keep(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
            by_module.append((where[-1], tuple(t.shape), seen[ptr]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=completion + 1, use_cache=False)
    del out  # the forward's logits are not saved: the loss's logsumexp saves them (`logits_bytes` plans those)
    for module, shape, nbytes in by_module:
        if module != "model":
            print(f"layer 3 {module}: {shape} {nbytes} bytes")
    print(json.dumps({"saved_bytes": sum(seen.values()),
                      "planned": rows * width * activation_bytes_per_token(model.config, width, autocast=False)}))


if args.saved:
    saved_tensors()
    raise SystemExit

cfg = SweepConfig(data="gsm8k-local", full_step=True, lengths="replay:gsm8k", repeats=1)
setup = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed)
model, prompts = setup.model, setup.prompts
params = sum(p.numel() for p in model.parameters())
backends = {b: setup.backend(b) for b in args.backends.split(",") if b != ASYNC_BACKEND}


class Marks:
    """Reads and resets VmHWM at each phase boundary: the phase's peak and where it left RSS, above the baseline."""

    def __init__(self) -> None:
        self.baseline = resident_bytes()
        Path("/proc/self/clear_refs").write_text("5")
        self.rows = []

    def __call__(self, phase: str) -> None:
        self.rows.append({"phase": phase, "peak": _high_water_mark() - self.baseline,
                          "end": resident_bytes() - self.baseline})
        Path("/proc/self/clear_refs").write_text("5")


def one_step(backend, n: int) -> dict:
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    targets = cfg.workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=cfg.seed)
    config = _step_config(cfg, n, 0, len(setup.problems), max_steps=1,
                          use_transformers_continuous_batching=backend.name == "continuous")
    trainer = GRPOTrainer(config, policy=(model, setup.tokenizer), backend=_Replayed(backend, targets),
                          problems=setup.problems)
    gc.collect()  # the last step's trainer, as the sweep does (`sweep._collect_garbage`)
    return_freed_memory_to_os()
    marks = Marks()
    chunk = {"k": 0, "phase": None}
    inner = grpo.completion_logits

    def marked(*a, **kw):  # each training chunk's forward starts here: the chunk before it has back-propagated
        if chunk["phase"] == "update":
            if chunk["k"]:
                marks(f"chunk {chunk['k']} fwd+bwd")
            chunk["k"] += 1
        return inner(*a, **kw)

    grpo.completion_logits = marked
    try:
        indices = trainer.order.indices(0, config.prompts_per_step)
        rollout = trainer.rollout(indices, 1)
        marks("rollout")
        rewards, _ = trainer.score(rollout, [trainer.problems[i] for i in indices])
        prepared = trainer.prepare(rollout, rewards)
        marks("old-logprob forward")
        chunk["phase"] = "update"
        trainer.accumulate_gradients(prepared)
        marks(f"chunk {chunk['k']} fwd+bwd")
        trainer.optimizer_step()
        marks("optimizer step")
    finally:
        grpo.completion_logits = inner
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
    step_peak = max(r["peak"] for r in marks.rows)
    run = {"backend": backend.name, "engine_config": rollout.engine_config, "peak_mem_bytes": step_peak}
    rollout_plan = _planned(cfg, model, prompts, n, backend.name, 4, None, run, targets)
    longest = max(targets)
    terms = step_peak_bytes(params, rollout_peak_bytes=rollout_plan["planned_peak_bytes"], micro_batch_rows=len(targets),
                            chunk_rows=cfg.forward_chunk_rows, tokens_per_row=max(map(len, prompts)) + longest,
                            completion_len=longest, config=model.config, autocast=False, device="cpu")
    train = training_bytes(params, micro_batch_rows=len(targets), chunk_rows=cfg.forward_chunk_rows,
                           tokens_per_row=max(map(len, prompts)) + longest, completion_len=longest,
                           config=model.config, autocast=False)
    return {"backend": backend.name, "N": n, "phases": marks.rows, "step_peak": step_peak,
            "planned": _planned_step(cfg, model, prompts, n, run, rollout_plan, targets), "step_terms": terms,
            "train_terms": train, "rollout_plan": rollout_plan}

def async_steps(n: int, steps: int = 2) -> dict:
    """The sweep's async row (`measure_async_steps`): `steps` steps, each later one training while the next rollout
    decodes in the engine's thread; marks before and after each stage of every step."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    targets = cfg.workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=cfg.seed)
    config = _step_config(cfg, n, 0, len(setup.problems), use_transformers_continuous_batching=True,
                          async_rollouts=True, async_update_at=AFTER_THE_ROLLOUT, max_steps=steps + 1,
                          transformers_continuous_batching_config={})
    trainer = GRPOTrainer(config, policy=(model, setup.tokenizer), problems=setup.problems)
    trainer.offpolicy.target_lengths = list(targets)
    gc.collect()
    return_freed_memory_to_os()
    marks = Marks()
    step = {"k": 0, "chunk": 0}

    def around(obj, name: str, before: str | None = None):
        inner = getattr(obj, name)

        def run(*a, **kw):
            if before:
                marks(f"step {step['k']} {before}")
            out = inner(*a, **kw)
            marks(f"step {step['k']} {name}")
            return out
        setattr(obj, name, run)

    around(trainer, "prepare", before="rollout wait + next submit")
    around(trainer, "optimizer_step")
    around(trainer.offpolicy, "after_step")
    inner = grpo.completion_logits

    def marked(*a, **kw):
        if torch.is_grad_enabled():  # a training chunk (the old-logprob forward runs without grad)
            if step["chunk"]:
                marks(f"step {step['k']} chunk {step['chunk']} fwd+bwd")
            step["chunk"] += 1
        return inner(*a, **kw)

    grpo.completion_logits = marked
    try:
        for k in range(1, steps + 1):
            step.update(k=k, chunk=0)
            trainer.step()
    finally:
        grpo.completion_logits = inner
        trainer.close()
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
    return {"backend": ASYNC_BACKEND, "N": n, "phases": marks.rows, "step_peak": max(r["peak"] for r in marks.rows)}


for n in [int(x) for x in args.ns.split(",")]:
    for name in args.backends.split(","):  # in the order given: a step's heap depends on the steps before it
        print(json.dumps(async_steps(n) if name == ASYNC_BACKEND else one_step(backends[name], n)), flush=True)
