#!/usr/bin/env bash
# TRL's benchmark (PR #5765) measured on one GPU, in one call, on a machine with torch and transformers and nothing else
# (no model hub, no dataset hub, no package index):
#
#   bash scripts/gpu_sweep.sh                   # one A100/H100/H200: <= 8 min; everything lands in runs/gpu/
#   CBKIT_DRY_RUN=1 bash scripts/gpu_sweep.sh   # the same script at test size on CPU (CI runs it)
#
# It runs `cbkit sweep --preset trl-benchmark` from this checkout (no install needed): Llama-3.2-1B-Instruct's exact
# shape with random weights (`llama-1b-random`, built on the GPU in bf16, no download), 4 synthetic GSM-style
# prompts, N = 8, 32, 64, both backends, and completion lengths replayed from GSM8K's solutions scaled so
# their p95 is the benchmark's 2048 new tokens (EOS ignored: both backends do the same useful work). Timing and
# memory depend on the shapes and the token counts, not on the weight values. It prints the benchmark-shaped
# table, the planner's predictions beside the measured peaks (allocated, reserved, device used, NVML when
# nvidia-ml-py is there), and TRL PR #5765's table beside this run's. Then, if under EXTRA_IF_UNDER_S
# seconds have passed, it adds N=16 to the same results file (the sweep resumes, so only N=16 runs).
#
# Why it fits 8 minutes (an estimate, to be replaced by the first measurement): a decode step of a 1B model
# under HF eager execution is bound by kernel launches, not by the GPU: TRL PR #5765's own generate() took
# 41.12 s for up to 2048 tokens at N=64 on an A100, about 20 ms a step. The largest point here holds
# 4 x 64 = 256 rows: 2 x 1.24e9 params x 256 rows = 0.63 TFLOP a step (~3 ms at the ~200 TFLOP/s a bf16
# A100 sustains) and at most 256 x 2200 tokens x 32 KiB = 18 GB of KV cache, read once a step (~9 ms at
# 2 TB/s), both overlapping the ~20 ms of launches. So a rollout of 2048 steps takes ~40-60 s; 6 rollouts,
# the warm-up, the model build and the matmul probe make ~5-6.5 minutes, leaving the N=16 pair for a faster
# card. An interrupted run keeps every finished rollout: rerun the same command to resume.
#
# Environment: OUT (results folder), PYTHON, and NS / PROMPTS / MAX_NEW_TOKENS / REPEATS / MODEL (a local
# model directory works the same way) / DATA / DTYPE (float16 on a card without bf16) / LENGTHS (the length
# workload: natural, fixed or replay:FILE; see the README's `--lengths`) override the preset. Bring back the folder: it is a few kB of JSONL,
# CSV and logs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "${CBKIT_DRY_RUN:-0}" = 1 ]; then
  dry=(--dry-run); OUT=${OUT:-runs/gpu-dry-run}; extra_ns=2,3,4
else
  dry=(); OUT=${OUT:-runs/gpu}; extra_ns=8,16,32,64
fi
EXTRA_IF_UNDER_S=${EXTRA_IF_UNDER_S:-240}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
} 2>&1 | tee "$OUT/env.txt"

sweep() {
  "$PYTHON" -m cbkit.cli sweep --preset trl-benchmark "${dry[@]}" --no-live --out "$OUT/sweep.jsonl" \
    ${PROMPTS:+--num-prompts "$PROMPTS"} ${MAX_NEW_TOKENS:+--max-new-tokens "$MAX_NEW_TOKENS"} \
    ${REPEATS:+--repeats "$REPEATS"} ${MODEL:+--model "$MODEL"} ${DATA:+--data "$DATA"} ${DTYPE:+--dtype "$DTYPE"} \
    ${LENGTHS:+--lengths "$LENGTHS"} "$@" 2>&1 | tee -a "$OUT/sweep.log"
}

sweep ${NS:+--ns "$NS"}
elapsed=$(( $(date +%s) - start ))
if [ -z "${NS:-}" ] && [ "$elapsed" -lt "$EXTRA_IF_UNDER_S" ]; then
  echo "[gpu_sweep] ${elapsed}s so far, under ${EXTRA_IF_UNDER_S}s: adding the next N ($extra_ns, resuming)" | tee -a "$OUT/sweep.log"
  sweep --ns "$extra_ns"
fi
echo "[gpu_sweep] done in $(( $(date +%s) - start ))s; bring back $OUT/ (sweep.jsonl, sweep.csv, sweep.log, env.txt)" \
  | tee -a "$OUT/sweep.log"
