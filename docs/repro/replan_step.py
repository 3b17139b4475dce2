"""A full-step sweep's results file with every run's step plan made again by this checkout's planner: the sweep's own
`_planned_step` on each run line's recorded rollout plan, prompt lengths and completion lengths (the measured peak
does not depend on the planner, so a file measured before a planner change can be read with the new plan):

    .venv/bin/python docs/repro/replan_step.py RESULTS.jsonl [OUT.jsonl]

Prints one row per run (backend, N, measured and planned peak, plan error, the phase that sets the plan); with OUT,
writes the file again with the new planned_peak_bytes, planned_phase and plan_error."""

import json
import sys

from cbkit.measure.sweep import SweepConfig, _planned_step
from cbkit.models.load import load_policy

with open(sys.argv[1]) as f:
    lines = [json.loads(x) for x in f]
header = lines[0]["fingerprint"]
cfg = SweepConfig(model=header["model"], data=header["data"], full_step=True, lengths=header["lengths"],
                  max_new_tokens=header["max_new_tokens"], forward_chunk_rows=header["forward_chunk_rows"])
model = load_policy(header["model"], dtype=header["dtype"]).model
print("| N | backend | measured GB | planned GB | plan error | phase |")
print("| --- | --- | --- | --- | --- | --- |")
for run in lines:
    if run.get("kind") != "run" or run["status"] != "ok":
        continue
    prompts = [[0] * p for p in run["prompt_lens"]]
    run.update(_planned_step(cfg, model, prompts, run["N"], run,
                             {"planned_peak_bytes": run["planned_rollout_peak_bytes"]}, run["completion_lengths"]))
    print(f"| {run['N']} | {run['backend']} | {run['peak_mem_bytes'] / 1e9:.2f} | {run['planned_peak_bytes'] / 1e9:.2f} "
          f"| {run['plan_error']:+.0%} | {run['planned_phase']} |")
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
