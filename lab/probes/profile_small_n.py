"""Rollouts to profile: one backend, one N, the `cbkit sweep` default shape, repeated so a sampler sees many steps.

SmolLM2 (`smollm2-offline`, fp32), one GSM8K prompt, 96 new tokens, the `fixed` workload (every completion runs to
the limit, EOS off): what `cbkit sweep --lengths fixed --data gsm8k-local` times. Run it under py-spy, e.g.
    py-spy record -r 100 --threads --format raw -o cb8.txt -- python lab/probes/profile_small_n.py continuous 8
and summarise the folded stacks with `python lab/probes/profile_summary.py cb8.txt`.
Usage: python lab/probes/profile_small_n.py BACKEND N [ROLLOUTS] [--driver caller|thread]
"""

from __future__ import annotations

import argparse
import time

from engine_loop_ab import on_loop

from cbkit.train.setup import set_up_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("backend", choices=["generate", "continuous"])
    ap.add_argument("n", type=int)
    ap.add_argument("rollouts", type=int, nargs="?", default=3)
    ap.add_argument("--driver", default=None, help="the CB engine's loop: caller (cbkit's) or thread (transformers')")
    args = ap.parse_args()
    run = set_up_run("smollm2-offline", "gsm8k-local", 1, seed=0)
    if args.driver and args.backend == "continuous":
        backend = on_loop(run, args.driver)
    else:
        backend = run.backend(args.backend)
    sampling = run.sampling(96, seed=0)
    for i in range(args.rollouts):
        start = time.perf_counter()
        backend.generate(run.prompts, args.n, sampling, target_lengths=[96] * args.n)
        print(f"{args.backend} N={args.n} rollout {i}: {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
