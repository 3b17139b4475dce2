"""Prompts for GRPO rollouts: GSM8K (hub or local JSONL), reasoning-gym tasks and a seeded synthetic generator.

The synthetic default needs no network, is reproducible from a seed, and varies completion lengths the way word
problems do, which is what rollout experiments need; use real GSM8K when the reward curve is the point. Answers end
in GSM8K's own `#### <number>`, so one extractor (`rewards.extract_answer`) reads gold answers and completions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbkit.tasks.procedural import is_procedural, procedural_problems
from cbkit.tasks.rewards import normalize_number
from cbkit.tasks.wordproblems import word_problem

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem with brief step-by-step reasoning, a few short "
    "lines at most. Then give the final answer as a plain number on its own last line, in the form\n"
    "#### <number>\n"
    "and write nothing after that line."
)

GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_SPLITS = ("test", "train")
GSM8K_DIR_ENV = "CBKIT_GSM8K_DIR"
DEFAULT_SYNTHETIC_N = 256  # generated sources need a size for n=None

ACCEPTED_SOURCES = (
    "'synthetic' (seeded generator, offline)",
    "'gsm8k', 'gsm8k:test' or 'gsm8k:train' (Hugging Face hub, needs network)",
    f"'gsm8k-local' or 'gsm8k-local:train' (a local copy found via ${GSM8K_DIR_ENV} or ../shared/data/gsm8k)",
    "a path to a GSM8K-format .jsonl file",
    "'reasoning-gym:<dataset>' (a procedural task, e.g. reasoning-gym:chain_sum; its knobs in data_options)",
)


@dataclass(frozen=True)
class Problem:
    """One prompt. `answer` is the gold number as `normalize_number` writes it ("72", "-3", "0.5")."""

    id: str
    question: str
    answer: str
    solution: str | None = None


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
            raise ValueError(f"{where}: expected string fields 'question' and 'answer', got keys {sorted(row)}; "
                             'each row must look like {"question": "...", "answer": "... #### 72"}')
        if "####" not in solution:
            raise ValueError(f"{where}: the 'answer' field has no '####'; GSM8K answers end with '#### <gold number>'")
        gold = _gold_from_solution(solution)
        if gold is None:
            raise ValueError(f"{where}: the text after the last '####' is {solution.rsplit('####', 1)[1].strip()!r}, "
                             "not a number; write the gold answer as '#### 72'")
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
        raise FileNotFoundError(f"GSM8K file not found: {path}. Pass a GSM8K-format .jsonl (one "
                                '{"question": ..., "answer": "... #### 72"} object per line), or use source="synthetic".')

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
                    raise ValueError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from e
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
        raise RuntimeError(f"could not load {GSM8K_HUB_ID} from the hub ({type(e).__name__}: {e}). Offline? Use "
                           f"source='synthetic', 'gsm8k-local' (with ${GSM8K_DIR_ENV}), or a path to a .jsonl file."
                           ) from e
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    problems = _problems_from_rows(((f"{GSM8K_HUB_ID} {split} row {i}", row) for i, row in enumerate(ds)),
                                   f"gsm8k-{split}")
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
    raise FileNotFoundError(f"gsm8k-local: no {split}.jsonl found; looked in\n  {looked}\nSet ${GSM8K_DIR_ENV} to "
                            f"the folder holding {split}.jsonl, pass the .jsonl path itself, or use source='synthetic'.")


def synthetic_gsm(n: int, seed: int = 0) -> list[Problem]:
    """`n` GSM-style word problems (`cbkit.tasks.wordproblems`); problem i depends only on (seed, i)."""
    _check_limit(n, "n")
    problems = []
    for i in range(n):
        question, solution, answer = word_problem(seed, i)
        problems.append(Problem(f"synthetic-{seed}-{i}", question, str(answer), solution))
    return problems


def load_problems(source: str = "synthetic", n: int | None = None, seed: int = 0,
                  options: Mapping[str, Any] | None = None) -> list[Problem]:
    """The one entry point. `n` caps the count (GSM8K's first rows, in file order); `seed` is for generated
    sources, `options` for reasoning-gym's difficulty knobs (`cbkit.tasks.procedural`)."""
    _check_limit(n, "n")
    if options and not is_procedural(source):
        raise ValueError(f"data_options {dict(options)} are knobs of a reasoning-gym source; {source!r} takes none. "
                         "Remove data_options, or use data='reasoning-gym:<dataset>'.")
    kind, _, split = source.partition(":")
    if is_procedural(source):
        drawn = procedural_problems(source, DEFAULT_SYNTHETIC_N if n is None else n, seed, options)
        problems = [Problem(*row) for row in drawn]
    elif source == "synthetic":
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


def chat_prompt_ids(tokenizer: Any, problem_or_question: Problem | str,
                    system_prompt: str | None = SYSTEM_PROMPT) -> list[int]:
    """Token ids of the chat-formatted prompt (system + user + generation prompt); `system_prompt=None` sends the
    user turn alone, for chat templates that reject a system role."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat template, so prompts cannot be formatted as a chat. "
                         "Load an instruct/chat model's tokenizer (e.g. SmolLM2-135M-Instruct) or set "
                         "tokenizer.chat_template.")
    question = problem_or_question.question if isinstance(problem_or_question, Problem) else problem_or_question
    messages = [{"role": "user", "content": question}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        if len(out) != 1:
            raise ValueError(f"apply_chat_template returned {len(out)} sequences for one conversation")
        out = out[0]
    return [int(t) for t in out]
