from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from cbkit.tasks.rewards import (
    DEFAULT_REWARDS,
    compute_rewards,
    correctness_reward,
    extract_answer,
    format_reward,
    normalize_number,
    numbers_equal,
    resolve_rewards,
)

GSM8K_TEST_ROWS = 1319


def _gsm8k_test_file() -> Path | None:
    candidates = []
    if os.environ.get("CBKIT_GSM8K_DIR"):
        candidates.append(Path(os.environ["CBKIT_GSM8K_DIR"]) / "test.jsonl")
    candidates.append(Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl")
    return next((c for c in candidates if c.is_file()), None)


def test_extract_answer_reads_every_gsm8k_test_gold() -> None:
    """The extractor must agree with a plain regex on the gold line of all 1319 GSM8K test rows."""
    path = _gsm8k_test_file()
    if path is None:
        pytest.skip("GSM8K test.jsonl not found (set CBKIT_GSM8K_DIR or put it in ../shared/data/gsm8k)")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == GSM8K_TEST_ROWS
    mismatches = []
    for i, row in enumerate(rows):
        m = re.search(r"####\s*(-?[\d,]+(?:\.\d+)?)\s*$", row["answer"])
        assert m is not None, f"row {i} has no '#### <number>' line"
        expected = m.group(1).replace(",", "")
        if extract_answer(row["answer"]) != expected:
            mismatches.append((i, expected, extract_answer(row["answer"])))
    assert not mismatches, mismatches[:10]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("72", "72"),
        ("72.00", "72"),
        ("1,234", "1234"),
        ("-3", "-3"),
        ("0.50", "0.5"),
        ("$18", "18"),
        (" +7. ", "7"),
        ("-0", "0"),
        ("007", "7"),
        (".5", "0.5"),
        ("**42**", "42"),
        ("5/", None),
        ("3/4", None),
        ("abc", None),
        ("", None),
        (".", None),
        (None, None),
    ],
)
def test_normalize_number(raw: str | None, expected: str | None) -> None:
    assert normalize_number(raw) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Reasoning...\n#### 72", "72"),
        ("#### $1,234", "1234"),
        ("It costs $5 each, so #### $18.", "18"),
        ("#### -3", "-3"),
        ("#### 2.50", "2.5"),
        ("#### **42**", "42"),
        ("first #### 1\nthen #### 2", "2"),
        ("#### Step 1: add\n2 + 3 = 5\n#### 5\n#### Step 2: check", "5"),
        ("#### - 3", "3"),
        ("The answer is $1,234.", "1234"),
        ("so the final answer is 12", "12"),
        ("Answer: **42**.", "42"),
        ("Q: what?\nA: 5", "5"),
        ("answer: 4, then note a: 6 and 9 more", "4"),  # lower-case "a:" is prose, not an answer
        ("She has 3 apples and buys 4 more, 7 in all.", "7"),
        ("16 - 3 - 4 = <<16-3-4=9>>9", "9"),
        ("The temperature drops to -3 degrees.", "-3"),
        ("We get 5-3 = 2", "2"),
        ("The answer is below.\nThere are 3 cats and 7 dogs", "7"),
        ("so it is \\boxed{12}. Check: 13", "12"),
        ("It costs $.50", "0.5"),
        ("no numbers here", None),
        ("", None),
        ("#### ", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("#### 5", True), ("x\n####-2", True), ("#### $1,000", True), ("#### five", False), ("5", False)],
)
def test_format_reward_pays_only_a_hash_line_with_a_number(text: str, expected: bool) -> None:
    assert (format_reward([text], ["5"])[0] > 0) is expected


def test_numbers_equal_uses_absolute_tolerance() -> None:
    assert numbers_equal("72.0000001", "72")
    assert not numbers_equal("72.001", "72")
    assert numbers_equal("1,234", "1234.00")
    assert not numbers_equal(None, "1")


def test_correctness_reward() -> None:
    completions = ["#### 72", "The answer is 72.", "#### 71", "no idea", "#### 72.0", "#### -3"]
    answers = ["72", "72", "72", "72", "72", "-3"]
    assert correctness_reward(completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_correctness_reward_rejects_non_numeric_gold() -> None:
    with pytest.raises(ValueError, match=r"gold answer 1 is 'seven'"):
        correctness_reward(["#### 1", "#### 7"], ["1", "seven"])


def test_format_reward_is_graded() -> None:
    completions = [
        "2 + 3 = 5\n#### 5",  # exactly the requested form
        "#### 5\n\n",  # trailing blank lines do not count as text
        "#### 5<|im_end|>",  # an undecoded special token is not the model's text
        "#### 5\nI hope this helps!",  # answered, then kept talking
        "#### 5 apples",  # the last line is not just a number
        "The answer is 5.",
        "####",
        "",
    ]
    assert format_reward(completions, ["5"] * len(completions)) == [1.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("fn", [correctness_reward, format_reward, compute_rewards])
def test_length_mismatch_names_both_lengths(fn) -> None:
    with pytest.raises(ValueError, match=r"3 completions but 2 answers"):
        fn(["#### 1", "#### 2", "#### 3"], ["1", "2"])


def test_empty_lists() -> None:
    assert correctness_reward([], []) == []
    assert format_reward([], []) == []


def test_metric_names() -> None:
    assert list(resolve_rewards([correctness_reward, format_reward])[0]) == ["correctness", "format"]
    assert list(resolve_rewards(list(DEFAULT_REWARDS.values()))[0]) == list(DEFAULT_REWARDS)
    assert list(compute_rewards(["#### 1"], ["1"])[1]) == ["reward/correctness", "reward/format"]


def test_compute_rewards_weights_and_breakdown() -> None:
    completions = ["#### 4", "The answer is 4", "#### 5\nmore", "nothing"]
    total, parts = compute_rewards(completions, ["4"] * 4)
    assert parts == {"reward/correctness": [1.0, 1.0, 0.0, 0.0], "reward/format": [1.0, 0.0, 0.5, 0.0]}
    assert total == [1.5, 1.0, 0.25, 0.0]
    # A right answer always beats a perfectly formatted wrong one.
    assert compute_rewards(["4", "#### 5"], ["4", "4"])[0] == [1.0, 0.5]

    total, _ = compute_rewards(completions, ["4"] * 4, {"format": format_reward})
    assert total == [1.0, 0.0, 0.5, 0.0]  # unlisted weights default to 1.0
    with pytest.raises(ValueError, match="unknown rewards"):
        compute_rewards(completions, ["4"] * 4, weights={"style": 1.0})


def test_format_reward_does_not_pay_for_a_stack_of_answer_lines():
    """What a SmolLM2 GRPO run learned to emit when the last line alone was checked."""
    from cbkit.tasks.rewards import format_reward

    gamed = "#### 9\nSofia is 9 years old.\n#### 9\n#### 9"
    assert format_reward([gamed, "Sofia is 9.\n#### 9"], ["9", "9"]) == [0.5, 1.0]


# --- the one combiner: used by the loop (cbkit.train.grpo), the TRL bridge and the demo -------------------------------


def test_resolve_rewards_names_and_weights() -> None:
    def length_reward(completions, answers):
        return [float(len(c)) for c in completions]

    # Built-ins by name get their default weights; callables get TRL's 1.0.
    assert resolve_rewards(["format"]) == ({"format": format_reward}, [0.5])
    assert resolve_rewards([length_reward, format_reward])[1] == [1.0, 1.0]
    assert list(resolve_rewards([length_reward])[0]) == ["length"]
    assert resolve_rewards({"a": length_reward, "b": format_reward}, {"b": 3.0})[1] == [1.0, 3.0]
    with pytest.raises(ValueError, match=r"Unknown reward function\(s\) \['length'\]"):
        resolve_rewards(["correctness", "length"])
    with pytest.raises(ValueError, match="Two reward functions are named 'format'"):
        resolve_rewards([format_reward, format_reward])
    with pytest.raises(ValueError, match="by name"):
        resolve_rewards([length_reward], {"length": 2.0})
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 reward functions"):
        resolve_rewards([length_reward, format_reward], [1.0])
    # A TRL reward model id stays a string when the names are not cbkit's.
    assert resolve_rewards(["org/rm"], names_are_builtin=False)[0] == {"org/rm": "org/rm"}


@pytest.mark.parametrize("value", [math.nan, -math.inf, "x"])
def test_combiner_refuses_a_bad_score_and_names_the_completion(value) -> None:
    def flaky_reward(completions, answers):
        return [0.0, 0.0, 0.0, value]

    with pytest.raises(ValueError, match=r"'flaky' returned .*completion 3 \(prompt 1, answer '8'\)"):
        compute_rewards(["a", "b", "c", "d"], ["7", "7", "8", "8"], [flaky_reward], num_generations=2)


def test_format_if_correct_pays_the_format_only_with_the_right_answer():
    from cbkit.tasks.rewards import format_if_correct_reward, format_reward

    texts = ["3 + 4 = 7\n#### 7", "#### 13", "7", "It is 7.\n#### 7 apples and more"]
    assert format_reward(texts, ["7"] * 4) == [1.0, 1.0, 0.0, 0.5]
    assert format_if_correct_reward(texts, ["7"] * 4) == [1.0, 0.0, 0.0, 0.5]
