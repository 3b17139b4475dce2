"""The CB engine's CPU attention against its two "befores", as `cbkit sweep` times them: the `fixed` workload at N=64.

* per_sequence: one SDPA call per packed sequence (cbkit's CPU attention before decode batching), the tests'
  reference `tests/reference_attention.py::per_sequence_attention`;
* engine: transformers' own attention, its dense block-diagonal mask over the whole batch (what the engine runs on a
  CPU without cbkit, and what cbkit falls back to for a model its varlen attention cannot serve).

cbkit offers neither as an option: the swap is made here, through the tests' context managers, and the sweep is the
public `cbkit sweep`. Writes OUT/cpu-fixed-n64-{per_sequence,engine}.jsonl (scripts/cpu_results_table.py reads them).
Usage: python lab/cpu_attention_ab.py [OUT]    # OUT defaults to lab/results; run on a quiet machine
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' reference attention

from cbkit.cli import main as cbkit  # noqa: E402
from tests.reference_attention import engine_own_attention, per_sequence_engine_attention  # noqa: E402

BEFORES = {"per_sequence": per_sequence_engine_attention, "engine": engine_own_attention}


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "lab" / "results"
    common = ["sweep", "--model", "smollm2-offline", "--data", "gsm8k-local", "--max-new-tokens", "96", "--no-live",
              "--lengths", "fixed", "--ns", "64", "--repeats", "1"]
    for name, attention in BEFORES.items():
        with attention():
            status = cbkit([*common, "--out", str(out / f"cpu-fixed-n64-{name}.jsonl")])
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
