from __future__ import annotations

import ast
import json
import operator
import os
import re
from pathlib import Path

import pytest

import cbkit.tasks.data
from cbkit.tasks.data import (
    SYSTEM_PROMPT,
    Problem,
    chat_prompt_ids,
    gsm8k_local_candidates,
    load_gsm8k_jsonl,
    load_problems,
    synthetic_gsm,
)
from cbkit.tasks.rewards import extract_answer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A 258-token byte-level tokenizer with a ChatML template: every string round-trips, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>", bos_token=None, unk_token=None
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _row(question: str, answer: str) -> str:
    return json.dumps({"question": question, "answer": answer})


# ------------------------------------------------------------------------------------------- jsonl


def test_jsonl_loader_reads_rows(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "test.jsonl",
        [
            _row("How many?", "2 + 3 = <<2+3=5>>5\n#### 5"),
            "",  # blank lines are skipped, not errors
            _row("How much?", "It costs a lot.\n#### 1,234"),
            _row("How cold?", "#### -3"),
        ],
    )
    problems = load_gsm8k_jsonl(path)
    assert [p.id for p in problems] == ["gsm8k-test-0", "gsm8k-test-1", "gsm8k-test-2"]
    assert [p.answer for p in problems] == ["5", "1234", "-3"]
    assert problems[0] == Problem("gsm8k-test-0", "How many?", "5", "2 + 3 = <<2+3=5>>5\n#### 5")
    assert len(load_gsm8k_jsonl(path, limit=2)) == 2
    assert len(load_gsm8k_jsonl(path, limit=100)) == 3


def test_jsonl_loader_names_the_malformed_line(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "bad.jsonl", [_row("q", "#### 1"), _row("q", "#### 2"), '{"question": "q",']
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3: not valid JSON"):
        load_gsm8k_jsonl(path)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (_row("q", "the answer is 4"), r"line 2: the 'answer' field has no '####'"),
        (_row("q", "#### four"), r"line 2: the text after the last '####' is 'four'"),
        (json.dumps({"question": "q"}), r"line 2: expected string fields 'question' and 'answer'"),
        ("[1, 2]", r"line 2: expected a JSON object"),
    ],
)
def test_jsonl_loader_rejects_bad_rows(tmp_path: Path, line: str, match: str) -> None:
    path = _write_jsonl(tmp_path / "rows.jsonl", [_row("q", "#### 1"), line])
    with pytest.raises(ValueError, match=match):
        load_gsm8k_jsonl(path)


def test_jsonl_loader_empty_and_missing(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty dataset"):
        load_gsm8k_jsonl(empty)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*synthetic"):
        load_gsm8k_jsonl(tmp_path / "nope.jsonl")


# ------------------------------------------------------------------------------------ load_problems


def test_load_problems_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_problems("synthetic", n=5, seed=3) == synthetic_gsm(5, seed=3)
    assert len(load_problems()) > 0

    path = _write_jsonl(tmp_path / "mine.jsonl", [_row(f"q{i}", f"#### {i}") for i in range(4)])
    assert [p.answer for p in load_problems(str(path), n=2)] == ["0", "1"]
    assert len(load_problems(str(path), n=50)) == 4  # more than there is: take what there is

    # gsm8k-local: $CBKIT_GSM8K_DIR wins over the default locations.
    _write_jsonl(tmp_path / "test.jsonl", [_row("local q", "#### 9")])
    monkeypatch.setenv("CBKIT_GSM8K_DIR", str(tmp_path))
    assert load_problems("gsm8k-local") == [Problem("gsm8k-test-0", "local q", "9", "#### 9")]


def test_gsm8k_local_candidates_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBKIT_GSM8K_DIR", str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    assert gsm8k_local_candidates("train") == [
        tmp_path / "env" / "train.jsonl",
        tmp_path.parent / "shared/data/gsm8k/train.jsonl",
        Path(cbkit.tasks.data.__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl",
    ]
    monkeypatch.delenv("CBKIT_GSM8K_DIR")
    assert len(gsm8k_local_candidates()) == 2


def test_gsm8k_local_missing_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real shared copy may exist on this machine, so point every candidate at an empty folder.
    monkeypatch.setattr(cbkit.tasks.data, "gsm8k_local_candidates", lambda split: [tmp_path / f"{split}.jsonl"])
    with pytest.raises(FileNotFoundError, match=r"(?s)no train\.jsonl found.*CBKIT_GSM8K_DIR.*'synthetic'"):
        load_problems("gsm8k-local:train")


def test_gsm8k_hub_path_converts_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub code cannot download here; feed it an in-memory Dataset to check the conversion."""
    import datasets

    calls = []

    def fake_load_dataset(path: str, name: str, split: str) -> datasets.Dataset:
        calls.append((path, name, split))
        rows = [{"question": f"q{i}", "answer": f"work\n#### {i},000"} for i in range(5)]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    problems = load_problems("gsm8k:train", n=3)
    assert calls == [("openai/gsm8k", "main", "train")]
    assert [(p.id, p.answer) for p in problems] == [
        ("gsm8k-train-0", "0"),
        ("gsm8k-train-1", "1000"),
        ("gsm8k-train-2", "2000"),
    ]
    assert load_problems("gsm8k")[0].id == "gsm8k-test-0"

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"(?s)ConnectionError: no network.*'synthetic'"):
        load_problems("gsm8k")


@pytest.mark.parametrize("source", ["gsm9k", "gsm8k:validation", "synthetic:3", "data.csv", ""])
def test_load_problems_unknown_form_lists_accepted(source: str) -> None:
    with pytest.raises(ValueError, match="accepted forms") as info:
        load_problems(source)
    for form in ("'synthetic'", "'gsm8k:train'", "'gsm8k-local'", ".jsonl"):
        assert form in str(info.value)


@pytest.mark.parametrize("n", [0, -1])
def test_load_problems_rejects_n_below_one(n: int) -> None:
    with pytest.raises(ValueError, match=f"n={n}"):
        load_problems("synthetic", n=n)


def test_gsm8k_local_reads_the_shared_copy_when_present() -> None:
    shared = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl"
    if not shared.is_file() and not os.environ.get("CBKIT_GSM8K_DIR"):
        pytest.skip("no local GSM8K copy")
    problems = load_problems("gsm8k-local")
    assert len(problems) == 1319
    assert problems[0].id == "gsm8k-test-0" and problems[0].answer == "18"
    assert all(re.fullmatch(r"-?\d+", p.answer) for p in problems)
    assert all(extract_answer(p.solution or "") == p.answer for p in problems)


# -------------------------------------------------------------------------------------- synthetic

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _arith(expr: str) -> float:
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected expression {expr!r}")

    return ev(ast.parse(expr, mode="eval").body)


def test_synthetic_is_deterministic_per_seed() -> None:
    assert synthetic_gsm(50, seed=7) == synthetic_gsm(50, seed=7)
    assert synthetic_gsm(50, seed=7)[:20] == synthetic_gsm(20, seed=7)  # n extends, never reshuffles
    a, b = synthetic_gsm(50, seed=0), synthetic_gsm(50, seed=1)
    assert sum(p.question != q.question for p, q in zip(a, b, strict=True)) > 40
    assert len({p.id for p in a + b}) == 100


def test_synthetic_answers_are_recomputable() -> None:
    """Every `<<expr=value>>` step re-evaluates to its value, and the last one is the answer."""
    for p in synthetic_gsm(300, seed=11):
        assert re.fullmatch(r"\d+", p.answer), p
        assert p.solution is not None and p.solution.endswith(f"#### {p.answer}")
        steps = re.findall(r"<<([^=<>]+)=(\d+)>>", p.solution)
        assert 1 <= len(steps) <= 6, p
        for expr, value in steps:
            assert _arith(expr) == int(value), (p.id, expr, value)
        assert steps[-1][1] == p.answer


def test_synthetic_varies_length_and_kind() -> None:
    problems = synthetic_gsm(200)
    words = [len(p.question.split()) for p in problems]
    assert max(words) >= 2 * min(words)
    assert min(words) >= 10 and max(words) <= 100
    step_counts = {p.solution.count("<<") for p in problems if p.solution}
    assert {1, 2, 3, 4, 5} <= step_counts
    assert len({p.question.rsplit(". ", 1)[-1] for p in problems}) > 50  # many distinct final questions


def test_synthetic_rejects_n_below_one() -> None:
    with pytest.raises(ValueError, match="n=0"):
        synthetic_gsm(0)


# ------------------------------------------------------------------------------------------- chat


def test_chat_prompt_ids(byte_tokenizer) -> None:
    problem = synthetic_gsm(1)[0]
    ids = chat_prompt_ids(byte_tokenizer, problem)
    assert isinstance(ids, list) and ids and all(type(t) is int for t in ids)
    text = byte_tokenizer.decode(ids)
    assert SYSTEM_PROMPT in text and problem.question in text
    assert text.index(SYSTEM_PROMPT) < text.index(problem.question)
    assert text.endswith("<|im_start|>assistant\n")
    assert chat_prompt_ids(byte_tokenizer, problem.question) == ids

    no_system = byte_tokenizer.decode(chat_prompt_ids(byte_tokenizer, "What is 2+2?", system_prompt=None))
    assert no_system == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_chat_prompt_ids_without_template() -> None:
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt_ids(NoTemplate(), "What is 2+2?")
