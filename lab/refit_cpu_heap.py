"""Refit the planner's CPU heap allowances (`cbkit/measure/fitted.py`) on this machine, public names only.

    OMP_NUM_THREADS=2 python lab/refit_cpu_heap.py rollout 8,16,32,64   # CPU_HEAP_SLACK, CPU_HEAP_SLACK_MAX
    OMP_NUM_THREADS=2 python lab/refit_cpu_heap.py step 8,32            # CPU_CHUNK_HEAP_SLACK

rollout: generate() alone on the offline SmolLM2 (fp32, GSM8K prompt 0, every completion run to 96 tokens), each N's
peak RSS beside the planner's tensors (cache + last-step transients): the heap glibc keeps, as a share of the cache
and in MiB. CPU_HEAP_SLACK is the middle of the shares below the cap; CPU_HEAP_SLACK_MAX the middle of the largest
N's MiB over a few runs (run it more than once: the same point moves between runs).

step: `cbkit sweep --full-step` (replayed GSM8K lengths, 4-row chunks) with the chunk allowance set to 0 while it
plans, and every chunk part the planner multiplies it with recorded: each run's peak above that plan, as a share of
one chunk's part. CPU_CHUNK_HEAP_SLACK is the level the runs with several chunks reach. Run on a quiet machine.
lab/cpu_heap.md has what the committed values were fitted on; write new values into fitted.py with the runs there.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

MIB = 2**20


def rollout(ns: list[int]) -> None:
    from cbkit.measure.planner import plan
    from cbkit.rollout.generate import GenerateBackend
    from cbkit.train.setup import set_up_run

    run = set_up_run("smollm2-offline", "gsm8k-local", 1, seed=0, dtype=None)
    sampling = run.sampling(96, seed=0)
    backend = GenerateBackend(run.model, pad_token_id=run.tokenizer.pad_token_id)
    backend.generate(run.prompts, 2, sampling, target_lengths=[4, 4])  # allocator and kernels warm
    for n in ns:
        measured = backend.generate(run.prompts, n, sampling, target_lengths=[96] * n).peak_mem_bytes
        g = plan(run.model.config, num_prompts=1, num_generations=n, prompt_len=[len(p) for p in run.prompts],
                 max_new_tokens=96, dtype_bytes=4, device="cpu").generate
        heap = measured - g.kv_bytes - g.decode_transient_bytes
        print(json.dumps({"N": n, "measured_mib": round(measured / MIB, 1), "cache_mib": round(g.kv_bytes / MIB, 1),
                          "heap_mib": round(heap / MIB, 1), "heap_share_of_cache": round(heap / g.kv_bytes, 3),
                          "planned_slack_mib": round(g.cpu_heap_slack_bytes / MIB, 1)}), flush=True)


class _Recording(float):
    """0.0 where the planner multiplies the allowance, remembering what it was multiplied with (one chunk's part)."""

    parts: list[float] = []

    def __mul__(self, other):
        _Recording.parts.append(float(other))
        return 0.0

    __rmul__ = __mul__


def step(ns: list[int]) -> None:
    from cbkit.cli import main as cbkit
    from cbkit.measure.results import load_runs

    out = Path(tempfile.mkdtemp()) / "full-step.jsonl"
    with mock.patch("cbkit.measure.planner.training.CPU_CHUNK_HEAP_SLACK", _Recording(0.0)):
        status = cbkit(["sweep", "--model", "smollm2-offline", "--data", "gsm8k-local", "--max-new-tokens", "96",
                        "--no-live", "--full-step", "--forward-chunk-rows", "4", "--repeats", "1",
                        "--backends", "generate,continuous", "--ns", ",".join(map(str, ns)), "--out", str(out)])
    if status:
        sys.exit(status)
    runs = [r for r in load_runs(out) if r.get("planned_peak_bytes")]
    parts = _Recording.parts
    paired = len(parts) == len(runs)
    if not paired:
        print(f"{len(parts)} chunk parts planned for {len(runs)} runs: shares left out, excess in MiB only")
    for i, r in enumerate(runs):
        excess = r["peak_mem_bytes"] - r["planned_peak_bytes"]
        line = {"N": r["N"], "backend": r["backend"], "phase": r.get("planned_phase"),
                "excess_mib": round(excess / MIB, 1)}
        if paired and parts[i] > 0:
            line["excess_share_of_chunk"] = round(excess / parts[i], 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("rollout", "step"):
        sys.exit(__doc__)
    {"rollout": rollout, "step": step}[sys.argv[1]](
        [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8,16,32,64").split(",")])
