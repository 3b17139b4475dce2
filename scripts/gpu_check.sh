#!/usr/bin/env bash
# What only a GPU can answer about cbkit, in calls of at most 9 minutes on a bare GPU machine (torch and transformers
# preinstalled; no network; no trl, datasets, plotly or IPython), each call resuming where the last one stopped:
#
#   bash scripts/gpu_check.sh                    # on the GPU
#   CBKIT_DRY_RUN=1 bash scripts/gpu_check.sh    # the same steps at test size on a CPU (tests/test_bare.py runs it)
#
# Steps, in this order, each skipped once it has finished (a `<step>.done` marker in the state folder):
#   gpu-tests   `pytest -m gpu` (tests/test_gpu.py, tests/test_async_rollouts.py), every test cut at
#               CBKIT_TEST_TIMEOUT_S (tests/conftest.py; the async test may otherwise wait 5 x 120 s) and the whole
#               step at what is left of the call (`timeout`).
#   sweep-64    TRL's benchmark table (`cbkit sweep --preset trl-benchmark`) at N=64 first, where the seed's memory
#   sweep-8-32  inversion sits, then N=8 and 32. The CB pool is the one an A100-80 would get under TRL's setting:
#               cbkit's admission check (cbkit/rollout/admission.py, transformers' own memory handler) for the
#               A100-80's memory with the preset's trainer state resident and max_memory_percent 0.5, passed as a
#               fixed num_blocks and max_batch_tokens (pool.json), not half of this GPU's free memory. A point
#               that finished stays in sweep.jsonl: a call cut mid-step resumes the sweep at its next point.
#   trl-step    one step of cbkit's TRL bridge under bf16 (`build_trainer`, TRL 1.16): its IS metrics, and the
#               policy's dtype after it (fp32: the bridge samples from bf16 copies; issue 40 item 7).
#   nb-01       notebooks 01 and 03 at the a100 tier, code cells in order in one process (no Jupyter kernel on the
#   nb-03       machine), on synthetic prompts (the tier's gsm8k:train needs the hub; CBKIT_GSM8K_DIR=<dir> with
#               train.jsonl uses gsm8k-local instead). Figures are built, not drawn.
# Every step's process appends its host peak RSS (VmHWM) and CUDA peaks to resources.jsonl (the CUDA ones since the
# process started, unless a sweep inside it reset them); the sweep's records carry each run's measured device peaks
# beside its plan (planned_peak_bytes); a notebook prints its tier plan's peak in its log (nb-01.log, nb-03.log).
# A step is started only when the call has the time it needs left (MIN_S below); the rest wait for the next call.
#
# Where it writes. STATE (default runs/gpu-check, runs/gpu-check-dry for a dry run; ignored by git as runs/) keeps
# everything a rerun resumes from. On the device machine $OUT starts empty and only it comes back, so when OUT is
# set the state is also packed into $OUT/gpu-check.tgz and the log copied to $OUT/gpu_check.log after every step.
# The next call resumes from it: unpack it (`tar xzf gpu-check.tgz -C runs`) and name runs/gpu-check in `carry`.
#
# Packages the machine lacks travel as wheels: `make gpu-wheels` downloads exactly them into .whl (about 31 MiB:
# transformers 5.24, TRL 1.16 and accelerate 1.16, datasets with dill and multiprocess, plotly, IPython and its
# requirements; it fails over 60 MiB). Name .whl in `carry`; they are installed into $SITE (/tmp/cbkit-site) and
# nothing else changes. A step whose packages are missing is skipped, saying which (not marked done).
#
# Environment: PYTHON, STATE, OUT, BUDGET_S (this call's seconds, default 530), WHEELS (default .whl when present).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DRY=${CBKIT_DRY_RUN:-0}
STATE=${STATE:-$([ "$DRY" = 1 ] && echo runs/gpu-check-dry || echo runs/gpu-check)}
BUDGET_S=${BUDGET_S:-530}
start=$(date +%s)
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RESOURCES="$STATE/resources.jsonl"
# tests/conftest.py's checkout guard fails a session that sees files change in the checkout's runs/: this folder is
# written on purpose while the gpu tests run (their log), so the guard is told to leave it alone.
export CBKIT_GPU_CHECK_DIR="$STATE"
export CBKIT_TEST_TIMEOUT_S=${CBKIT_TEST_TIMEOUT_S:-90}  # each gpu test's limit (tests/conftest.py)
WHEELS=${WHEELS:-$([ -d .whl ] && echo .whl)}
if [ -n "$WHEELS" ]; then
  SITE=${SITE:-/tmp/cbkit-site}
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$SITE"  # after the checkout, so its cbkit wins; before the image's packages
fi
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
log() { echo "[gpu_check $(( $(date +%s) - start ))s] $*" | tee -a "$STATE/gpu_check.log"; }
pack() {  # what comes back from the device: the state folder, whole, and the log beside it
  if [ -n "${OUT:-}" ] && [ "$(cd "$OUT" 2>/dev/null && pwd)" != "$STATE" ]; then
    mkdir -p "$OUT" && tar czf "$OUT/gpu-check.tgz" -C "$(dirname "$STATE")" "$(basename "$STATE")" \
      && cp "$STATE/gpu_check.log" "$OUT/gpu_check.log"
  fi
}
missing() { "$PYTHON" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if not u.find_spec(m)))" "$@"; }

# Runs a Python target (-m module, -c code, or a file) as step $1, appending its resources line.
MEASURED='
import json, os, runpy, sys, time
step, kind, target, *argv = sys.argv[1:]
t, code = time.time(), 0
try:
    if kind == "-m":
        sys.argv = [target, *argv]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [step, *argv]
        exec(compile(target, step, "exec"), {"__name__": "__main__"})
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
except BaseException:
    import traceback
    traceback.print_exc()
    code = 1
from cbkit.telemetry import process_peak_rss
rec = {"step": step, "exit": code, "seconds": round(time.time() - t, 1), "host_peak_rss_bytes": process_peak_rss()}
import torch
if torch.cuda.is_available():  # since the process started, where nothing reset them (a sweep resets per run)
    rec.update(device_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
               device_peak_reserved_bytes=torch.cuda.max_memory_reserved())
with open(os.environ["RESOURCES"], "a") as f:
    f.write(json.dumps(rec) + "\n")
sys.exit(code)
'

# step NAME MIN_S NEEDS -- ARGS: run `python -c $MEASURED NAME ARGS` with what is left of the call, if at least
# MIN_S is (a step that cannot finish would waste the call's tail; the next call starts with it).
step() {
  local name=$1 min=$2 needs=$3; shift 4
  if [ -f "$STATE/$name.done" ]; then log "$name: done in an earlier call, skipped"; return; fi
  local gone; gone=$(missing $needs)
  if [ -n "$gone" ]; then log "$name: SKIPPED, needs $gone (carry the wheels: make gpu-wheels)"; return; fi
  local limit; limit=$(left)
  if [ "$limit" -lt "$min" ]; then log "$name: not started, ${limit}s left of the ${min}s it needs; the next call runs it"; return; fi
  log "$name: started, at most ${limit}s"
  local t=$(date +%s) rc=0
  timeout --kill-after=10 "$limit" "$PYTHON" -c "$MEASURED" "$name" "$@" >>"$STATE/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then touch "$STATE/$name.done"; log "$name: ok in $(( $(date +%s) - t ))s"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then log "$name: CUT at ${limit}s; the next call resumes it ($name.log)"
  else tail -15 "$STATE/$name.log"; log "$name: FAILED, exit $rc ($name.log)"; fi
  pack
}

log "call started: state $STATE, budget ${BUDGET_S}s, dry run $DRY"
# The machine, and whether this transformers is one cbkit runs on (every call: the machine may differ).
"$PYTHON" - "$STATE/machine.json" <<'EOF' || { log "machine: FAILED"; pack; exit 1; }
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
    sys.exit(f"transformers {transformers.__version__} is older than cbkit's floor, 5.24: carry its wheel "
             "(make gpu-wheels, then name .whl in carry).")
EOF

if [ "$DRY" = 1 ]; then dry=(--dry-run); long_ns=4; short_ns=2; else dry=(); long_ns=64; short_ns=8,32; fi

# The pool an A100-80 gives the CB engine under TRL's setting, for the largest point (a pool fixed across N, as
# TRL's trainer has one pool whatever N).
[ -f "$STATE/pool.json" ] || "$PYTHON" - "$STATE/pool.json" "$DRY" <<'EOF' || log "pool: FAILED"
import json, sys
import torch
from cbkit.measure.sweep_config import DRY_RUN, PRESETS, TRAINER_STATE_COPIES
from cbkit.rollout.admission import admission
from cbkit.teach.tiers.plan import parameter_count, plan_config
from cbkit.teach.tiers.table import CAPABILITY, CUDA_CONTEXT_BYTES, DEVICE_BYTES, PROMPT_LEN

preset = {**PRESETS["trl-benchmark"], **(DRY_RUN if sys.argv[2] == "1" else {})}
config = plan_config(preset["model"])
dtype = getattr(torch, preset["dtype"])
# Weights in the preset's dtype and the trainer state the sweep holds beside them (trainer_state: TRL's gradient and
# AdamW moments after its bf16 cast, TRAINER_STATE_COPIES copies in the weights' dtype).
resident = dtype.itemsize * (1 + TRAINER_STATE_COPIES) * parameter_count(config)
rows = [range(PROMPT_LEN)] * (preset["num_prompts"] * max(PRESETS["trl-benchmark"]["ns"]))
used = CUDA_CONTEXT_BYTES + resident
# A dry run's tiny model would get tens of GB of pool from an A100-80 (allocated on this CPU): it asks the same check
# for a device with 256 MiB beside what is resident, and batches of 256 tokens (the mask of 8192 would not fit).
dry = sys.argv[2] == "1"
total = used + 256 * 2**20 if dry else DEVICE_BYTES["a100-80"]
pool_setting = {"max_memory_percent": 0.5, **({"max_batch_tokens": 256} if dry else {})}
a = admission(config, pool_setting, dtype=dtype, rows=rows, max_new_tokens=preset["max_new_tokens"],
              total_bytes=total, used_bytes=used,
              capability=CAPABILITY["a100-80"])
if not a.fits:
    sys.exit(f"the trl-benchmark preset does not start on an A100-80: {a.line()}")
pool = {"num_blocks": a.num_blocks, "max_batch_tokens": a.max_batch_tokens}
json.dump({"cb_config": pool, "admission": a.line(), "resident_bytes": resident}, open(sys.argv[1], "w"), indent=1)
print("A100-80 pool under max_memory_percent 0.5:", a.line())
EOF
pool=$("$PYTHON" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['cb_config']))" "$STATE/pool.json") \
  || { log "no pool.json: the sweeps would size the pool from this GPU's memory; stopping"; pack; exit 1; }

sweep=(-m cbkit.cli sweep --preset trl-benchmark "${dry[@]}" --no-live --cb_config "$pool" --out "$STATE/sweep.jsonl")
step gpu-tests 60 pytest -- -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_async_rollouts.py
step sweep-64 60 "" -- "${sweep[@]}" --ns "$long_ns"
step trl-step 60 "trl datasets" -- -c "$(cat <<'EOF'
import json, os, sys, time
import torch
from cbkit.models.load import load_policy
from cbkit.tasks.data import load_problems
from cbkit.tasks.rewards import DEFAULT_REWARDS
from cbkit.trl.config import trl_dataset
from cbkit.trl.trainers import build_trainer, is_metrics

dry = os.environ.get("CBKIT_DRY_RUN") == "1"
gpu = torch.cuda.is_available()
# TRL's benchmark model (random weights, no download) in fp32, as a trainer holds it; 4 prompts x N=8, 512 tokens.
policy = load_policy("llama-tiny-random" if dry else "llama-1b-random", dtype="float32")
prompts, n, length = (2, 4, 8) if dry else (4, 8, 512)
run = dict(num_generations=n, max_completion_length=length, prompts_per_step=prompts, max_steps=1, seed=0,
           learning_rate=1e-6, gradient_accumulation_steps=1 if dry else 4, temperature=1.0)
trainer = build_trainer(policy.model, policy.tokenizer, DEFAULT_REWARDS, trl_dataset(load_problems("synthetic", n=16)),
                        run, output_dir=os.path.join(os.environ["CBKIT_GPU_CHECK_DIR"], "trl"), bf16=True,
                        use_cpu=not gpu, report_to=[], logging_steps=1, save_strategy="no")
t = time.time()
trainer.train()
logs = trainer.state.log_history[0]
dtypes = sorted({str(p.dtype) for p in policy.model.parameters()})
rec = {"trainer": type(trainer).__name__, "seconds": round(time.time() - t, 1), "policy_dtypes_after": dtypes,
       "loss": logs.get("loss"), "completions/mean_length": logs.get("completions/mean_length"), **is_metrics(logs)}
print(json.dumps(rec))
with open(os.path.join(os.environ["CBKIT_GPU_CHECK_DIR"], "trl_step.json"), "w") as f:
    json.dump(rec, f, indent=1)
if dtypes != ["torch.float32"]:
    sys.exit(f"the bridge left the policy in {dtypes}; it must hand it back fp32")
EOF
)"
step sweep-8-32 60 "" -- "${sweep[@]}" --ns "$short_ns"
NOTEBOOK='
import json, os, sys, time
from pathlib import Path
nb, root = Path(sys.argv[1]).resolve(), Path.cwd()
work = Path(os.environ["CBKIT_GPU_CHECK_DIR"]) / nb.stem
work.mkdir(exist_ok=True)
os.chdir(work)  # the notebook writes its runs/ here
sys.path.insert(0, str(root))
data = ("gsm8k-local:train" if os.environ.get("CBKIT_GSM8K_DIR") else "synthetic")
ns = {"__name__": "__main__"}
cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
for i, cell in enumerate(cells):
    t = time.time()
    exec(compile("".join(cell["source"]), f"{nb.stem}[{i}]", "exec"), ns)
    if "DATA" in ns and ns["DATA"] != data:  # the parameters cell set the tier'"'"'s data; no hub here
        print(f"DATA = {ns['"'"'DATA'"'"']!r} needs the hub: {data!r} instead")
        ns["DATA"] = data
    print(f"--- cell {i}: {time.time() - t:.1f}s", flush=True)
'
# `cbkit tiers` estimates 01 and 03 at about 4 minutes each on an A100 (a plan, not a measurement): a call with less
# left starts neither.
nb_min=$([ "$DRY" = 1 ] && echo 60 || echo 240)
for nb in 01_kv_slot_recycling 03_n_sweep; do
  # The a100 tier forced (an H200 would pick it too); under the ci profile, the tier's dry run on a CPU.
  (export CBKIT_TIER=a100 PLOTLY_RENDERER=json; [ "$DRY" = 1 ] && export CBKIT_PROFILE=ci
   step "nb-${nb%%_*}" "$nb_min" "plotly IPython" -- -c "$NOTEBOOK" "notebooks/$nb.ipynb")
done

# The last memory table the sweep printed (every N in the results file so far): the planner beside the measured peaks.
cat "$STATE"/sweep-64.log "$STATE"/sweep-8-32.log 2>/dev/null | grep -A8 "^Memory (GiB)" | tail -9
log "call done in $(( $(date +%s) - start ))s; $(ls "$STATE"/*.done 2>/dev/null | wc -l) of 6 steps done"
pack
