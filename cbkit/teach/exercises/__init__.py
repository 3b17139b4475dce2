"""The notebooks' graded exercises: `check_<name>(fn)` grades a learner's function against the kit's own code on edge
cases and on cases drawn from a printed seed, and prints the first that differs with a hint; nothing raises out of it."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from cbkit.measure.planner import plan
from cbkit.models.load import load_policy
from cbkit.rollout import SamplingParams, make_backend
from cbkit.rollout.engine_config import workload_blocks
from cbkit.rollout.engine_trace import record_engine_steps
from cbkit.tasks.rewards import format_reward
from cbkit.telemetry import kv_accounting
from cbkit.train.objective import LossType, group_advantages, grpo_loss, importance_weights
from cbkit.train.offpolicy import fresh_groups


class Result(NamedTuple):  # a check's verdict: the first failing case's name (None when none failed), its message
    passed: bool
    case: str | None
    message: str
    not_implemented: bool = False


class Case(NamedTuple):  # one row of a check's table; `expected` where there is no reference to call
    name: str
    args: tuple
    hint: str
    expected: Any = None


def show(value: Any) -> str:  # tensors as nested lists rounded to 4 digits, long text cut
    text = repr(_rounded(value.tolist() if hasattr(value, "tolist") and hasattr(value, "shape") else value))
    return text if len(text) <= 160 else text[:155] + " ...]"


def _rounded(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) else [_rounded(v) for v in x] if isinstance(x, list) else x


def close(expected: Any, got: Any, *, rtol: float = 1e-4, atol: float = 1e-6) -> str | None:
    """None when `got` (a number, a tensor or nested lists) is `expected` within the tolerances, else what differs."""
    numeric = isinstance(got, (int, float, list, tuple, torch.Tensor)) or hasattr(got, "item")
    if isinstance(got, bool) or not numeric:
        return f"expected a number or a tensor, got a {type(got).__name__}"
    try:
        torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                                   torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol)
    except AssertionError as exc:
        return " ".join(str(exc).split())
    return None


def exact(expected: Any, got: Any) -> str | None:
    return None if (list(got) if isinstance(got, tuple) else got) == expected else "not the expected value"


def _check(reference: Callable[..., Any] | None, compare: Callable[[Any, Any], str | None] = close,
           ) -> Callable[[Callable[[int], list[Case]]], Callable[..., Result]]:
    """Makes `check_x(fn, seed=None)` from x's case table, drawn from a seed (fresh when None): it prints and returns the
    verdict on the first case where `compare` finds `fn` differs from `reference` (or `case.expected`)."""
    def make(cases: Callable[[int], list[Case]]) -> Callable[..., Result]:
        @functools.wraps(cases)
        def check(fn: Callable[..., Any], seed: int | None = None) -> Result:
            seed = random.SystemRandom().randrange(1, 1_000_000) if seed is None else seed
            result = _grade(cases.__name__.removeprefix("check_"), fn, cases(seed), reference, compare, seed)
            print(("PASS  " if result.passed else "TODO  " if result.not_implemented else "FAIL  ") + result.message)
            return result
        return check
    return make


def _grade(exercise: str, fn: Callable[..., Any], table: list[Case], reference: Callable[..., Any] | None,
           compare: Callable[[Any, Any], str | None], seed: int) -> Result:
    replay = f"(seed {seed}: `check_{exercise}(fn, seed={seed})` replays these cases)"
    for case in table:
        expected = case.expected if reference is None else reference(*copy.deepcopy(case.args))
        what = ""
        try:
            got = fn(*copy.deepcopy(case.args))
            what = f"returned {show(got)}: "
            diff = compare(expected, got)
        except NotImplementedError:
            return Result(False, None, f"{exercise}: not implemented yet. Write its body in the cell above (it still "
                          "raises NotImplementedError), run that cell, then run this check again.", True)
        except Exception as exc:  # a learner's bug, or a value the comparison cannot read, is a verdict
            diff = f"{'could not compare it:' if what else 'raised'} {type(exc).__name__}: {exc}"
        if diff is not None:
            inputs = ", ".join(show(a) for a in case.args)
            return Result(False, case.name, f"{exercise} fails the case '{case.name}' {replay}\n"
                          f"      inputs:   ({inputs})\n      expected: {show(expected)}\n"
                          f"      yours:    {what}{diff}\n      hint:     {case.hint}")
    return Result(True, None, f"{exercise}: correct on all {len(table)} cases, the edge cases included {replay}.")


@_check(lambda text: format_reward([text], ["0"])[0])
def check_format_score(seed: int) -> list[Case]:
    """`fn(completion) -> 1.0 | 0.5 | 0.0`, graded against `cbkit.tasks.rewards.format_reward`."""
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
    return cases


def _padding_reference(prompt_lens: list[int], completion_lens: list[int]) -> float:
    # A rollout as `generate()` records it (cbkit/rollout/generate.py), of a model with one number per token.
    rows = [SimpleNamespace(prompt_ids=[0] * p, completion_ids=[0] * c)
            for p, c in zip(prompt_lens, completion_lens, strict=True)]
    rollout = SimpleNamespace(backend="generate", completions=rows, engine_config={
        "batch_rows": len(rows), "padded_prompt_len": max(prompt_lens), "steps": max(completion_lens)})
    config = SimpleNamespace(num_attention_heads=1, num_key_value_heads=1, head_dim=1, num_hidden_layers=1)
    return kv_accounting(rollout, config, 1)["kv_padding_share"]  # type: ignore[return-value]


@_check(_padding_reference)
def check_padding_share(seed: int) -> list[Case]:
    """`fn(prompt_lens, completion_lens) -> share of the static batch's KV token slots that hold padding`."""
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
    return cases


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
def _recorded_steps() -> list[Case]:
    """The tiny model's rollout through the real engine, at fixed lengths: a wrong answer fails at the same step."""
    tiny = load_policy("tiny", seed=0, device="cpu")
    tok = tiny.tokenizer
    prompts = [tok.encode("Tom has 3 apples and buys 4 more apples at the market. How many apples does he have?"),
               tok.encode("A train leaves at noon and travels 60 miles per hour for three hours. How far is it?")]
    sampling = SamplingParams(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=0)
    backend = make_backend("continuous", tiny.model, cb_config={
        "page_size": 16, "num_blocks": workload_blocks([prompts[0]] * 3, 40, 16), "max_batch_tokens": 32})
    with record_engine_steps() as trace:
        rollout = backend.generate(prompts, 4, sampling, target_lengths=[3 + (11 * i) % 37 for i in range(8)])
    config = rollout.engine_config
    steps = trace.scheduler_inputs(config["max_batch_tokens"], config["max_requests_per_batch"])
    return [Case(f"engine step {i}", args, _step_hint(args, engine), engine) for i, args, engine in steps]


@_check(None, lambda expected, got: exact(expected, [tuple(x) for x in got]))
def check_schedule_step(seed: int) -> list[Case]:
    """`fn(candidates, token_budget, read_budget, max_requests) -> [(request_id, query_len)]`, per step of an engine run."""
    return _recorded_steps()


def _logprob_batch(g, rows: int, width: int, spread: float):
    old = -torch.rand(rows, width, generator=g) * 3
    sampled = old + (torch.rand(rows, width, generator=g) - 0.5) * 2 * spread
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width) < lengths[:, None]
    noise = torch.randn(rows, width, generator=g) * 5  # padding holds garbage, as a padded batch does
    return old.where(mask, noise), sampled.where(mask, -noise.abs()), mask


def _is_cases(seed: int, sequence: bool) -> list[Case]:
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


def _masked(expected: Any, got: Any) -> str | None:  # graded where the reference ratio is not 0: on the mask
    got = torch.as_tensor(got)
    return close(expected, got.where(expected != 0, 0.0) if got.shape == expected.shape else got)


@_check(lambda old, sampled, mask, clip_max: importance_weights(old, sampled, mask, "token_truncate",
                                                                 clip_max=clip_max)[0].where(mask, 0.0), _masked)
def check_token_is_weights(seed: int) -> list[Case]:
    """`fn(old, sampled, mask, clip_max) -> [B, T] weights` on the mask, against `importance_weights` (token_truncate)."""
    return _is_cases(seed, False)


@_check(lambda old, sampled, mask, clip_max: importance_weights(old, sampled, mask, "sequence_mask",
                                                                 clip_max=clip_max)[0][:, 0])
def check_sequence_mask_weights(seed: int) -> list[Case]:
    """`fn(old, sampled, mask, clip_max) -> [B] weights`, one per completion, against `importance_weights` (sequence_mask)."""
    return _is_cases(seed, True)


def _shape(**kw: Any) -> SimpleNamespace:  # a model config: the fields the planner reads
    return SimpleNamespace(**{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
                              "hidden_size": 256, "head_dim": None, "intermediate_size": 512, "vocab_size": 1000,
                              "sliding_window": None, "layer_types": None, **kw})


@_check(lambda config, rows, prompt_len, new, dtype_bytes: plan(
    config, num_prompts=1, num_generations=rows, prompt_len=prompt_len, max_new_tokens=new, dtype_bytes=dtype_bytes,
    device="cpu").generate.kv_bytes, exact)
def check_static_kv_bytes(seed: int) -> list[Case]:
    """`fn(config, rows, prompt_len, max_new_tokens, dtype_bytes) -> bytes`, against the planner's generate() plan."""
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
    return cases


# rtol 1e-3: TRL's 1e-4 added to the std is a guard for ties (a case below), not a number to reproduce
@_check(group_advantages, functools.partial(close, rtol=1e-3, atol=1e-5))
def check_group_advantages(seed: int) -> list[Case]:
    """`fn(rewards [B], num_generations) -> advantages [B]`, against `objective.group_advantages` (TRL's GRPO)."""
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
    return cases


def _aggregate(loss, mask, loss_type: LossType, max_len: int) -> float:
    """`grpo_loss`'s aggregation: policy = old makes every ratio 1, and an advantage of -loss makes the loss `loss`."""
    zeros = torch.zeros_like(loss)
    return grpo_loss(zeros, zeros, -loss, mask, loss_type=loss_type, max_completion_length=max_len)[0].item()


@_check(_aggregate)
def check_aggregate_loss(seed: int) -> list[Case]:
    """`fn(loss [B, T], mask [B, T], loss_type, max_completion_length) -> scalar`, against `objective.grpo_loss`."""
    g = torch.Generator().manual_seed(seed)

    def batch(rows, width, empty=False):
        loss = torch.randn(rows, width, generator=g)
        lengths = torch.randint(1, width + 1, (rows,), generator=g)
        lengths[0], lengths[-1] = 1, width
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
    for i, kind in enumerate(("grpo", "bnpo", "dr_grpo", "dapo")):
        cases.append(Case(f"drawn batch {i + 1} ('{kind}')", (*batch(int(torch.randint(2, 6, (), generator=g)), 12),
                                                             kind, 16), "which tokens are summed, divided by what?"))
    return cases


@_check(fresh_groups, exact)
def check_fresh_groups(seed: int) -> list[Case]:
    """`fn(group_versions, now, max_staleness) -> indices of the groups to keep`, against async GRPO's filter."""
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

    def completion() -> list[int]:  # tokens of one version, then of a later one: an update mid-rollout
        start = now - rng.randint(0, 4)
        return [start] * rng.randint(0, 6) + [min(now, start + rng.randint(0, 2))] * rng.randint(0, 6)

    for i in range(5):
        groups = [[completion() for _ in range(rng.randint(2, 4))] for _ in range(rng.randint(1, 6))]
        cases.append(Case(f"drawn rollout {i + 1}", (groups, now, rng.randint(0, 3)),
                          "age = now - version, for every token of every completion of the group."))
    return cases


# notebook -> its exercises in the order asked: (solution name, check); docs/workshop.md lists them with times.
EXERCISES: dict[str, list[tuple[str, Callable[..., Result]]]] = {
    "00_quickstart": [("format_score", check_format_score)],
    "01_kv_slot_recycling": [("padding_share", check_padding_share), ("schedule_step", check_schedule_step)],
    "02_logprob_correctness": [("token_is_weights", check_token_is_weights),
                               ("sequence_mask_weights", check_sequence_mask_weights)],
    "03_n_sweep": [("static_kv_bytes", check_static_kv_bytes)],
    "04_grpo_live": [("group_advantages", check_group_advantages), ("aggregate_loss", check_aggregate_loss)],
    "05_off_policy": [("fresh_groups", check_fresh_groups)],
}
