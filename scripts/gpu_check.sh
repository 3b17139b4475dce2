#!/usr/bin/env bash
# Everything cbkit needs a GPU to check, in one call of at most 9 minutes on a bare GPU machine (torch and
# transformers preinstalled; no network, no trl, plotly, datasets or gguf):
#
#   bash scripts/gpu_check.sh                    # on the GPU; every result lands in $OUT (runs/gpu-check/)
#   CBKIT_DRY_RUN=1 bash scripts/gpu_check.sh    # the same steps at test size on a CPU (CI runs it in the bare venv)
#
# 1. machine.json: the GPU, its compute capability, and what CUDA reports total and free once a context exists (the
#    context's own size is what `cbkit tiers` assumes, CUDA_CONTEXT_BYTES, until this replaces it).
# 2. gpu_tests.log: `pytest -m gpu` (tests/test_gpu.py, tests/test_async_rollouts.py): half-precision CB logprobs
#    against the training forward, each tier's engine start on this GPU's real free memory against cbkit's admission
#    check, a GRPO step that moves fp32 weights, the async weight publish ordered against the engine's stream.
# 3. recipe/: the learning recipe's first steps (recipes/smollm2_arith.yaml's loop, batch and lengths) on the
#    hub-less `llama-1b-random` (random weights: the loop and its timing, not learning), on synthetic problems
#    scored by the `correctness` reward (the recipe's reasoning-gym task and math-verify are not on the machine).
# 4. sweep.jsonl / sweep.log: TRL's benchmark table in its shape (`--preset trl-benchmark`: N = 8, 32, 64, with a
#    training step's state held on the GPU, TRL's pool setting), one N at a time while the budget lasts (the sweep
#    resumes, so a rerun adds the N left).
#
# transformers older than cbkit's floor (5.24; the GPU image has 5.17): carry its wheel. Here, once:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
# and name `.whl` in the run's carry with WHEELS=.whl: it is installed into $SITE (/tmp/cbkit-site), nothing else
# changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-check}
BUDGET_S=${BUDGET_S:-540}
start=$(date +%s)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  SITE=${SITE:-/tmp/cbkit-site}
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
log() { echo "[gpu_check $(( $(date +%s) - start ))s] $*" | tee -a "$OUT/gpu_check.log"; }

# 1. The machine, and whether this transformers is one cbkit runs on.
"$PYTHON" - "$OUT/machine.json" <<'EOF'
import json, sys
import torch, transformers
from packaging.version import Version
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__}
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")  # the CUDA context, nothing else
    free, total = torch.cuda.mem_get_info()
    info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                total_bytes=total, free_bytes=free, context_bytes=total - free)
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
if Version(transformers.__version__) < Version("5.24"):
    sys.exit(f"transformers {transformers.__version__} is older than cbkit's floor, 5.24: carry its wheel (WHEELS=.whl, "
             "see the head of this script).")
EOF

dry=(); steps=3; model=llama-1b-random; ns=(8 32 64)
if [ "${CBKIT_DRY_RUN:-0}" = 1 ]; then dry=(--dry-run); steps=1; model=tiny; ns=(2 4); fi

# 2. The gpu-marked tests (skipped, and so only collected, where there is no CUDA).
log "gpu tests"
"$PYTHON" -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu.py tests/test_async_rollouts.py \
  >"$OUT/gpu_tests.log" 2>&1 || { tail -20 "$OUT/gpu_tests.log"; log "gpu tests FAILED (gpu_tests.log)"; }
tail -3 "$OUT/gpu_tests.log"

# 3. The learning recipe's first steps, on the hub-less model.
log "recipe: $steps steps of recipes/smollm2_arith.yaml on $model"
rm -rf "$OUT/recipe"
"$PYTHON" -m cbkit.cli train --config recipes/smollm2_arith.yaml --model "$model" --data synthetic --data_options '{}' \
  --reward_funcs correctness --max_steps "$steps" --eval_steps 0 --save_steps 0 --disable_tqdm true \
  --output_dir "$OUT/recipe" >"$OUT/recipe.log" 2>&1 || log "recipe FAILED (recipe.log)"
tail -5 "$OUT/recipe.log"

# 4. TRL's benchmark table, one N at a time while the budget lasts: the next N is started only if twice the last one's
# time is left (a point costs more as N grows).
last=0
for n in "${ns[@]}"; do
  if [ "$(left)" -lt $(( 2 * last )) ]; then log "stopping before N=$n: $(left)s left, the last N took ${last}s"; break; fi
  t=$(date +%s)
  log "sweep N=$n"
  "$PYTHON" -m cbkit.cli sweep --preset trl-benchmark "${dry[@]}" --ns "$n" --no-live --out "$OUT/sweep.jsonl" \
    >>"$OUT/sweep.log" 2>&1 || { tail -20 "$OUT/sweep.log"; log "sweep N=$n FAILED (sweep.log)"; break; }
  last=$(( $(date +%s) - t ))
done
tail -25 "$OUT/sweep.log"
log "done in $(( $(date +%s) - start ))s; bring back $OUT/"
