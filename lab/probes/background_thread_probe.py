"""The same generate() rollout run in the main thread and in a background thread, alternating.

transformers' CB engine runs its loop in a background thread; this measures what that costs on this machine
with no engine involved (SmolLM2, one GSM8K prompt x N, EOS off, TOKENS new tokens, 96 by default).
Usage: python lab/probes/background_thread_probe.py [N] [TOKENS]
"""

from __future__ import annotations

import sys
import threading
import time

from cbkit.train.setup import set_up_run


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    run = set_up_run("smollm2-offline", "gsm8k-local", 1, seed=0)
    sampling = run.sampling(tokens, seed=0)
    backend = run.backend("generate")

    def once(where: str) -> None:
        start = time.perf_counter()
        backend.generate(run.prompts, n, sampling, target_lengths=[tokens] * n)
        print(f"{where:>10} thread: {time.perf_counter() - start:.2f} s", flush=True)

    for _ in range(2):
        once("main")
        t = threading.Thread(target=once, args=("background",))
        t.start()
        t.join()


if __name__ == "__main__":
    main()
