"""Regenerate cbkit/resources/gsm8k_train_solution_lengths.json: the `replay:gsm8k` length workload.

    python scripts/gsm8k_lengths.py [--train /path/to/gsm8k/train.jsonl]

Each GSM8K *train* problem's reference solution (its `answer` field, the worked steps and the `#### n` line)
is tokenized with SmolLM2-135M-Instruct's tokenizer (the offline copy cbkit loads, so no hub access), plain
text without special tokens. The lengths are stored in file order with where they came from, so the sweep
can replay them offline without a dataset download. The train split is used so that the test split, which
the kit evaluates on, stays unseen by anything the benchmark was set up with.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRAIN = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
OUT = REPO / "cbkit" / "resources" / "gsm8k_train_solution_lengths.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=DEFAULT_TRAIN, help="GSM8K train.jsonl (question, answer)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not args.train.is_file():
        raise SystemExit(f"No GSM8K train split at {args.train}; pass --train /path/to/train.jsonl.")

    from cbkit.models.load import load_policy

    tok = load_policy("smollm2-offline").tokenizer
    answers = [json.loads(line)["answer"] for line in args.train.read_text().splitlines() if line.strip()]
    lengths = [len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers]
    record = {
        "source": "GSM8K train split, reference solutions (the `answer` field), tokenized as plain text",
        "tokenizer": "SmolLM2-135M-Instruct (cbkit's smollm2-offline)",
        "script": "scripts/gsm8k_lengths.py",
        "count": len(lengths),
        "lengths": lengths,
    }
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    s = sorted(lengths)
    print(f"{args.out}: {len(lengths)} lengths, mean {statistics.mean(s):.1f}, "
          f"CV {statistics.pstdev(s) / statistics.mean(s):.2f}, p95 {s[-(-95 * len(s) // 100) - 1]}, max {s[-1]}")


if __name__ == "__main__":
    main()
