"""How the learning recipe's task was chosen (docs/learning.md): the base SmolLM2-135M-Instruct, before any training,
on candidate tasks: 32 problems x 4 completions at temperature 1.0, at most 48 tokens, through the CB backend;
accuracy by math-verify (first column) and by cbkit's extract_answer (second), mean length, seconds.
    cd <repo> && OMP_NUM_THREADS=2 .venv/bin/python lab/results/choose-task/sampled.py | grep '^{'
Output of the run quoted in docs/learning.md: sampled.jsonl beside this file ("own" tasks are ad-hoc generators
written for this measurement only; "rg" are reasoning-gym datasets).
"""
import sys, time, json, random, dataclasses
import reasoning_gym as rg
from math_verify import parse, verify
from cbkit.models.load import load_policy
from cbkit.tasks.data import Problem, SYSTEM_PROMPT
from cbkit.tasks.rewards import extract_answer, numbers_equal
from cbkit.train.setup import set_up_run
torch_seed=0
policy = load_policy("smollm2-offline")
SHORT = "Answer with the final number only."
def own(kind, n, seed):
    r = random.Random(seed); out=[]
    for i in range(n):
        if kind=="add1": a,b=r.randint(0,9),r.randint(0,9); q,ans=f"What is {a} + {b}?",a+b
        elif kind=="mul1": a,b=r.randint(2,9),r.randint(2,9); q,ans=f"What is {a} * {b}?",a*b
        elif kind=="add2": a,b=r.randint(10,99),r.randint(10,99); q,ans=f"What is {a} + {b}?",a+b
        out.append(Problem(f"{kind}-{i}", q, str(ans)))
    return out
def rgp(name, n, seed, **kw):
    ds = rg.create_dataset(name, size=n, seed=seed, **kw)
    return [Problem(f"{name}-{i}", x["question"], x["answer"]) for i,x in enumerate(ds)]
cands = {
 "own add1": own("add1", 32, 7), "own mul1": own("mul1", 32, 7), "own add2": own("add2", 32, 7),
 "rg basic_arith 1d +-": rgp("basic_arithmetic", 32, 7, min_terms=2,max_terms=2,min_digits=1,max_digits=1,operators=("+","-")),
 "rg chain_sum 1d": rgp("chain_sum", 32, 7, min_terms=2,max_terms=2,min_digits=1,max_digits=1),
 "rg chain_sum 2d": rgp("chain_sum", 32, 7, min_terms=2,max_terms=2,min_digits=2,max_digits=2),
 "rg products 1d": rgp("products", 32, 7, min_terms=2,max_terms=2,min_digits=1,max_digits=1),
}
def mv(text, gold):
    try: return bool(verify(parse(gold), parse(text)))
    except Exception: return False
be=None
for prompt_name, name in [("short","own add1"),("short","rg chain_sum 1d"),("cbkit","rg chain_sum 1d"),("short","rg basic_arith 1d +-"),("short","rg products 1d"),("short","rg chain_sum 2d")]:
    probs=cands[name]; sp={"short":SHORT,"cbkit":SYSTEM_PROMPT}[prompt_name]
    run = set_up_run("smollm2-offline", "synthetic", 32, policy=policy, problems=probs, system_prompt=sp)
    if be is None: be = run.backend("continuous")
    res={}
    for mode, n, smp in [("T1", 4, run.sampling(48, temperature=1.0, seed=1))]:
        t=time.time(); ro = be.generate(run.prompts, n, smp)
        texts=[run.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in ro.completions]
        golds=[probs[c.group].answer for c in ro.completions]
        acc_mv = sum(mv(t_,g) for t_,g in zip(texts,golds))/len(texts)
        acc_x = sum(numbers_equal(extract_answer(t_),g) for t_,g in zip(texts,golds))/len(texts)
        ml = sum(len(c.completion_ids) for c in ro.completions)/len(texts)
        res[mode]=(round(acc_mv,3), round(acc_x,3), round(ml,1), round(time.time()-t,1))
        if mode=="T1": ex = texts[:2]
    print(json.dumps({"prompt":prompt_name,"task":name, **{k:v for k,v in res.items()}, "ex":ex}), flush=True)
