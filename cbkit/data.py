"""Prompts for GRPO rollouts: GSM8K (hub or local JSONL) and a seeded synthetic generator.

Why a synthetic default. The experiments here are about *rollouts* (how long completions get, how
unevenly, and what that does to padded vs continuous batching), not about GSM8K scores. A generator
needs no network (CI, air-gapped machines), costs nothing to load, is reproducible from a seed, and
is built to produce what rollout experiments need: questions from ~15 to ~80 words, needing 1 to 5
arithmetic steps, so completion lengths vary the way they do on real word problems. Its answers are
computed, not written down, and each problem carries a GSM8K-style worked solution whose
`<<a*b=c>>` annotations can be re-evaluated, so a test can check every one. Use real GSM8K when the
reward curve is the point: `load_problems("gsm8k")` on Colab, `"gsm8k-local"` or a `.jsonl` path here.

Why `#### <number>`. It is GSM8K's own convention (every gold solution ends with `#### 72`), so one
extractor (`cbkit.rewards.extract_answer`) reads both the gold answers and the model's completions,
and the format reward has a single, checkable target: the last line. A fixed marker also tells a
small model where to stop, which shortens the long tail of completions that dominates rollout time.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbkit.rewards import normalize_number

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem with brief step-by-step reasoning, a few short "
    "lines at most. Then give the final answer as a plain number on its own last line, in the form\n"
    "#### <number>\n"
    "and write nothing after that line."
)

GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_SPLITS = ("test", "train")
GSM8K_DIR_ENV = "CBKIT_GSM8K_DIR"
# Synthetic problems are free, so `n=None` needs a size; 256 covers a few dozen GRPO steps.
DEFAULT_SYNTHETIC_N = 256

ACCEPTED_SOURCES = (
    "'synthetic' (seeded generator, offline)",
    "'gsm8k', 'gsm8k:test' or 'gsm8k:train' (Hugging Face hub, needs network)",
    f"'gsm8k-local' or 'gsm8k-local:train' (a local copy found via ${GSM8K_DIR_ENV} or ../shared/data/gsm8k)",
    "a path to a GSM8K-format .jsonl file",
)


@dataclass(frozen=True)
class Problem:
    """One prompt. `answer` is the gold number as `normalize_number` writes it ("72", "-3", "0.5")."""

    id: str
    question: str
    answer: str
    solution: str | None = None


# --------------------------------------------------------------------------------------------- GSM8K


def _gold_from_solution(solution: str) -> str | None:
    if "####" not in solution:
        return None
    return normalize_number(solution.rsplit("####", 1)[1])


def _problems_from_rows(rows: Iterable[tuple[str, Mapping[str, Any]]], id_prefix: str) -> list[Problem]:
    """`rows` yields (where, row): `where` names the row in error messages ("test.jsonl line 7")."""
    problems = []
    for i, (where, row) in enumerate(rows):
        question, solution = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise ValueError(
                f"{where}: expected string fields 'question' and 'answer', got keys {sorted(row)}; "
                'each row must look like {"question": "...", "answer": "... #### 72"}'
            )
        if "####" not in solution:
            raise ValueError(
                f"{where}: the 'answer' field has no '####'; GSM8K answers end with '#### <gold number>'"
            )
        gold = _gold_from_solution(solution)
        if gold is None:
            raise ValueError(
                f"{where}: the text after the last '####' is {solution.rsplit('####', 1)[1].strip()!r}, "
                "not a number; write the gold answer as '#### 72'"
            )
        problems.append(Problem(f"{id_prefix}-{i}", question, gold, solution))
    return problems


def _check_limit(limit: int | None, name: str = "limit") -> None:
    if limit is not None and limit < 1:
        raise ValueError(f"{name}={limit}: ask for at least 1 problem, or None for all of them")


def load_gsm8k_jsonl(path: str | os.PathLike[str], limit: int | None = None) -> list[Problem]:
    """Problems from a GSM8K-format JSONL file; ids are `gsm8k-<file stem>-<row>`."""
    _check_limit(limit)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K file not found: {path}. Pass a GSM8K-format .jsonl (one "
            '{"question": ..., "answer": "... #### 72"} object per line), or use source="synthetic".'
        )

    def rows() -> Iterable[tuple[str, Mapping[str, Any]]]:
        taken = 0
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if limit is not None and taken >= limit:
                    return
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{where}: not valid JSON ({e.msg}); each line must be one JSON object"
                    ) from e
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
                taken += 1
                yield where, row

    problems = _problems_from_rows(rows(), f"gsm8k-{path.stem}")
    if not problems:
        raise ValueError(f"empty dataset: {path} has no rows")
    return problems


def load_gsm8k_hub(split: str = "test", limit: int | None = None) -> list[Problem]:
    """Problems from `openai/gsm8k` on the Hugging Face hub (needs network; the path Colab uses)."""
    _check_limit(limit)
    if split not in GSM8K_SPLITS:
        raise ValueError(f"split={split!r}: GSM8K has splits {GSM8K_SPLITS}")
    try:
        from datasets import load_dataset

        ds = load_dataset(GSM8K_HUB_ID, "main", split=split)
    except Exception as e:
        raise RuntimeError(
            f"could not load {GSM8K_HUB_ID} from the hub ({type(e).__name__}: {e}). Offline? Use "
            f"source='synthetic', 'gsm8k-local' (with ${GSM8K_DIR_ENV}), or a path to a .jsonl file."
        ) from e
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    problems = _problems_from_rows(
        ((f"{GSM8K_HUB_ID} {split} row {i}", row) for i, row in enumerate(ds)), f"gsm8k-{split}"
    )
    if not problems:
        raise ValueError(f"empty dataset: {GSM8K_HUB_ID} split {split!r} has no rows")
    return problems


def gsm8k_local_candidates(split: str = "test") -> list[Path]:
    """Where `gsm8k-local` looks, in order: $CBKIT_GSM8K_DIR, ../shared/data/gsm8k, <repo>/../shared."""
    dirs = []
    if os.environ.get(GSM8K_DIR_ENV):
        dirs.append(Path(os.environ[GSM8K_DIR_ENV]))
    dirs.append(Path.cwd().parent / "shared" / "data" / "gsm8k")
    dirs.append(Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")
    return [d / f"{split}.jsonl" for d in dirs]


def _load_gsm8k_local(split: str, limit: int | None) -> list[Problem]:
    candidates = gsm8k_local_candidates(split)
    for candidate in candidates:
        if candidate.is_file():
            return load_gsm8k_jsonl(candidate, limit=limit)
    looked = "\n  ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"gsm8k-local: no {split}.jsonl found; looked in\n  {looked}\n"
        f"Set ${GSM8K_DIR_ENV} to the folder holding {split}.jsonl, pass the .jsonl path itself, "
        "or use source='synthetic'."
    )


# ----------------------------------------------------------------------------------------- synthetic

_PEOPLE = (
    ("Maya", "she", "her"),
    ("Liam", "he", "his"),
    ("Aisha", "she", "her"),
    ("Noah", "he", "his"),
    ("Sofia", "she", "her"),
    ("Kenji", "he", "his"),
    ("Priya", "she", "her"),
    ("Mateo", "he", "his"),
    ("Chloe", "she", "her"),
    ("Omar", "he", "his"),
    ("Elena", "she", "her"),
    ("Tariq", "he", "his"),
    ("Grace", "she", "her"),
    ("Jonas", "he", "his"),
    ("Lucia", "she", "her"),
    ("Daniel", "he", "his"),
)
_SHOP_ITEMS = (
    ("notebooks", 2, 6),
    ("pens", 1, 3),
    ("boxes of crayons", 3, 8),
    ("sandwiches", 4, 9),
    ("movie tickets", 6, 14),
    ("apples", 1, 2),
    ("cups of coffee", 2, 5),
    ("bags of rice", 5, 12),
    ("t-shirts", 8, 20),
    ("plant pots", 3, 10),
)
_SHARE_THINGS = ("stickers", "marbles", "cookies", "baseball cards", "seashells", "crayons", "strawberries")
_MACHINES = (
    ("bakery oven", "bakes", "loaves of bread"),
    ("printer", "prints", "pages"),
    ("toy factory machine", "builds", "toy cars"),
    ("juice press", "fills", "bottles"),
    ("sewing machine", "stitches", "patches"),
)
_PURCHASES = ("bike helmet", "board game", "pair of shoes", "video game", "backpack", "telescope")
_JOBS = ("babysitting", "walking dogs", "mowing lawns", "washing cars", "tutoring")
# Number-free filler: GSM8K questions carry scene-setting, and its length (not its content) is what
# moves prompt lengths around, which is what the rollout experiments need.
_SCENES = (
    "It is an ordinary weekday in a small town.",
    "Everyone involved wants to know the exact number, so they write everything down carefully.",
    "The question came up during a family dinner, and nobody could agree on the answer at first.",
    "It has been a busy week, and there are many things to keep track of.",
    "A teacher later uses this story as a warm-up exercise for the whole class.",
    "Nothing else changes during this time, and nobody makes any mistakes with the counting.",
)


class _Solution:
    """Builds a GSM8K-style worked solution, one `<<expr=value>>` line per arithmetic step."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def step(self, expr: str, value: int, template: str) -> int:
        """`template` holds one `{}` where the annotated computation goes."""
        self.lines.append(template.format(f"{expr} = <<{expr.replace(' ', '')}={value}>>{value}"))
        return value

    def finish(self, answer: int) -> str:
        return "\n".join([*self.lines, f"#### {answer}"])


def _join(parts: list[str]) -> str:
    if len(parts) <= 2:
        return " and ".join(parts)
    return ", ".join(parts[:-1]) + ", and " + parts[-1]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _shopping(rng: random.Random) -> tuple[str, str, int]:
    name, subj, _ = rng.choice(_PEOPLE)
    items = rng.sample(_SHOP_ITEMS, rng.randint(1, 4))
    sol = _Solution()
    bought, costs = [], []
    for plural, lo, hi in items:
        qty, price = rng.randint(2, 9), rng.randint(lo, hi)
        bought.append(f"{qty} {plural} at ${price} each")
        costs.append(sol.step(f"{qty} * {price}", qty * price, f"The {plural} cost {{}} dollars."))
    total = costs[0]
    if len(costs) > 1:
        total = sol.step(" + ".join(map(str, costs)), sum(costs), "Altogether that is {} dollars.")
    text = f"{name} goes to the store and buys {_join(bought)}."
    if rng.random() < 0.5:
        bill = next(b for b in (10, 20, 50, 100, 200, 500) if b >= total)
        change = sol.step(f"{bill} - {total}", bill - total, "The change is {} dollars.")
        return (
            f"{text} {subj.capitalize()} pays with a ${bill} bill. How much change does {subj} get back?",
            sol.finish(change),
            change,
        )
    return f"{text} How much money does {subj} spend in total?", sol.finish(total), total


def _sharing(rng: random.Random) -> tuple[str, str, int]:
    name, subj, poss = rng.choice(_PEOPLE)
    things = rng.choice(_SHARE_THINGS)
    friends, each = rng.randint(2, 6), rng.randint(2, 12)
    sol = _Solution()
    shared = friends * each
    style = rng.randint(0, 2)
    if style == 0:
        text = (
            f"{name} has {shared} {things}. {subj.capitalize()} shares them equally among {friends} friends."
        )
    else:
        keep = rng.randint(1, 15)
        if style == 1:
            have = shared + keep
            text = f"{name} has {have} {things}."
        else:
            packs = rng.randint(2, 6)
            # Pick the pack size so that packs * size covers the shared part and the kept part.
            size = -(-(shared + keep) // packs)
            have = sol.step(f"{packs} * {size}", packs * size, f"{name} has {{}} {things}.")
            keep = have - shared
            text = f"{name} buys {packs} packs of {things} with {size} in each pack."
        text += (
            f" {subj.capitalize()} keeps {keep} for {poss} little sister and shares the rest equally "
            f"among {friends} friends."
        )
        sol.step(f"{have} - {keep}", shared, "That leaves {} to share.")
    each = sol.step(f"{shared} / {friends}", each, "Each friend gets {}.")
    return f"{text} How many {things} does each friend get?", sol.finish(each), each


def _rates(rng: random.Random) -> tuple[str, str, int]:
    machine, verb, things = rng.choice(_MACHINES)
    sol = _Solution()
    per_minute = rng.random() < 0.3
    rate = rng.randint(2, 6) if per_minute else rng.randint(5, 40)
    hours = rng.randint(2, 8)
    if per_minute:
        text = f"A {machine} {verb} {rate} {things} every minute."
        rate = sol.step(f"{rate} * 60", rate * 60, f"In an hour it makes {{}} {things}.")
    else:
        text = f"A {machine} {verb} {rate} {things} every hour."
    days = rng.randint(2, 7) if rng.random() < 0.7 else 1
    if days == 1:
        total = sol.step(f"{rate} * {hours}", rate * hours, f"It makes {{}} {things}.")
        return f"{text} How many {things} does it make in {hours} hours?", sol.finish(total), total
    text += f" It runs for {hours} hours every day."
    good = ""
    daily = sol.step(f"{rate} * {hours}", rate * hours, f"Each day it makes {{}} {things}.")
    if rng.random() < 0.5:
        broken = rng.randint(1, max(1, daily // 4))
        text += f" Each day, {broken} of the {things} come out damaged and are thrown away."
        good = "good "
        daily = sol.step(f"{daily} - {broken}", daily - broken, f"Each day {{}} good {things} are left.")
    total = sol.step(f"{daily} * {days}", daily * days, f"In {days} days that is {{}} {things}.")
    if rng.random() < 0.4:
        price = rng.randint(1, 5)
        money = sol.step(f"{total} * {price}", total * price, "They are sold for {} dollars.")
        return (
            f"{text} Every {good}one is sold for ${price}. How many dollars does the owner earn in {days} days?",
            sol.finish(money),
            money,
        )
    return f"{text} How many {good}{things} does it make in {days} days?", sol.finish(total), total


def _ages(rng: random.Random) -> tuple[str, str, int]:
    people = [p[0] for p in rng.sample(_PEOPLE, 4)]
    sol = _Solution()
    first = rng.randint(3, 15)
    ages = [first]
    text = [f"{people[0]} is {first} years old."]
    for k in range(1, rng.randint(2, 4)):
        prev, who, ref = ages[-1], people[k], people[k - 1]
        kinds = ("older", "twice", "younger") if prev < 40 else ("older", "younger")
        kind = rng.choice(kinds if prev >= 4 else kinds[:2])
        if kind == "older":
            d = rng.randint(2, 9)
            age = sol.step(f"{prev} + {d}", prev + d, f"{who} is {{}} years old.")
            text.append(f"{who} is {d} years older than {ref}.")
        elif kind == "twice":
            age = sol.step(f"2 * {prev}", 2 * prev, f"{who} is {{}} years old.")
            text.append(f"{who} is twice as old as {ref}.")
        else:
            d = rng.randint(1, prev - 3)
            age = sol.step(f"{prev} - {d}", prev - d, f"{who} is {{}} years old.")
            text.append(f"{who} is {d} years younger than {ref}.")
        ages.append(age)
    last = people[len(ages) - 1]
    ask = rng.randint(0, 2)
    if ask == 0:
        return " ".join(text) + f" How old is {last}?", sol.finish(ages[-1]), ages[-1]
    if ask == 1:
        later = rng.randint(2, 10)
        age = sol.step(f"{ages[-1]} + {later}", ages[-1] + later, f"In {later} years {last} will be {{}}.")
        return " ".join(text) + f" How old will {last} be in {later} years?", sol.finish(age), age
    total = sol.step(" + ".join(map(str, ages)), sum(ages), "Together they are {} years old.")
    ask_sum = (
        f"What is the sum of all {('three', 'four')[len(ages) - 3]} ages?"
        if len(ages) > 2
        else (f"What is the sum of {people[0]}'s and {people[1]}'s ages?")
    )
    return f"{' '.join(text)} {ask_sum}", sol.finish(total), total


def _savings(rng: random.Random) -> tuple[str, str, int]:
    name, subj, poss = rng.choice(_PEOPLE)
    sol = _Solution()
    weekly, weeks = rng.randint(3, 25), rng.randint(2, 12)
    saved = sol.step(f"{weekly} * {weeks}", weekly * weeks, f"{name} saves {{}} dollars.")
    if rng.random() < 0.25:
        return (
            f"{name} saves ${weekly} every week. How much money does {subj} save in {weeks} weeks?",
            sol.finish(saved),
            saved,
        )
    start = rng.randint(5, 60)
    text = f"{name} has ${start} in {poss} piggy bank."
    text += f" {subj.capitalize()} saves ${weekly} every week for {weeks} weeks."
    money = sol.step(f"{start} + {saved}", start + saved, "Then there is {} dollars in the bank.")
    if rng.random() < 0.6:
        item = rng.choice(_PURCHASES)
        price = rng.randint(1, money)
        text += f" Then {subj} buys a {item} for ${price}."
        money = sol.step(f"{money} - {price}", money - price, "After the purchase {} dollars are left.")
    if rng.random() < 0.5:
        job, earned = rng.choice(_JOBS), rng.randint(5, 40)
        text += f" After that, {subj} earns ${earned} {job}."
        money = sol.step(f"{money} + {earned}", money + earned, "Now there is {} dollars.")
    if rng.random() < 0.4 and money % 2 == 0:
        text += f" Finally, {subj} gives half of {poss} money to {poss} brother."
        money = sol.step(f"{money} / 2", money // 2, "Half leaves {} dollars.")
    return f"{text} How much money does {name} have now?", sol.finish(money), money


def _travel(rng: random.Random) -> tuple[str, str, int]:
    name, subj, _ = rng.choice(_PEOPLE)
    sol = _Solution()
    v1, h1 = rng.randint(20, 70), rng.randint(1, 4)
    d1 = sol.step(f"{v1} * {h1}", v1 * h1, "The first part is {} miles.")
    text = f"{name} drives at {v1} miles per hour for {_plural(h1, 'hour')}"
    if rng.random() < 0.4:
        return f"{text}. How many miles does {subj} drive?", sol.finish(d1), d1
    v2, h2 = rng.randint(20, 70), rng.randint(1, 4)
    d2 = sol.step(f"{v2} * {h2}", v2 * h2, "The second part is {} miles.")
    text += f", stops for lunch, and then drives at {v2} miles per hour for {_plural(h2, 'more hour')}."
    total = sol.step(f"{d1} + {d2}", d1 + d2, "In total that is {} miles.")
    if rng.random() < 0.5:
        trip = total + rng.randint(5, 120)
        left = sol.step(f"{trip} - {total}", trip - total, "{} miles are left.")
        return (
            f"{text} The whole trip is {trip} miles long. How many miles does {subj} still have to drive?",
            sol.finish(left),
            left,
        )
    return f"{text} How many miles does {subj} drive in total?", sol.finish(total), total


_TEMPLATES: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (
    _shopping,
    _sharing,
    _rates,
    _ages,
    _savings,
    _travel,
)


def synthetic_gsm(n: int, seed: int = 0) -> list[Problem]:
    """`n` GSM-style word problems with computed non-negative integer answers, reproducible from `seed`.

    Problem i depends only on (seed, i), so a larger `n` extends the list without changing its start.
    """
    _check_limit(n, "n")
    problems = []
    for i in range(n):
        rng = random.Random(f"cbkit-synthetic/{seed}/{i}")
        question, solution, answer = rng.choice(_TEMPLATES)(rng)
        if answer < 0:  # a template bug, not a user error: fail where it happens
            raise AssertionError(f"synthetic problem {i} (seed {seed}) has negative answer {answer}")
        scenes = rng.sample(_SCENES, rng.choice((0, 0, 1, 2)))
        problems.append(
            Problem(f"synthetic-{seed}-{i}", " ".join([*scenes, question]), str(answer), solution)
        )
    return problems


# ------------------------------------------------------------------------------------------ one door


def load_problems(source: str = "synthetic", n: int | None = None, seed: int = 0) -> list[Problem]:
    """The one entry point. `n` caps the count (fewer if the data has fewer); `seed` is for synthetic.

    Real GSM8K rows come in file order, so `n` always picks the same first rows.
    """
    _check_limit(n, "n")
    kind, _, split = source.partition(":")
    if source == "synthetic":
        problems = synthetic_gsm(DEFAULT_SYNTHETIC_N if n is None else n, seed=seed)
    elif kind in ("gsm8k", "gsm8k-local") and split in ("", *GSM8K_SPLITS):
        split = split or "test"
        problems = load_gsm8k_hub(split, limit=n) if kind == "gsm8k" else _load_gsm8k_local(split, n)
    elif source.endswith(".jsonl"):
        problems = load_gsm8k_jsonl(source, limit=n)
    else:
        accepted = "\n  ".join(ACCEPTED_SOURCES)
        raise ValueError(f"unknown problem source {source!r}; accepted forms:\n  {accepted}")
    if not problems:
        raise ValueError(f"empty dataset: source {source!r} gave no problems")
    return problems


# --------------------------------------------------------------------------------------------- chat


def chat_prompt_ids(
    tokenizer: Any, problem_or_question: Problem | str, system_prompt: str | None = SYSTEM_PROMPT
) -> list[int]:
    """Token ids of the chat-formatted prompt (system + user + generation prompt), as a plain list.

    `system_prompt=None` sends the user turn alone, for chat templates that reject a system role.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template, so prompts cannot be formatted as a chat. "
            "Load an instruct/chat model's tokenizer (e.g. SmolLM2-135M-Instruct) "
            "or set tokenizer.chat_template."
        )
    question = (
        problem_or_question.question if isinstance(problem_or_question, Problem) else problem_or_question
    )
    messages = [{"role": "user", "content": question}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    # transformers 5.x returns a BatchEncoding by default; 4.x returned a list. Accept both.
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        if len(out) != 1:
            raise ValueError(f"apply_chat_template returned {len(out)} sequences for one conversation")
        out = out[0]
    return [int(t) for t in out]
