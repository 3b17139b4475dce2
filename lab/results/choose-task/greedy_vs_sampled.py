"""The two candidates in the 10-50% window, greedy against sampled (docs/learning.md): 64 problems drawn with the
evaluation seed, at most 32 tokens, greedy (1 each) and temperature 1.0 (4 each), through the CB backend,
accuracy by math-verify. Output quoted in docs/learning.md: greedy_vs_sampled.jsonl beside this file.
    cd <repo> && OMP_NUM_THREADS=2 .venv/bin/python lab/results/choose-task/greedy_vs_sampled.py | grep '^{'
"""
import json, dataclasses, time
from cbkit.models.load import load_policy
from cbkit.tasks.data import load_problems
from cbkit.tasks.rewards import verified_reward
from cbkit.train.setup import set_up_run
SHORT = "Answer with the final number only."
policy = load_policy("smollm2-offline")
be = None
for name, opts in [("reasoning-gym:chain_sum", dict(min_terms=2,max_terms=2,min_digits=1,max_digits=1)),
                   ("reasoning-gym:products", dict(min_terms=2,max_terms=2,min_digits=1,max_digits=1))]:
    probs = load_problems(name, n=64, seed=20240601, options=opts)
    run = set_up_run("smollm2-offline", name, 64, policy=policy, problems=probs, system_prompt=SHORT)
    if be is None: be = run.backend("continuous")
    for mode, n, smp in [("greedy", 1, dataclasses.replace(run.sampling(32, seed=1), do_sample=False)), ("T1", 4, run.sampling(32, temperature=1.0, seed=1))]:
        t = time.time(); ro = be.generate(run.prompts, n, smp)
        texts = [run.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in ro.completions]
        acc = sum(verified_reward(texts, [probs[c.group].answer for c in ro.completions])) / len(texts)
        trunc = sum(c.finish_reason == "length" for c in ro.completions) / len(texts)
        print(json.dumps({"task": name, "mode": mode, "n": len(texts), "acc": round(acc, 3), "truncated": round(trunc, 3),
                          "mean_len": round(sum(len(c.completion_ids) for c in ro.completions) / len(texts), 1), "s": round(time.time() - t, 1)}), flush=True)
