"""Prompts for GRPO rollouts: a seeded synthetic generator (the offline default), GSM8K (hub or local JSONL) and
reasoning-gym's procedural tasks, all as `Problem`s whose answers end in GSM8K's `#### <number>`."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbkit.tasks.rewards import normalize_number
from cbkit.tasks.wordproblems import word_problem

SYSTEM_PROMPT = ("You are a careful math tutor. Solve the problem with brief step-by-step reasoning, a few short lines "
                 "at most. Then give the final answer as a plain number on its own last line, in the form\n"
                 "#### <number>\nand write nothing after that line.")

GSM8K_DIR_ENV = "CBKIT_GSM8K_DIR"
GENERATED_N = 256  # generated sources need a size for n=None
PROCEDURAL = "reasoning-gym:"


@dataclass(frozen=True)
class Problem:
    """One prompt. `answer` is the gold number as `normalize_number` writes it ("72", "-3", "0.5")."""

    id: str
    question: str
    answer: str
    solution: str | None = None


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
        gold = normalize_number(solution.rsplit("####", 1)[1])
        if gold is None:
            raise ValueError(f"{where}: the text after the last '####' is {solution.rsplit('####', 1)[1].strip()!r}, "
                             "not a number; write the gold answer as '#### 72'")
        problems.append(Problem(f"{id_prefix}-{i}", question, gold, solution))
    return problems


def _check_count(n: int | None, name: str) -> None:
    if n is not None and n < 1:
        raise ValueError(f"{name}={n}: ask for at least 1 problem, or None for all of them")


def load_gsm8k_jsonl(path: str | os.PathLike[str], limit: int | None = None) -> list[Problem]:
    """Problems from a GSM8K-format JSONL file; ids are `gsm8k-<file stem>-<row>`."""
    _check_count(limit, "limit")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path}. Pass a GSM8K-format .jsonl (one object per line: "
                                '{"question": ..., "answer": "... #### 72"}), or use source="synthetic".')

    def rows() -> Iterable[tuple[str, Mapping[str, Any]]]:
        with path.open(encoding="utf-8") as f:
            lines = ((n, line) for n, line in enumerate(f, start=1) if line.strip())
            for lineno, line in itertools.islice(lines, limit):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {lineno}: not valid JSON ({e.msg}); each line must be one JSON "
                                     "object") from e
                if not isinstance(row, dict):
                    raise ValueError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
                yield f"{path} line {lineno}", row

    problems = _problems_from_rows(rows(), f"gsm8k-{path.stem}")
    if not problems:
        raise ValueError(f"empty dataset: {path} has no rows")
    return problems


def _gsm8k_hub(split: str, limit: int | None) -> list[Problem]:
    """`openai/gsm8k` from the Hugging Face hub (needs network; the path Colab uses)."""
    try:
        from datasets import load_dataset

        ds = load_dataset("openai/gsm8k", "main", split=split)
    except Exception as e:
        raise RuntimeError(f"could not load openai/gsm8k from the hub ({type(e).__name__}: {e}). Offline? Use "
                           f"source='synthetic', 'gsm8k-local' (with ${GSM8K_DIR_ENV}), or a .jsonl path.") from e
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return _problems_from_rows(((f"openai/gsm8k {split} row {i}", row) for i, row in enumerate(ds)),
                               f"gsm8k-{split}")


def gsm8k_local_candidates(split: str = "test") -> list[Path]:
    """Where `gsm8k-local` looks, in order: $CBKIT_GSM8K_DIR, ../shared/data/gsm8k, <repo>/../shared."""
    dirs = [Path(os.environ[GSM8K_DIR_ENV])] if os.environ.get(GSM8K_DIR_ENV) else []
    dirs += [Path.cwd().parent / "shared/data/gsm8k", Path(__file__).resolve().parents[2] / "shared/data/gsm8k"]
    return [d / f"{split}.jsonl" for d in dirs]


def _gsm8k_local(split: str, limit: int | None) -> list[Problem]:
    candidates = gsm8k_local_candidates(split)
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        looked = "\n  ".join(str(c) for c in candidates)
        raise FileNotFoundError(f"gsm8k-local: no {split}.jsonl found; looked in\n  {looked}\nSet ${GSM8K_DIR_ENV} to "
                                "its folder, pass the .jsonl path itself, or use source='synthetic'.")
    return load_gsm8k_jsonl(found, limit=limit)


def synthetic_gsm(n: int, seed: int = 0) -> list[Problem]:
    """`n` GSM-style word problems (`cbkit.tasks.wordproblems`); problem i depends only on (seed, i)."""
    _check_count(n, "n")
    problems = []
    for i in range(n):
        question, solution, answer = word_problem(seed, i)
        problems.append(Problem(f"synthetic-{seed}-{i}", question, str(answer), solution))
    return problems


def procedural_problems(source: str, n: int, seed: int, options: Mapping[str, Any] | None = None) -> list[Problem]:
    """`n` problems of the reasoning-gym dataset named in `source`, at the difficulty `options` sets."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ModuleNotFoundError(f"{source!r} needs the reasoning-gym package: pip install reasoning-gym "
                                  "(cbkit's default install has it).") from e
    name, options = source.removeprefix(PROCEDURAL), dict(options or {})
    try:
        dataset = reasoning_gym.create_dataset(name, size=n, seed=seed, **options)
    except Exception as e:  # unknown name or option: reasoning-gym raises KeyError/TypeError/ValueError/AssertionError
        raise ValueError(f"reasoning-gym could not build {name!r} with options {options}: {type(e).__name__}: {e}. "
                         "Check the dataset name and its config fields (reasoning_gym.factory lists them).") from e
    problems = []
    for i, row in enumerate(dataset):
        gold = normalize_number(str(row["answer"]))
        if gold is None:
            raise ValueError(f"{source} problem {i} has answer {row['answer']!r}, not a number (cbkit's rewards "
                             "score numbers); choose an arithmetic dataset: chain_sum, basic_arithmetic, products.")
        problems.append(Problem(f"rg-{name}-{seed}-{i}", row["question"], gold))
    return problems


def load_problems(source: str = "synthetic", n: int | None = None, seed: int = 0,
                  options: Mapping[str, Any] | None = None) -> list[Problem]:
    """The one entry point: `n` caps the count, `seed` is for generated sources, `options` for reasoning-gym's knobs."""
    _check_count(n, "n")
    procedural = source.startswith(PROCEDURAL)
    if options and not procedural:
        raise ValueError(f"data_options {dict(options)} are knobs of a reasoning-gym source; {source!r} takes none. "
                         f"Remove data_options, or use data='{PROCEDURAL}<dataset>'.")
    kind, _, split = source.partition(":")
    if procedural:
        return procedural_problems(source, GENERATED_N if n is None else n, seed, options)
    if source == "synthetic":
        return synthetic_gsm(GENERATED_N if n is None else n, seed=seed)
    if kind in ("gsm8k", "gsm8k-local") and split in ("", "test", "train"):
        return (_gsm8k_hub if kind == "gsm8k" else _gsm8k_local)(split or "test", n)
    if source.endswith(".jsonl"):
        return load_gsm8k_jsonl(source, limit=n)
    raise ValueError(f"unknown problem source {source!r}; accepted forms: 'synthetic' (offline), 'gsm8k', "
                     f"'gsm8k:test' or 'gsm8k:train' (the hub), 'gsm8k-local' or 'gsm8k-local:train' (${GSM8K_DIR_ENV} "
                     f"or ../shared/data/gsm8k), a GSM8K-format .jsonl path, or '{PROCEDURAL}<dataset>'.")


def chat_prompt_ids(tokenizer: Any, problem_or_question: Problem | str,
                    system_prompt: str | None = SYSTEM_PROMPT) -> list[int]:
    """Token ids of the chat-formatted prompt; `system_prompt=None` sends the user turn alone."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{type(tokenizer).__name__} has no chat template to format the prompts with: load an "
                         "instruct/chat model's tokenizer (e.g. SmolLM2-135M-Instruct) or set tokenizer.chat_template.")
    question = problem_or_question.question if isinstance(problem_or_question, Problem) else problem_or_question
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    out = tokenizer.apply_chat_template([*system, {"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return [int(t) for t in out["input_ids"]]
