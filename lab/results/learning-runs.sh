#!/bin/bash
# The learning runs, back to back (one at a time).
cd /work/main
run() { name=$1; shift; echo "== $name $(date -u +%T) $(git rev-parse --short HEAD) $(uptime)"; OMP_NUM_THREADS=2 /usr/bin/time -f "wall %e s, maxrss %M KB" .venv/bin/cbkit train "$@" --disable-tqdm > runs/learn-logs/$name.log 2>&1; echo "== $name done $(date -u +%T) $(tail -1 runs/learn-logs/$name.log)"; }
run cb-s0 --config recipes/smollm2_arith.yaml --output-dir runs/arith-cb-s0 --seed 0
run cb-s1 --config recipes/smollm2_arith.yaml --output-dir runs/arith-cb-s1 --seed 1
run gen-s0 --config recipes/smollm2_arith.yaml --output-dir runs/arith-gen-s0 --seed 0 --use-transformers-continuous-batching false
run gen-s1 --config recipes/smollm2_arith.yaml --output-dir runs/arith-gen-s1 --seed 1 --use-transformers-continuous-batching false
run cb-s0-nois --config recipes/smollm2_arith.yaml --output-dir runs/arith-cb-s0-nois --seed 0 --importance-sampling-correction false
run hack --config recipes/smollm2_format_hack.yaml --output-dir runs/format-hack
run fixed --config recipes/smollm2_format_fixed.yaml --output-dir runs/format-fixed
