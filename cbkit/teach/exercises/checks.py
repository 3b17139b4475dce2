"""One check per exercise: its table of cases and the package code it is graded against.

Every reference below is the code the kit itself runs and tests, called as it is, never the formula written out
again: a format reward is `cbkit.tasks.rewards.format_reward`, a padding share `cbkit.telemetry.kv_accounting` (what
01 prints under its padding grid), a scheduler step the engine's own recorded steps (what it really did), IS weights and the loss
`cbkit.train.objective` (checked against TRL's own code by tests/test_objective.py), the static batch's KV the
planner's `plan` (checked against measured runs), and the staleness filter `cbkit.train.offpolicy.fresh_groups`
(what async GRPO drops). The first cases of each table are the edge cases, then cases drawn from the seed.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from cbkit.teach.exercises.grading import Case, Result, close, grade, new_seed

__all__ = ["check_aggregate_loss", "check_format_score", "check_fresh_groups",
           "check_group_advantages", "check_padding_share", "check_schedule_step", "check_sequence_mask_weights",
           "check_static_kv_bytes", "check_token_is_weights", "schedule_cases"]


def _exact(expected: Any, got: Any) -> str | None:
    if isinstance(got, tuple):
        got = list(got)
    return None if got == expected else "not the expected value"


# --- 00: the format reward of one completion ------------------------------------------------------------------


def check_format_score(fn: Callable[[str], float], seed: int | None = None, *, quiet: bool = False) -> Result:
    """`fn(completion) -> 1.0 | 0.5 | 0.0`, graded against `cbkit.tasks.rewards.format_reward`."""
    from cbkit.tasks.rewards import format_reward

    seed = new_seed() if seed is None else seed
    rng = random.Random(seed)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(100, 9999)
    work = f"{a} + {b} = {a + b}, and {a + b} x 2 = {2 * (a + b)}."
    cases = [
        Case("the answer alone on the last line", (f"{work}\n#### {2 * (a + b)}",),
             "a completion that ends with its answer line earns the full reward."),
        Case("more text after the answer", (f"#### {c}\nSo the farmer has {c} eggs left.",),
             "the answer form is there, but it is not the last line: partial credit."),
        Case("words after the number", (f"{work}\n#### {c} eggs",),
             "for the full reward the last line is the answer and nothing else."),
        Case("a stack of answer lines", (f"{work}\n#### {a}\n#### {a}",),
             "the full reward needs the last line to be the completion's only answer line."),
        Case("an answer in prose only", (f"{work} The answer is {a + b}.",),
             "the format reward pays for the `#### <number>` form only, not for a correct number."),
        Case("an empty completion", ("",), "no lines at all: nothing to pay for."),
        Case("a markdown heading, not an answer", (f"#### Step 1\nAdd {a} and {b}.",),
             "`####` must be followed by a number to count as an answer line."),
        Case("a special token after the answer", (f"{work}\n#### {c}<|im_end|>",),
             "decoded text may keep special tokens such as <|im_end|> at the end; they are not part of the line."),
        Case("blank lines at the end", (f"{work}\n#### -{b}\n\n",), "the *last non-empty* line is the one that counts."),
    ]
    for i in range(6):
        lines = [work] * rng.randint(0, 2) + [f"#### {rng.randint(0, 500)}"] * rng.randint(0, 2)
        lines += [f"That is {rng.randint(0, 500)}."] * rng.randint(0, 1)
        rng.shuffle(lines)
        cases.append(Case(f"drawn completion {i + 1}", ("\n".join(lines),), "read the rule in the docstring again."))
    return grade("format_score", fn, cases, lambda text: format_reward([text], ["0"])[0], close, seed=seed,
                 check="check_format_score", quiet=quiet)


# --- 01: the static batch's padding, and one step of the engine's scheduler ------------------------------------------------


def _padding_reference(prompt_lens: list[int], completion_lens: list[int]) -> float:
    from cbkit.telemetry import kv_accounting

    # A rollout as `generate()` records it (cbkit/rollout/generate.py): rows, left-padded prompt length, decode steps.
    rollout = SimpleNamespace(
        backend="generate",
        completions=[SimpleNamespace(prompt_ids=[0] * p, completion_ids=[0] * c)
                     for p, c in zip(prompt_lens, completion_lens, strict=True)],
        engine_config={"batch_rows": len(prompt_lens), "padded_prompt_len": max(prompt_lens),
                       "steps": max(completion_lens)})
    config = SimpleNamespace(num_attention_heads=1, num_key_value_heads=1, head_dim=1, num_hidden_layers=1)
    share = kv_accounting(rollout, config, 1)["kv_padding_share"]
    assert share is not None  # a generate() rollout always has its padding counted
    return share


def check_padding_share(fn: Callable[[list[int], list[int]], float], seed: int | None = None, *,
                        quiet: bool = False) -> Result:
    """`fn(prompt_lens, completion_lens) -> share of the static batch's KV token slots that hold padding`."""
    seed = new_seed() if seed is None else seed
    rng = random.Random(seed)
    p, n = rng.randint(8, 40), rng.randint(4, 12)
    cases = [
        Case("equal prompts, equal completions", ([p] * 4, [n] * 4), "with nothing shorter than the longest, no slot is padding."),
        Case("prompts of different lengths", ([p, p + 3, p + 7], [n] * 3),
             "prompts are left-padded to the longest prompt: that padding is stored too."),
        Case("one row finished after one token", ([p] * 4, [1, n, n, n]),
             "a finished row keeps its slots until the longest row ends."),
        Case("a row of length 0", ([p] * 3, [0, n, n]),
             "a row with no completion tokens still holds the full padded length."),
    ]
    for i in range(6):
        rows = rng.randint(1, 8)
        cases.append(Case(f"drawn batch {i + 1}", ([rng.randint(1, 50) for _ in range(rows)],
                                                   [rng.randint(0, 64) for _ in range(rows - 1)] + [rng.randint(1, 64)]),
                          "useful slots are each row's own prompt + completion; allocated slots are rows x the padded "
                          "length."))
    return grade("padding_share", fn, cases, _padding_reference, close, seed=seed, check="check_padding_share",
                 quiet=quiet)


def schedule_cases(trace: Any, token_budget: int, max_requests: int) -> list[tuple[int, tuple, list]]:
    """Per engine step of `trace` (a `cbkit.rollout.engine_trace.EngineTrace`): its index, the arguments of
    `schedule_step` as the scheduler saw them before it, and what the engine scheduled [(request_id, query_len)].

    The candidates are rebuilt from the record in `FIFOScheduler.schedule_batch`'s order: running requests that
    decode, then those still prefilling (each in the order it was first scheduled), then waiting ones in arrival
    order (cbkit's prefill helpers first; the completions arrive once every helper has finished). A waiting request
    reads from where its prefix-cache match leaves it (its `past_len` at its first step). `fits` is the allocator's
    answer, taken from the record: False for a request the engine left out although both budgets had room for it."""
    read = trace.pool_blocks * trace.page_size  # the engine's cache read budget: the pool's tokens
    first, last, prompt = dict[str, tuple[int, int]](), dict[str, int](), dict[str, int]()  # first: (step, past_len)
    for s in trace.steps:
        for r in s.requests:
            first.setdefault(r.request_id, (s.index, r.past_len))
            last[r.request_id] = s.index
            prompt[r.request_id] = r.prompt_len

    def arrival(rid: str) -> tuple[bool, int]:
        return (not rid.startswith("cbkit-prefill-"), int(rid.replace("-", "_").rsplit("_", 1)[1]))

    helpers_done = 1 + max((last[rid] for rid in last if not arrival(rid)[0]), default=-1)
    reached: dict[str, int] = {}
    out = []
    for s in trace.steps:
        alive = sorted((rid for rid in reached if last[rid] >= s.index), key=lambda rid: first[rid][0])
        ordered = [(rid, reached[rid], 1) for rid in alive if reached[rid] >= prompt[rid]]
        ordered += [(rid, reached[rid], prompt[rid] - reached[rid]) for rid in alive if reached[rid] < prompt[rid]]
        ordered += [(rid, first[rid][1], prompt[rid] - first[rid][1]) for rid in sorted(first, key=arrival)
                    if first[rid][0] >= s.index and (not arrival(rid)[0] or s.index >= helpers_done)]
        got = {r.request_id: r.query_len for r in s.requests}
        candidates, tokens, reads, n = [], token_budget, read, 0
        for rid, past, wants in ordered:
            open_ = tokens > 0 and reads > 0 and n < max_requests
            candidates.append((rid, past, wants, rid in got or not (open_ and reads >= past)))
            if rid in got and open_:
                tokens, reads, n = tokens - got[rid], reads - past, n + 1
        out.append((s.index, (candidates, token_budget, read, max_requests), [(r.request_id, r.query_len)
                                                                              for r in s.requests]))
        reached.update({r.request_id: r.past_len + r.query_len for r in s.requests})
    return out


def _step_hint(args: tuple, engine: list) -> str:
    candidates, got = args[0], dict(engine)
    if any(q < wants for rid, _, wants, _ in candidates for r, q in engine if r == rid):
        return "the token budget ran out inside a prompt: that request gets a chunk of min(wants, budget left)."
    if any(rid not in got and fits for rid, _, _, fits in candidates):
        return ("a request that fits was left out: the read budget (the pool's tokens) pays each scheduled "
                "request's past_len; skip one that would overdraw it and go on, stop once it is spent.")
    if any(not fits for *_, fits in candidates):
        return "a candidate that does not fit is skipped, and the ones after it are still considered."
    return "decoding requests come first, one token each, in the candidates' order."


@functools.cache
def _record_small_rollout() -> tuple[Any, dict[str, Any]]:
    """A small rollout of cbkit's tiny model through the real engine, recorded step by step, once per process: 2
    prompts x 4, pages of 16 tokens, a pool for three requests without sharing, a token budget of 32 (prefills come
    in chunks), fixed completion lengths (the same steps every time, so a wrong answer fails where it always does)."""
    from cbkit.models.load import load_policy
    from cbkit.rollout import SamplingParams, make_backend
    from cbkit.rollout.engine_config import workload_blocks
    from cbkit.rollout.engine_trace import record_engine_steps

    tiny = load_policy("tiny", seed=0, device="cpu")
    tok = tiny.tokenizer
    prompts = [tok.encode("Tom has 3 apples and buys 4 more apples at the market. How many apples does he have?"),
               tok.encode("A train leaves at noon and travels 60 miles per hour for three hours. How far is it?")]
    sampling = SamplingParams(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    backend = make_backend("continuous", tiny.model, cb_config={
        "page_size": 16, "num_blocks": workload_blocks([prompts[0]] * 3, 40, 16), "max_batch_tokens": 32})
    with record_engine_steps() as trace:
        rollout = backend.generate(prompts, 4, sampling, target_lengths=[3 + (11 * i) % 37 for i in range(8)])
    return trace, rollout.engine_config


def check_schedule_step(fn: Callable[..., list[tuple[str, int]]], seed: int | None = None, *, quiet: bool = False,
                        trace: Any = None, token_budget: int = 8192, max_requests: int = 1024) -> Result:
    """`fn(candidates, token_budget, read_budget, max_requests) -> [(request_id, query_len)]`, graded step by step
    against what transformers' engine scheduled in a small rollout it records now (or in `trace`, recorded with
    that token budget and request cap)."""
    seed = new_seed() if seed is None else seed
    if trace is None:
        trace, config = _record_small_rollout()
        token_budget, max_requests = config["max_batch_tokens"], config["max_requests_per_batch"]
    steps = schedule_cases(trace, token_budget, max_requests)
    cases = [Case(f"engine step {i}", args, _step_hint(args, engine)) for i, args, engine in steps]
    expected = iter([engine for *_, engine in steps])
    return grade("schedule_step", lambda *args: [tuple(x) for x in fn(*args)], cases, lambda *_: next(expected),
                 _exact, seed=seed, check="check_schedule_step", quiet=quiet)


# --- 02: importance-sampling weights ---------------------------------------------------------------------------


def _logprob_batch(g, rows: int, width: int, spread: float):
    import torch

    old = -torch.rand(rows, width, generator=g) * 3
    sampled = old + (torch.rand(rows, width, generator=g) - 0.5) * 2 * spread
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width) < lengths[:, None]
    noise = torch.randn(rows, width, generator=g) * 5  # padding holds garbage, as a padded batch does
    return old.where(mask, noise), sampled.where(mask, -noise.abs()), mask


def _is_cases(seed: int, sequence: bool) -> list[Case]:
    import torch

    g = torch.Generator().manual_seed(seed)
    old, sampled, mask = _logprob_batch(g, 3, 6, 0.2)
    clipped = sampled.clone()
    clipped[0, 0] = old[0, 0] - 2.0  # exp(2) = 7.4 > clip_max
    empty = mask.clone()
    empty[1] = False
    low = sampled + 0.6 * mask  # every ratio below 1
    many = torch.full((2, 12), -1.0), torch.full((2, 12), -1.2), torch.ones(2, 12, dtype=torch.bool)
    cases = [
        Case("ratios close to 1", (old, sampled, mask, 3.0), "rho = exp(old - sampled), one per completion token"
             + (", multiplied over the completion's tokens." if sequence else ".")),
        Case("a clipped ratio", (old, clipped, mask, 3.0), "a ratio above clip_max is "
             + ("masked: the whole completion gets weight 0." if sequence else "truncated, not dropped.")),
        Case("a row of length 0", (old, sampled, empty, 3.0),
             "a completion with no tokens has nothing to correct: log ratio 0." if sequence else
             "padding positions carry no token; only the mask's positions are graded."),
        Case("ratios below 1", (old, low, mask, 3.0), "cbkit's default has no clip_min: low ratios are kept."),
    ]
    if sequence:
        cases.append(Case("many small ratios that multiply", (*many, 3.0),
                          "the sequence ratio is a product of token ratios (a sum of log ratios), not an average."))
    for i in range(4):
        o, s, m = _logprob_batch(g, 4, 10, 0.6)
        cases.append(Case(f"drawn batch {i + 1}", (o, s, m, float(torch.empty(()).uniform_(1.5, 4, generator=g))),
                          "padding positions hold garbage: only tokens the mask marks count."))
    return cases


def check_token_is_weights(fn: Callable[..., Any], seed: int | None = None, *, quiet: bool = False) -> Result:
    """`fn(old, sampled, mask, clip_max) -> [B, T] weights`, against `importance_weights(mode="token_truncate")`.
    Graded on the mask's positions only."""
    import torch

    from cbkit.train.objective import importance_weights

    seed = new_seed() if seed is None else seed

    # Padding positions are set to 0 on both sides before comparing: what a function puts there never reaches
    # the loss, which multiplies by the mask.
    def reference(old, sampled, mask, clip_max):
        return importance_weights(old, sampled, mask, "token_truncate", clip_max=clip_max)[0].where(mask, 0.0)

    def learner(old, sampled, mask, clip_max):
        got = torch.as_tensor(fn(old, sampled, mask, clip_max))
        return got.where(mask, 0.0) if got.shape == mask.shape else got  # a wrong shape: the comparison says so

    return grade("token_is_weights", learner, _is_cases(seed, False), reference, close, seed=seed,
                 check="check_token_is_weights", quiet=quiet)


def check_sequence_mask_weights(fn: Callable[..., Any], seed: int | None = None, *, quiet: bool = False) -> Result:
    """`fn(old, sampled, mask, clip_max) -> [B] weights, one per completion`, against
    `importance_weights(mode="sequence_mask")`."""
    from cbkit.train.objective import importance_weights

    seed = new_seed() if seed is None else seed

    def reference(old, sampled, mask, clip_max):
        return importance_weights(old, sampled, mask, "sequence_mask", clip_max=clip_max)[0][:, 0]

    return grade("sequence_mask_weights", fn, _is_cases(seed, True), reference, close, seed=seed,
                 check="check_sequence_mask_weights", quiet=quiet)


# --- 03: the static batch's KV bytes ---------------------------------------------------------------------------


def _shape(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size":
                              256, "head_dim": None, "intermediate_size": 512, "vocab_size": 1000,
                              "sliding_window": None, "layer_types": None, **kw})


def _kv_reference(config, rows: int, prompt_len: int, max_new_tokens: int, dtype_bytes: int) -> int:
    from cbkit.measure.planner import plan

    return plan(config, num_prompts=1, num_generations=rows, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                dtype_bytes=dtype_bytes, device="cpu").generate.kv_bytes


def check_static_kv_bytes(fn: Callable[..., int], seed: int | None = None, *, quiet: bool = False) -> Result:
    """`fn(config, rows, prompt_len, max_new_tokens, dtype_bytes) -> bytes`, against the planner's generate() plan."""
    seed = new_seed() if seed is None else seed
    rng = random.Random(seed)
    L, p, m = rng.randint(2, 6), rng.randint(10, 60), rng.randint(16, 128)
    half = ["sliding_attention", "full_attention"] * (L // 2) + ["full_attention"] * (L % 2)
    cases = [
        Case("one row", (_shape(num_hidden_layers=L), 1, p, m, 2),
             "every layer stores a K and a V vector per token, of kv_heads x head_dim numbers each."),
        Case("grouped-query attention", (_shape(num_hidden_layers=L, num_key_value_heads=2), 8, p, m, 2),
             "only the key/value heads are cached, not the query heads."),
        Case("an explicit head_dim", (_shape(num_hidden_layers=L, head_dim=64, num_key_value_heads=4), 4, p, m, 4),
             "head_dim, when the config sets it, need not be hidden_size / num_attention_heads."),
        Case("a sliding window shorter than the rows", (_shape(num_hidden_layers=L, sliding_window=p // 2), 4, p, m, 2),
             "a sliding-window layer keeps at most `sliding_window` tokens."),
        Case("a window longer than the rows", (_shape(num_hidden_layers=L, sliding_window=p + m + 5), 4, p, m, 2),
             "a window longer than the sequence changes nothing."),
        Case("some layers slide, some do not", (_shape(num_hidden_layers=L, sliding_window=8, layer_types=half), 3, p, m, 2),
             "layer_types says which layers are sliding; the others keep every token."),
    ]
    for i in range(4):
        heads = rng.choice([4, 8, 16])
        cfg = _shape(num_hidden_layers=rng.randint(1, 12), num_attention_heads=heads,
                     num_key_value_heads=rng.choice([h for h in (1, 2, 4, heads) if heads % h == 0]),
                     hidden_size=heads * rng.choice([16, 32, 64]))
        cases.append(Case(f"drawn model {i + 1}", (cfg, rng.randint(1, 64), rng.randint(1, 200), rng.randint(1, 300),
                                                   rng.choice([1, 2, 4])),
                          "every row is kept at the longest prompt + max_new_tokens until the batch ends."))
    return grade("static_kv_bytes", fn, cases, _kv_reference, _exact, seed=seed, check="check_static_kv_bytes",
                 quiet=quiet)


# --- 04: group-relative advantages and the loss's aggregation --------------------------------------------------


def check_group_advantages(fn: Callable[..., Any], seed: int | None = None, *, quiet: bool = False) -> Result:
    """`fn(rewards [B], num_generations) -> advantages [B]`, against `objective.group_advantages` (TRL's GRPO,
    scale_rewards="group")."""
    import torch

    from cbkit.train.objective import group_advantages

    seed = new_seed() if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    binary = (torch.rand(8, generator=g) > 0.5).float()
    binary[:2] = torch.tensor([0.0, 1.0])  # the first group is not all ties
    cases = [
        Case("one group", (torch.tensor([0.0, 1.0, 0.5, 1.0]), 4),
             "subtract the group's mean, divide by its spread: which standard deviation does TRL take?"),
        Case("a group of ties", (torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 1.0]), 3),
             "a group whose rewards are all equal has no signal: its advantages are 0, not NaN."),
        Case("two groups with different means", (torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0, 3.0]), 3),
             "each group is compared with itself only: its own mean and its own std."),
        Case("groups of two", (binary, 2), "the std is the sample (Bessel-corrected) one, as TRL's nanstd."),
    ]
    for i in range(4):
        n = int(torch.randint(2, 9, (), generator=g))
        cases.append(Case(f"drawn rewards {i + 1}", ((torch.rand(n * 3, generator=g) * 2).round(decimals=1), n),
                          "TRL adds 1e-4 to the std before dividing."))
    # rtol 1e-3: TRL's 1e-4 added to the std is a guard for ties (the case above), not a number to reproduce
    return grade("group_advantages", fn, cases, lambda r, n: group_advantages(r, n),
                 lambda e, g: close(e, g, rtol=1e-3, atol=1e-5), seed=seed,
                 check="check_group_advantages", quiet=quiet)


def check_aggregate_loss(fn: Callable[..., Any], seed: int | None = None, *, quiet: bool = False) -> Result:
    """`fn(loss [B, T], mask [B, T], loss_type, max_completion_length) -> scalar`, against `objective.grpo_loss`."""
    import torch

    from cbkit.train.objective import grpo_loss

    seed = new_seed() if seed is None else seed
    g = torch.Generator().manual_seed(seed)

    def reference(loss, mask, loss_type, max_len):
        # policy = old makes every ratio 1, and a [B, T] advantage of -loss makes the per-token loss `loss` itself:
        # what is left is grpo_loss's aggregation, exactly as the loop runs it.
        zeros = torch.zeros_like(loss)
        return grpo_loss(zeros, zeros, -loss, mask, loss_type=loss_type, max_completion_length=max_len)[0].item()

    def batch(rows, width, empty=False):
        loss = torch.randn(rows, width, generator=g)
        lengths = torch.randint(1, width + 1, (rows,), generator=g)
        lengths[0] = 1
        lengths[-1] = width
        if empty:
            lengths[1] = 0
        return loss, torch.arange(width) < lengths[:, None]

    uneven, empty = batch(3, 8), batch(4, 8, empty=True)
    cases = [
        Case("'grpo', rows of different lengths", (*uneven, "grpo", 8),
             "'grpo' averages each sequence over its own tokens, then averages the sequences."),
        Case("'bnpo', rows of different lengths", (*uneven, "bnpo", 8), "'bnpo' divides by the tokens of the batch."),
        Case("'dr_grpo', rows of different lengths", (*uneven, "dr_grpo", 10),
             "'dr_grpo' divides by a constant: rows x max_completion_length."),
        Case("'dapo', rows of different lengths", (*uneven, "dapo", 8),
             "'dapo' divides by the number of completion tokens (one micro-batch here)."),
        Case("'grpo' with a row of length 0", (*empty, "grpo", 8),
             "a row of no tokens contributes 0 to the mean over sequences (divide by at least 1), and still counts."),
        Case("padding is never summed", (*empty, "bnpo", 8), "padding positions hold loss values too: mask them."),
    ]
    for i in range(4):
        kind = ("grpo", "bnpo", "dr_grpo", "dapo")[i]
        cases.append(Case(f"drawn batch {i + 1} ('{kind}')", (*batch(int(torch.randint(2, 6, (), generator=g)), 12),
                                                             kind, 16), "which tokens are summed, divided by what?"))
    return grade("aggregate_loss", fn, cases, reference, close, seed=seed, check="check_aggregate_loss", quiet=quiet)


# --- 05: the staleness filter ----------------------------------------------------------------------------------


def check_fresh_groups(fn: Callable[..., list[int]], seed: int | None = None, *, quiet: bool = False) -> Result:
    """`fn(group_versions, now, max_staleness) -> indices of the groups to keep`, against async GRPO's filter."""
    from cbkit.train.offpolicy import fresh_groups

    seed = new_seed() if seed is None else seed
    rng = random.Random(seed)
    now = rng.randint(5, 40)
    cases = [
        Case("every token fresh", ([[[now] * 3, [now] * 5], [[now] * 2, [now] * 4]], now, 1),
             "a group whose tokens are all at most max_staleness old is kept."),
        Case("exactly max_staleness old", ([[[now - 2] * 3, [now] * 2], [[now - 3] * 2, [now] * 2]], now, 2),
             "max_staleness is the oldest age allowed, not the first age refused."),
        Case("one stale token in one completion", ([[[now - 1] * 4, [now - 4] + [now] * 3], [[now] * 3, [now] * 3]],
                                                   now, 2),
             "one too-old token drops its completion's whole group: advantages need every sibling."),
        Case("a completion that straddles an update", ([[[now - 3] * 2 + [now - 1] * 4, [now - 1] * 3],
                                                        [[now - 1] * 6, [now - 1] * 2]], now, 1),
             "the oldest token of a completion is usually its first: an update mid-rollout makes the rest newer."),
        Case("a completion with no tokens", ([[[], [now] * 2], [[now - 5] * 2, []]], now, 1),
             "a completion without tokens has nothing too old in it."),
        Case("max_staleness 0 (on-policy only)", ([[[now] * 2], [[now - 1, now]], [[now] * 3]], now, 0),
             "with 0 only tokens from the current policy pass."),
    ]
    for i in range(5):
        groups = []
        for _ in range(rng.randint(1, 6)):
            group = []
            for _ in range(rng.randint(2, 4)):
                start = now - rng.randint(0, 4)
                switch = rng.randint(0, 6)
                group.append([start] * switch + [min(now, start + rng.randint(0, 2))] * rng.randint(0, 6))
            groups.append(group)
        cases.append(Case(f"drawn rollout {i + 1}", (groups, now, rng.randint(0, 3)),
                          "age = now - version, for every token of every completion of the group."))
    return grade("fresh_groups", fn, cases, fresh_groups, _exact, seed=seed, check="check_fresh_groups", quiet=quiet)

