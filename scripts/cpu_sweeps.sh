#!/usr/bin/env bash
# lab/cpu_results.md's CPU tables: every workload of `cbkit sweep --lengths` on the offline SmolLM2 (fp32, one GSM8K
# prompt, 96 new tokens). Run on a quiet machine (nothing else running: the numbers are ratios, but a busy machine
# changes them). Results land in lab/results/; the CPU attention's "befores" at N=64 are lab/cpu_attention_ab.py's.
set -euo pipefail
cd "$(dirname "$0")/.."
CBKIT=${CBKIT:-.venv/bin/cbkit}
OUT=${OUT:-lab/results}
common=(--model smollm2-offline --data gsm8k-local --max-new-tokens 96 --no-live)
mkdir -p "$OUT"
"$CBKIT" sweep "${common[@]}" --lengths replay:gsm8k --ns 8,32,64 --repeats 2 --out "$OUT/cpu-replay.jsonl"
"$CBKIT" sweep "${common[@]}" --lengths fixed --ns 8,32,64 --repeats 2 --out "$OUT/cpu-fixed.jsonl"
"$CBKIT" sweep "${common[@]}" --lengths natural --ns 8,32,64 --repeats 1 --out "$OUT/cpu-natural.jsonl"
"$CBKIT" sweep "${common[@]}" --lengths replay:gsm8k --num-prompts 4 --ns 8,32 --repeats 1 \
    --out "$OUT/cpu-replay-4prompts.jsonl"
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" lab/cpu_attention_ab.py "$OUT"
