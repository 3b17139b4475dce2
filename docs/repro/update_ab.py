"""The update phase of the sweep's full GRPO step (`cbkit sweep --full-step`: its trainer, replayed GSM8K lengths,
4-row chunks), timed several ways in alternation on one prepared rollout, with a matmul probe beside each round:

    OMP_NUM_THREADS=2 .venv/bin/python docs/repro/update_ab.py 8,64 --rounds 3

Variants, before and after side by side: ``before`` (the chunks cut in the rollout's order, each padded to its
longest row, and torch's multi-pass AdamW, as the trainer was), ``by-length`` (each micro-batch's rows longest
first before they are cut into chunks, so a chunk pads to rows of about its own length), ``after`` (by length,
and AdamW's fused kernel: the trainer as it is, `optim="adamw_torch_fused"`). Every
variant starts from the same weights, a fresh optimizer and the same advantages (spread over [-1, 1]: the
replayed GSM8K completions all score 0, so the step's own advantages are 0); each prints its seconds, its share
of the update's roof on the probe taken just before it (`roofline.training_roofline`: FLOPs and AdamW's bytes;
and of its compute roof, FLOPs only), its loss and gradient
norm (equal across variants to float tolerance, or the variant computes something else), and the tokens its
chunks forward. ``--second`` times a second update after each, with AdamW's moments then in place, as every step
of a run after its first has them. Results: docs/measuring.md.
"""

import argparse
import json
import time

import torch

import cbkit.train.grpo as grpo
from cbkit.measure.probe import bandwidth_probe, matmul_probe
from cbkit.measure.roofline import training_roofline
from cbkit.measure.sweep import SweepConfig, _Replayed, _step_config
from cbkit.train.grpo import GRPOTrainer
from cbkit.train.setup import set_up_run

ap = argparse.ArgumentParser()
ap.add_argument("ns")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--variants", default="before,by-length,after")
ap.add_argument("--second", action="store_true", help="time a second update after each (optimizer state in place)")
args = ap.parse_args()

cfg = SweepConfig(data="gsm8k-local", full_step=True, lengths="replay:gsm8k", repeats=1)
setup = set_up_run(cfg.model, cfg.data, cfg.num_prompts, seed=cfg.seed)
model, prompts = setup.model, setup.prompts
params = sum(p.numel() for p in model.parameters())
backend = setup.backend("continuous")
start_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}


by_length = grpo._chunks


def rollout_order(start, stop, rows, attention_mask):
    """The chunks as they were cut before: rows [start, stop) in the rollout's order."""
    step = stop - start if rows is None else rows
    return [torch.arange(i, min(i + step, stop)) for i in range(start, stop, step)]


def forwarded(chunks, batch) -> int:
    return sum(batch.take(rows).input_ids.numel() for rows in chunks)


for n in [int(x) for x in args.ns.split(",")]:
    targets = cfg.workload.targets(len(prompts) * n, cfg.max_new_tokens, seed=cfg.seed)
    config = _step_config(cfg, n, 0, len(setup.problems), max_steps=1, use_transformers_continuous_batching=True)
    trainer = GRPOTrainer(config, policy=(model, setup.tokenizer), backend=_Replayed(backend, targets),
                          problems=setup.problems)
    indices = trainer.order.indices(0, config.prompts_per_step)
    rollout = trainer.rollout(indices, 1)
    prepared = trainer.prepare(rollout, trainer.score(rollout, [trainer.problems[i] for i in indices])[0])
    rows = [(len(c.prompt_ids), len(c.completion_ids)) for c in rollout.completions]
    chunks = len(range(0, len(rows), cfg.forward_chunk_rows))
    prepared.advantages = torch.linspace(-1, 1, len(rows))[torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))]
    b, k = prepared.batch, cfg.forward_chunk_rows
    print(json.dumps({"N": n, "rows": len(rows), "real_tokens": int(b.attention_mask.sum()),
                      "forwarded_rollout_order": forwarded(rollout_order(0, len(b), k, b.attention_mask), b),
                      "forwarded_by_length": forwarded(by_length(0, len(b), k, b.attention_mask), b)}), flush=True)
    for r in range(args.rounds):
        for variant in args.variants.split(","):
            model.load_state_dict(start_weights)
            trainer.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate,
                betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
                weight_decay=config.weight_decay, fused=variant == "after")
            grpo._chunks = rollout_order if variant == "before" else by_length
            probe = matmul_probe(model)["peak_flops"]
            bw = bandwidth_probe(model.device)["bytes_per_s"]
            roof = training_roofline(model.config, rows=rows, forwards=chunks, params=params, dtype_bytes=4,
                                     peak_flops=probe, bytes_per_s=bw)
            t0 = time.perf_counter()
            metrics = trainer.optimize(prepared)
            s = time.perf_counter() - t0
            line = {"N": n, "round": r, "variant": variant, "update_s": round(s, 2),
                    "probe_gflops": round(probe / 1e9, 1), "of_roof": round(roof["update_roof_s"] / s, 3),
                    "of_compute_roof": round(roof["update_compute_roof_s"] / s, 3),
                    "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"]}
            if args.second:  # the same update again: AdamW's moments now exist, as in every step of a run after its first
                t0 = time.perf_counter()
                trainer.optimize(prepared)
                s2 = time.perf_counter() - t0
                line.update(second_update_s=round(s2, 2), second_of_roof=round(roof["update_roof_s"] / s2, 3))
            print(json.dumps(line), flush=True)
    del trainer
grpo._chunks = by_length
model.load_state_dict(start_weights)
