"""The CB engine's loop in transformers' thread and in the caller's thread, alternating, in one process.

SmolLM2 (`smollm2-offline`, fp32), one GSM8K prompt x N, EOS off, TOKENS new tokens each (the `fixed` workload).
Usage: python lab/probes/engine_loop_ab.py [N] [TOKENS] [PAIRS]
"""
# Runs against cbkit as of commit d091adf (`git worktree add /tmp/at-d091adf d091adf`): its `engine_loop` option left the
# package after this probe was run (the loop is now chosen by device); its result stays in lab/.

from __future__ import annotations

import sys
import time

from cbkit.rollout.engine import Engine
from cbkit.train.setup import set_up_run


def on_loop(run, loop: str):
    """The CB backend with its engine's loop in `loop`: cbkit offers no such option (the engine picks the caller's
    loop on CPU), so the probe swaps the engine in, then warms it up as `run.backend` does."""
    backend = run.backend("continuous", warm_up=False)
    backend.engine = Engine(run.model, engine_loop=loop)
    backend.generate(run.prompts[:1], 1, run.sampling(4, seed=0))
    return backend


def main() -> None:
    n, tokens, pairs = (int(a) for a in (sys.argv[1:] + ["8", "32", "2"][len(sys.argv) - 1:])[:3])
    run = set_up_run("smollm2-offline", "gsm8k-local", 1, seed=0)
    sampling = run.sampling(tokens, seed=0)
    backends = {loop: on_loop(run, loop) for loop in ("thread", "caller")}
    for i in range(pairs):
        for loop in ("thread", "caller") if i % 2 == 0 else ("caller", "thread"):
            start = time.perf_counter()
            backends[loop].generate(run.prompts, n, sampling, target_lengths=[tokens] * n)
            print(f"{loop:>6}: {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
