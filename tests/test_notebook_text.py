"""The notebooks' prose as a learner reads it: short cells, words defined before they are used, one word per measure,
the runtime said once, the objective written once with real metric names, and an answer for every Question.

Each check reads the committed notebooks and docs; the independent side is upstream's or the kit's own code (TRL's
GRPOConfig fields and logged metric keys, cbkit's config fields and the metric keys its source writes)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import nbformat
import pytest

from tests.helpers import NOTEBOOK_STEMS

REPO = Path(__file__).resolve().parents[1]
MAX_MARKDOWN_LINES = 15


def _markdown(stem: str) -> list[str]:
    book = nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4)
    return [c.source for c in book.cells if c.cell_type == "markdown"]


def _reading_order() -> list[tuple[str, int, str]]:
    """Every markdown cell in the order a learner meets them: 00 first, each notebook top to bottom."""
    return [(stem, i, src) for stem in NOTEBOOK_STEMS for i, src in enumerate(_markdown(stem))]


# --- length -------------------------------------------------------------------------------------------------------


def long_cells(stem_sources: dict[str, list[str]], limit: int = MAX_MARKDOWN_LINES) -> list[str]:
    return [f"{stem} markdown cell {i}: {len(src.splitlines())} lines"
            for stem, sources in stem_sources.items() for i, src in enumerate(sources) if len(src.splitlines()) > limit]


def test_no_markdown_cell_runs_over_15_lines():
    found = long_cells({stem: _markdown(stem) for stem in NOTEBOOK_STEMS})
    assert not found, f"split or cut these (one point per cell, ~15 lines at most): {found}"


def test_the_length_check_counts_lines_of_the_source():
    assert long_cells({"x": ["a\n" * 15, "b\n" * 16]}) == ["x markdown cell 1: 16 lines"]


# --- the runtime block, once ---------------------------------------------------------------------------------------

# Sentences of the runtime block every notebook used to repeat: they belong to the guide alone.
RUNTIME_BLOCK = ("have not been timed. On a GPU the setup cell of each notebook prints that notebook's memory plan",)
GUIDE_ANCHOR = "docs/workshop.md#per-notebook-time-what-to-run-live-what-to-expect"


def _normalised(text: str) -> str:
    return " ".join(text.split())


def test_the_runtime_block_is_written_once_in_the_guide():
    places = {f"notebooks/{stem}.ipynb": _normalised("\n".join(_markdown(stem))) for stem in NOTEBOOK_STEMS}
    places.update({str(p.relative_to(REPO)): _normalised(p.read_text()) for p in (REPO / "docs").glob("*.md")})
    places["README.md"] = _normalised((REPO / "README.md").read_text())
    for sentence in RUNTIME_BLOCK:
        where = [name for name, text in places.items() if sentence in text]
        assert where == ["docs/workshop.md"], f"{sentence!r} is in {where}: keep it in docs/workshop.md only"


def test_each_notebook_links_the_guides_runtime_table_and_the_anchor_exists():
    guide = (REPO / "docs" / "workshop.md").read_text()
    headings = [line.lstrip("#").strip() for line in guide.splitlines() if line.startswith("## ")]
    # GitHub's and myst's slug: lower case, punctuation dropped, spaces to hyphens.
    slugs = {re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", h.lower())) for h in headings}
    assert GUIDE_ANCHOR.split("#")[1] in slugs, f"no heading of docs/workshop.md makes #{GUIDE_ANCHOR.split('#')[1]}"
    for stem in NOTEBOOK_STEMS:
        title = _markdown(stem)[0]
        assert "**Runtime" in title and GUIDE_ANCHOR in title, f"{stem}: the title's runtime line links {GUIDE_ANCHOR}"


# --- words defined before they are used ----------------------------------------------------------------------------

# term (as it appears, case-insensitive) -> what its defining sentence contains
DEFINED = {
    r"teacher-forc": r"to \*teacher-force\* a completion is",
    r"clipped ratio": r"\*clipped ratio\* is PPO's",
    r"GSM8K": r"GSM8K[^.]{0,20}grade-school",
}


@pytest.mark.parametrize("term", sorted(DEFINED))
def test_a_term_is_defined_where_a_learner_first_meets_it(term):
    first = next(((stem, i, src) for stem, i, src in _reading_order() if re.search(term, src, re.I)), None)
    assert first is not None, f"{term!r} is in no notebook"
    stem, i, src = first
    assert re.search(DEFINED[term], src, re.I), f"{term!r} first appears in {stem} markdown cell {i}, undefined there"


def test_paged_attention_and_chunked_prefill_are_defined_before_01_uses_them():
    (terms,) = [src for src in _markdown("01_kv_slot_recycling") if src.startswith("## Terms")]
    assert "**block table**" in terms and "**paged attention**" in terms
    assert "chunk of the prompt" in terms and "**chunked prefill**" in terms


def test_padding_share_always_says_which_share():
    """01 and 03 count two shares: of all the static batch's KV token slots (`kv_padding_share`, section 1's title)
    and of its decode slots only (`decode_padding_share`, the `pad` column). The text names each, never just one."""
    for stem in ("01_kv_slot_recycling", "03_n_sweep"):
        for i, src in enumerate(_markdown(stem)):
            bare = re.findall(r"(?<!KV )(?<!decode )padding share", _normalised(src))
            assert not bare, f"{stem} markdown cell {i}: say 'KV padding share' or 'decode padding share'"


# --- the objective, written once, with real names ------------------------------------------------------------------

OBJECTIVE = REPO / "docs" / "objective.md"
TRL = Path(__import__("trl").__file__).parent / "trainer"


def _cbkit_source() -> str:
    return "\n".join(p.read_text() for p in (REPO / "cbkit").rglob("*.py"))


def test_the_objective_names_every_is_and_clip_metric_the_objective_code_logs():
    page = OBJECTIVE.read_text()
    logged = set(re.findall(r'"((?:is|train)/[\w/]+)"', (REPO / "cbkit" / "train" / "objective.py").read_text()))
    assert {"is/clipped_frac", "train/clip_ratio/low_mean"} <= logged  # the regex still finds them
    missing = sorted(k for k in logged if f"`{k}`" not in page)
    assert not missing, f"docs/objective.md does not name {missing}"


def test_every_metric_the_objective_or_an_answer_names_is_one_the_kit_writes():
    from scripts.build_book import ANSWERS

    source = _cbkit_source()
    texts = [OBJECTIVE.read_text()] + [a for answers in ANSWERS.values() for a in answers]
    named = {m for text in texts
             for m in re.findall(r"`((?:reward|completion|rollout|logprob|is|train|offpolicy)/\w+(?:/\w+)?)`", text)}
    assert "is/skipped" in named
    invented = sorted(m for m in named if f'"{m}"' not in source)
    assert not invented, f"metric names nothing in cbkit/ writes: {invented}"


def test_the_objectives_config_table_uses_real_cbkit_and_trl_field_names():
    from trl import GRPOConfig

    from cbkit.train.config import CBGRPOConfig

    rows = [line for line in OBJECTIVE.read_text().splitlines() if "vllm_importance_sampling" in line]
    assert len(rows) == 4
    ours = {f.name for f in dataclasses.fields(CBGRPOConfig)}
    theirs = {f.name for f in dataclasses.fields(GRPOConfig)}
    for row in rows:
        cbkit_name, trl_name = re.findall(r"`(\w+)`", row)[:2]
        assert cbkit_name in ours and trl_name in theirs, row
    trainer = (TRL / "grpo_trainer.py").read_text()
    for key in re.findall(r"`((?:clip_ratio|sampling)/[\w/]+)`", OBJECTIVE.read_text()):
        assert f'"{key}"' in trainer, f"docs/objective.md gives TRL's metric {key!r}, which TRL 1.16 does not log"


def test_the_notebooks_link_the_objective():
    linked = [stem for stem in NOTEBOOK_STEMS if any("docs/objective.md" in src for src in _markdown(stem))]
    assert "00_quickstart" in linked and "02_logprob_correctness" in linked, linked


# --- the answer key ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", NOTEBOOK_STEMS)
def test_every_question_has_an_answer(stem):
    from scripts.build_book import ANSWERS

    questions = _markdown(stem)[-1]
    assert questions.startswith("## Questions")
    asked = re.findall(r"^(\d+)\. ", questions, re.M)
    assert len(ANSWERS[stem]) == len(asked), f"{stem}: {len(asked)} Questions, {len(ANSWERS[stem])} answers"


def test_the_solutions_edition_puts_the_answer_key_under_the_questions_and_refuses_a_missing_answer(monkeypatch):
    from scripts import build_book as book

    edition = book.with_solutions(nbformat.read(REPO / "notebooks" / "04_grpo_live.ipynb", as_version=4), "04_grpo_live")
    sources = [c.source for c in edition.cells]
    at = next(i for i, s in enumerate(sources) if s.startswith("## Questions"))
    assert sources[at + 1].startswith("### Answer key") and "4. " in sources[at + 1]
    monkeypatch.setitem(book.ANSWERS, "04_grpo_live", book.ANSWERS["04_grpo_live"][:3])
    with pytest.raises(ValueError, match="4 Questions but 3 answers"):
        book.with_solutions(nbformat.read(REPO / "notebooks" / "04_grpo_live.ipynb", as_version=4), "04_grpo_live")
