"""The committed notebooks: stripped of outputs, kernelspec python3, shaped the way STYLE.md asks (title and
what/runtime/hardware, one setup cell, one parameters cell, markdown before every code cell, Summary, graded
Exercises and Questions, no long cells), and listed in the README with a working Colab badge. Running them is nbmake's job
(`make test` executes every notebook at CI sizes)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tests.helpers import NOTEBOOK_STEMS, PLOTLY_JSON, browser, drawn_figures

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
EXPECTED = NOTEBOOK_STEMS
MAX_CELL_LINES = 15


def repository_url() -> str:
    # pyproject's [project.urls] Repository (a regex: tomllib is 3.11+, cbkit supports 3.10)
    match = re.search(r'^Repository\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert match, "pyproject.toml: [project.urls] needs Repository = \"https://github.com/...\""
    return match.group(1).rstrip("/")


def test_every_notebook_is_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.stem)
def nb(request):
    return request.param, nbformat.read(request.param, as_version=4)


def test_committed_without_outputs_and_with_the_python3_kernel(nb):
    path, book = nb
    nbformat.validate(book)
    assert book.metadata["kernelspec"]["name"] == "python3", f"{path.name}: kernelspec must be python3"
    assert "widgets" not in book.metadata, f"{path.name}: widget state committed; run nbstripout"
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {i} carries outputs; run `nbstripout {path.relative_to(REPO)}` "
                "(make setup installs it as a git filter)")


def test_shape_title_setup_parameters_markdown_summary_exercises(nb):
    path, book = nb
    cells = book.cells
    title = cells[0].source
    assert cells[0].cell_type == "markdown" and title.startswith("# ")
    for part in ("What you will see", "Runtime", "Hardware"):
        assert part in title, f"{path.name}: the opening cell must say {part!r}"
    code = [c for c in cells if c.cell_type == "code"]
    setup = [c for c in code if f'env = setup("{path.stem}")' in c.source]
    assert len(setup) == 1 and setup[0] is code[0], f"{path.name}: one setup cell, first"
    assert "pip" in setup[0].source and "google.colab" in setup[0].source
    params = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("## Parameters")]
    assert len(params) == 1 and cells[params[0] + 1].cell_type == "code", f"{path.name}: one parameters cell"
    assert "env.sizes" in cells[params[0] + 1].source, f"{path.name}: sizes from cbkit.teach.tiers (env.sizes)"
    for i, cell in enumerate(cells):
        if cell.cell_type == "code":
            assert cells[i - 1].cell_type == "markdown", f"{path.name}: cell {i} has no markdown before it"
            lines = len(cell.source.splitlines())
            assert lines <= MAX_CELL_LINES, (
                f"{path.name} cell {i} has {lines} lines: split it where a markdown line can say what the next "
                "part computes")
    # The end: a Summary, graded Exercises (a stub, then its check: tests/test_exercises.py), then the open Questions.
    ends = [[i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith(heading)]
            for heading in ("## Summary", "## Exercises", "## Questions")]
    assert all(len(found) == 1 for found in ends), f"{path.name}: one Summary, one Exercises, one Questions: {ends}"
    summary, exercises, questions = (found[0] for found in ends)
    assert summary < exercises < questions == len(cells) - 1, f"{path.name}: Summary, Exercises, Questions, in order"
    graded = [c.source for c in cells[exercises:questions] if c.cell_type == "code"]
    assert any("raise NotImplementedError" in c for c in graded), f"{path.name}: no exercise stub"
    assert any("from cbkit.teach.exercises import check_" in c for c in graded), f"{path.name}: no exercise check"


def test_colab_install_points_at_the_repository_without_the_notebooks_extra(nb):
    # Colab's notebook server needs jupyter_client < 8; the [notebooks] extra asks for >= 8 (pyproject.toml).
    path, book = nb
    assert f'"cbkit @ git+{repository_url()}"' in book.cells[2].source, (
        f"{path.name}: the setup cell must install cbkit, no extra, from pyproject's Repository "
        "(`make publish-address` writes the address)")


def test_colab_asks_for_a_gpu_and_restarts_after_replacing_a_package(nb):
    path, book = nb
    assert book.metadata.get("accelerator") == "GPU", f"{path.name}: metadata must request a GPU runtime"
    assert "colab" in book.metadata and book.metadata["colab"].get("gpuType"), path.name
    assert "restart_if_replaced()" in book.cells[2].source, f"{path.name}: the install must handle Colab's restart"


def test_notebook_text_links_instead_of_repository_paths(nb):
    # A pip-installed kit has no docs/ or cbkit/*.py next to the notebook: cite them as links to the repository.
    path, book = nb
    bare = re.compile(r"(?<![\[/])`((?:docs|cbkit|scripts)/[\w/.-]+\.(?:py|md|sh))`(?!\])")
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "markdown":
            found = bare.findall(cell.source)
            assert not found, f"{path.name} cell {i}: link {found} to {repository_url()}/blob/main/..."


def test_readme_lists_every_notebook_with_a_colab_badge():
    readme = (REPO / "README.md").read_text()
    slug = repository_url().removeprefix("https://github.com/")
    for stem in EXPECTED:
        badge = f"https://colab.research.google.com/github/{slug}/blob/main/notebooks/{stem}.ipynb"
        assert badge in readme, f"README: no Colab badge for {stem}"
    row = re.compile(r"^\|.*\[`?(\d\d_[a-z_]+)`?\]", re.M)
    assert sorted(set(row.findall(readme))) == EXPECTED


def test_git_strips_notebook_outputs():
    attributes = (REPO / ".gitattributes").read_text()
    assert re.search(r"^\*\.ipynb\s+filter=nbstripout", attributes, re.M)
    assert "nbstripout --install" in (REPO / "Makefile").read_text()


# --- the executed notebooks, as a learner sees them ---------------------------------------------------------------
# `make test-notebooks` executes every notebook into runs/notebooks/ and then runs the test below with
# CBKIT_EXECUTED_NOTEBOOKS=runs/notebooks: each executed notebook is rendered to HTML by nbconvert (what nbviewer
# and a CI artefact show) and opened offline in headless Chromium, and every figure must have drawn. Screenshots
# are kept next to the notebooks. Without the variable (plain `pytest`) there is nothing executed to look at.

EXECUTED_ENV = "CBKIT_EXECUTED_NOTEBOOKS"


def _executed() -> list[Path]:
    import os

    folder = os.environ.get(EXECUTED_ENV)
    return sorted(Path(folder).glob("*.ipynb")) if folder else []


def _figure_outputs(book) -> list[dict]:
    return [out for cell in book.cells if cell.cell_type == "code" for out in cell.outputs
            if out.get("output_type") in ("display_data", "execute_result") and PLOTLY_JSON in out.get("data", {})]


@pytest.mark.parametrize("path", _executed(), ids=lambda p: p.stem)
def test_executed_notebook_draws_every_figure_in_a_browser(path):
    from nbconvert import HTMLExporter

    book = nbformat.read(path, as_version=4)
    unrun = [i for i, c in enumerate(book.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"{path.name}: cells {unrun} never ran; run `make test-notebooks` first"
    figures = _figure_outputs(book)
    for out in figures:
        assert "text/html" in out.data, f"{path.name}: a figure saved only as plotly JSON, which nbconvert, " \
            "GitHub and nbviewer do not draw (cbkit.teach.notebook.setup() embeds plotly.js and adds HTML)"
    remote = re.findall(r"<script[^>]*\ssrc=[\\]?[\"']?(https?://[^\"'\s>\\]+)", nbformat.writes(book))
    assert not remote, f"{path.name}: outputs load scripts from the network (blank offline): {sorted(set(remote))}"
    library = [out for c in book.cells if c.cell_type == "code" for out in c.outputs
               if "plotly.js v" in str(out.get("data", {}).get("text/html", ""))[:2000]]
    assert len(library) == 1, f"{path.name}: plotly.js embedded {len(library)} times, want once"
    for cell in book.cells:
        for out in cell.get("outputs", []):
            text = str(out.get("data", {}).get("text/plain", "")) + str(out.get("text", ""))
            assert not re.search(r"(?<!\d)0%\|", text), f"{path.name}: a progress bar saved at 0%: {text[:120]}"
    html_path = path.with_suffix(".html")
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(book)
    html_path.write_text(body, encoding="utf-8")
    total, drawn = drawn_figures(browser(html_path.resolve().as_uri(), "--dump-dom"))
    assert (total, drawn) == (len(figures), len(figures)), (
        f"{path.name}: {len(figures)} figure outputs, {total} plotly figures in the HTML, {drawn} drew")
    # Full-page screenshot for the CI artefact: tall enough for every figure (plus the text around them).
    height = 1200 + sum(int(o.data[PLOTLY_JSON].get("layout", {}).get("height") or 525) + 120 for o in figures) \
        + 18 * sum(len(c.source.splitlines()) + 4 for c in book.cells)
    browser(html_path.resolve().as_uri(), f"--screenshot={path.with_suffix('.png').resolve()}",
             f"--window-size=1280,{min(height, 30000)}")
    assert path.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize("path", _executed(), ids=lambda p: p.stem)
def test_executed_notebook_recorded_its_kernels_time_and_peak_rss(path):
    """`make test-notebooks` has each kernel write its wall time and peak RSS beside it (scripts/notebook_resources.py);
    a kernel that imported torch and loaded a model holds far more than 200 MiB, and it ran within nbmake's 300 s."""
    import json

    record = path.with_name(f"{path.stem}.resources.json")
    assert record.is_file(), f"{path.name}: its kernel wrote no {record.name} (scripts/notebook_resources.py mark)"
    rec = json.loads(record.read_text())
    assert rec["notebook"] == path.stem and 0 < rec["seconds"] <= 300 + 60, rec
    assert rec["peak_rss_bytes"] > 200 * 2**20, rec


# --- phenomenon guards: what the text relies on, still there at CI size -------------------------------------------
# Each notebook records, as it runs, the measured numbers its text relies on (cbkit.teach.notebook.record_phenomena,
# a JSON output). The guards below read them back from the executed notebook and fail, naming the phenomenon,
# when one has disappeared: a change of sizes, engine or model that makes 01's pool fit everything, 03's CB fall
# behind, or 00's rewards all zero, fails here instead of leaving text that describes what the run no longer shows.
# The thresholds are the guards' own, never the notebooks'.

from cbkit.teach.notebook import PHENOMENA_MIME  # noqa: E402

# stem -> [(what the text says, check over the recorded values, what would hide it: an edit to the recorded
# numbers that the phenomenon's disappearing gives, e.g. a `fixed` workload's zero padding)]
GUARDS = {
    "00_quickstart": [
        ("some completion earns a reward", lambda v: v["reward_mean"] > 0, {"reward_mean": 0.0}),
        ("the update has a nonzero gradient", lambda v: v["grad_norm"] > 0 and v["changed_share"] > 0,
         {"grad_norm": 0.0, "changed_share": 0.0}),
    ],
    "01_kv_slot_recycling": [
        ("the static batch pads (padding share clearly above zero)", lambda v: v["static_padding_share"] >= 0.05,
         {"static_padding_share": 0.0}),
        ("requests wait (the pool or the read budget runs out)", lambda v: v["waits"] >= 1, {"waits": 0}),
        ("a group's requests share their prompt's pages", lambda v: v["sharing_share"] > 0.02, {"sharing_share": 0.0}),
        ("the engine hands a released block to another request", lambda v: v["engine_block_reuses"] >= 1,
         {"engine_block_reuses": 0}),
    ],
    "02_logprob_correctness": [
        # Max over the rollout's tokens: 1.6e-5 in one clean-clone CI run and 4.4e-4 in the next, same commit (the
        # mean 2.6e-6 against 4.8e-5); a bf16 rollout's is ~0.16. The guard sits between the two regimes.
        ("fp32 sampling and teacher-forced logprobs agree within 1e-3 nats", lambda v: v["fp32_max_abs_diff"] <= 1e-3,
         {"fp32_max_abs_diff": 3e-3}),
        ("the bf16 rollout is measurably off-policy (10x fp32's gap or more)",
         lambda v: v["bf16_max_abs_diff"] >= 10 * max(v["fp32_max_abs_diff"], 1e-7), {"bf16_max_abs_diff": 2e-5}),
        ("the IS weights change the update", lambda v: v["gradient_cosine"] < 1 - 1e-6
         or abs(v["gradient_norm_ratio"] - 1) > 1e-6, {"gradient_cosine": 1.0, "gradient_norm_ratio": 1.0}),
        ("stock TRL's CB rollout carries no logprobs", lambda v: v["stock_trl_logprobs_missing"] is True,
         {"stock_trl_logprobs_missing": False}),
    ],
    "03_n_sweep": [
        # The three sources of CB's win, each with something to act on at CI size (the split's rollout).
        ("CB with prefix sharing prefills under half the tokens generate() does",
         lambda v: 2 * v["cb_prefill_tokens"] < v["generate_prefill_tokens"], {"cb_prefill_tokens": 10**6}),
        ("the replayed workload pads a static batch", lambda v: v["replay_padding_share"] >= 0.05,
         {"replay_padding_share": 0.0}),
        ("the engine hands a finished completion's block to another request", lambda v: v["engine_block_reuses"] >= 1,
         {"engine_block_reuses": 0}),
    ],
    "04_grpo_live": [
        ("both runs earn some reward", lambda v: v["continuous_reward_max"] > 0 and v["generate_reward_max"] > 0,
         {"continuous_reward_max": 0.0}),
        ("both runs have nonzero gradients", lambda v: v["continuous_grad_norm_max"] > 0
         and v["generate_grad_norm_max"] > 0, {"generate_grad_norm_max": 0.0}),
        # At CI size a dozen steps of a random model on the lowercase reward: the chart's trend (slopes +0.045 and
        # +0.041 a step in one run of this notebook).
        ("each run's reward rises over its steps", lambda v: v["continuous_reward_slope"] > 0
         and v["generate_reward_slope"] > 0, {"continuous_reward_slope": -0.001}),
    ],
    "05_off_policy": [
        ("rollouts one update stale drift measurably from the current policy",
         lambda v: v["drift_at_1"] > 10 * max(v["drift_at_0"], 1e-7), {"drift_at_1": 1e-7}),
        ("the IS correction changes the update", lambda v: v["weights_apart"] > 0, {"weights_apart": 0.0}),
        ("the runs with and without the correction roll out from different weights",
         lambda v: v["rollouts_differ_from_step"] > 0, {"rollouts_differ_from_step": 0}),
        ("the runs with and without the correction earn different rewards at some step",
         lambda v: v["rewards_differ_at"] > 0, {"rewards_differ_at": 0}),
        ("an async completion straddles an optimizer update", lambda v: v["straddling_frac"] > 0,
         {"straddling_frac": 0.0}),
        ("the drift metric catches stale prefix KV", lambda v: v["stale_kv_gap"] > 10 * max(v["fixed_kv_gap"], 1e-7),
         {"stale_kv_gap": 0.0}),
        ("stale KV's logprobs are the old-prompt-pages mix's, to kernel noise (10x a correct engine's gap)",
         lambda v: v["stale_mix_gap"] < 10 * max(v["fixed_kv_gap"], 1e-7), {"stale_mix_gap": 1e-2}),
    ],
}


def recorded_phenomena(book) -> dict:
    """Every value the notebook recorded (later outputs win on a repeated name)."""
    values: dict = {}
    for cell in book.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            values.update(out.get("data", {}).get(PHENOMENA_MIME, {}))
    return values


def guard_failures(stem: str, book) -> list[str]:
    values = recorded_phenomena(book)
    failures = []
    for claim, holds, _ in GUARDS[stem]:
        try:
            ok = holds(values)
        except KeyError as missing:
            failures.append(f"{claim}: the notebook recorded no {missing} (record_phenomena in its cells)")
            continue
        if not ok:
            failures.append(f"{claim}: not at CI size; recorded {values}")
    return failures


@pytest.mark.parametrize("path", _executed(), ids=lambda p: p.stem)
def test_executed_notebook_still_shows_the_phenomena_its_text_relies_on(path):
    failures = guard_failures(path.stem, nbformat.read(path, as_version=4))
    assert not failures, f"{path.name}: " + "; ".join(failures)


def _hide(book, edit: dict):
    """The executed notebook, edited so its recorded numbers are those of a run without the phenomenon."""
    import copy

    book = copy.deepcopy(book)
    for cell in book.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = out.get("data", {}).get(PHENOMENA_MIME)
            if data is not None:
                data.update({k: v for k, v in edit.items() if k in data})
    return book


@pytest.mark.parametrize("path", _executed(), ids=lambda p: p.stem)
def test_executed_notebook_guards_fail_when_the_phenomenon_is_hidden(path, tmp_path):
    """Each guard, on a copy of the executed notebook edited to hide its phenomenon (written and read back as a
    file, as the guard reads a notebook), fails, and names that phenomenon; the other guards still pass."""
    book = nbformat.read(path, as_version=4)
    assert not guard_failures(path.stem, book)
    for claim, _, edit in GUARDS[path.stem]:
        hidden = tmp_path / path.name
        nbformat.write(_hide(book, edit), hidden)
        failures = guard_failures(path.stem, nbformat.read(hidden, as_version=4))
        assert [f.split(":")[0] for f in failures] == [claim], (claim, failures)


def names_read(holds) -> set[str]:
    """Every recorded name a guard's check reads: run it on values that send each `and` / `or` both ways."""
    names: set[str] = set()

    class Reads(dict):
        def __init__(self, value: float):
            super().__init__()
            self.value = value

        def __missing__(self, key):
            names.add(key)
            return self.value

    for value in (0.0, 1.0):
        holds(Reads(value))
    return names


def _calls(source: str) -> list[str]:
    """The text of every `record_phenomena(...)` call in a cell, up to its closing parenthesis."""
    calls = []
    for start in (m.end() for m in re.finditer(r"record_phenomena\(", source)):
        depth, end = 1, start
        while depth and end < len(source):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        calls.append(source[start:end])
    return calls


def recording(cells: list[str], name: str) -> str | None:
    """What in the code cells records `name`: a `record_phenomena(name=...)` keyword or `"name"` key, or a key
    composed as f"{label}_{rest}" in the call, with "rest" quoted in the call and "label" quoted in its cell
    (04: f"{label}_{what}" over its runs' labels). None: nothing records it."""
    for cell in cells:
        for call in _calls(cell):
            if re.search(rf"\b{name}\s*=(?!=)", call) or f'"{name}"' in call:
                return name
            parts = name.split("_")
            for i in range(1, len(parts)):
                label, rest = "_".join(parts[:i]), "_".join(parts[i:])
                if "{" in call and f'"{rest}"' in call and f'"{label}"' in cell:
                    return rest
    return None


def unrecorded(path: Path) -> list[str]:
    """The names some guard of this notebook reads that none of its record_phenomena calls records."""
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return sorted({n for _, holds, _ in GUARDS[path.stem] for n in names_read(holds) if recording(cells, n) is None})


def test_every_notebook_records_what_its_guards_read():
    """The committed notebooks call record_phenomena with every name their guards read (so a guard never
    silently reads nothing), and every notebook has guards."""
    assert sorted(GUARDS) == EXPECTED
    for path in NOTEBOOKS:
        assert all(names_read(holds) for _, holds, _ in GUARDS[path.stem]), path.name
        assert not unrecorded(path), f"{path.name}: nothing records {unrecorded(path)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_recording_check_fails_on_a_notebook_that_stops_recording_a_name(path, tmp_path):
    """The defect the check above names, made in a copy (written and read back as a file): each name a guard reads,
    renamed where the notebook records it, is reported as unrecorded."""
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    for name in sorted({n for _, holds, _ in GUARDS[path.stem] for n in names_read(holds)}):
        token = recording(cells, name)
        broken = nbformat.read(path, as_version=4)
        for cell in broken.cells:
            if cell.cell_type == "code" and "record_phenomena(" in cell.source:
                cell.source = re.sub(rf"\b{token}\b", f"{token}_renamed", cell.source)
        nbformat.write(broken, tmp_path / path.name)
        missing = unrecorded(tmp_path / path.name)
        assert name in missing, (name, token, missing)


# --- teaching defects that must not come back (issue 19) ----------------------------------------------------------

TYPED_CLAIMS = ["should be ~1e-5", "agree to ~1e-5", "stays a flat line at 1", "train the same way.",
                "most telling on a GPU", "past some N it uses *less*"]


def _sources(stem: str, kind: str | None = None) -> list[str]:
    book = nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4)
    return [c.source for c in book.cells if kind is None or c.cell_type == kind]


def test_no_result_is_typed_before_the_run():
    """A sentence about this run's result is printed from it or asked as a question, never typed ahead."""
    for stem in EXPECTED:
        text = "\n".join(_sources(stem))
        found = [claim for claim in TYPED_CLAIMS if claim in text]
        assert not found, f"{stem}: typed claims {found}; print them from the run or ask the question"


def test_01_shows_no_speed_it_is_a_memory_lesson_on_a_patched_cpu_engine():
    code = "\n".join(_sources("01_kv_slot_recycling", "code"))
    assert "wall_s" not in code and "tokens_per_s" not in code and "faster" not in code


def test_03_splits_the_win_in_its_own_cells_and_exercises_rest_on_true_premises():
    code = "\n".join(_sources("03_n_sweep", "code"))
    # The split is computed in the notebook from the engine's trace, the memory plan by the planner: no package prose.
    assert "record_engine_steps" in code and ".reuses()" in code and "plan(" in code
    assert "cbkit.teach.why_cb" not in code and "cbkit.measure.advise" not in code and "teach.findings" not in code
    exercises = _sources("03_n_sweep", "markdown")[-1]
    # Under replayed lengths EOS is ignored (temperature cannot shorten them) and lengths scale with the limit.
    assert "temperature=0.7" not in exercises and "Completions get shorter" not in exercises
    assert "scaled to the limit" in exercises


# --- sections a session may skip ---------------------------------------------------------------------------------


def _bound_and_read(source: str) -> tuple[set[str], set[str]]:
    """Names a cell binds (assignments, imports, defs, loop targets) and names it reads, by its syntax tree."""
    import ast

    bound, read = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound, read


def test_what_follows_a_skippable_section_reads_nothing_only_it_defines():
    """The sections docs/workshop.md shows from the book (scripts/skip_sections.py's SKIPPABLE) are taken out, and
    no later cell may read a name that only they bind; `make test-notebooks` also runs those copies."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from skip_sections import SKIPPABLE, without_sections

    guide = (REPO / "docs" / "workshop.md").read_text()
    for stem, headings in SKIPPABLE.items():
        full = nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4)
        kept = without_sections(nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4), headings)
        kept_ids = {c.id for c in kept.cells}
        only_skipped = set().union(*(_bound_and_read(c.source)[0] for c in full.cells
                                     if c.cell_type == "code" and c.id not in kept_ids))
        only_skipped -= set().union(*(_bound_and_read(c.source)[0] for c in kept.cells if c.cell_type == "code"))
        for cell in kept.cells:
            if cell.cell_type == "code":
                missing = _bound_and_read(cell.source)[1] & only_skipped
                assert not missing, f"{stem} cell {cell.id} reads {sorted(missing)}, bound only in {headings}"
        assert f"`{stem}`" in guide


# --- the Questions' edits ----------------------------------------------------------------------------------------


def test_every_question_edit_applies_says_what_the_question_says_and_compiles():
    """scripts/question_edits.py holds each Question's code edit; `make test-questions` runs them. Here, cheaply: the
    edit still applies to exactly one place, the Question's text names it, and every code cell of the edited notebook
    compiles (a keyword given twice, as 03's second Question once asked for, is a SyntaxError)."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from question_edits import EDITS, apply

    assert sorted(EDITS) == EXPECTED
    for stem, edits in EDITS.items():
        book = nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4)
        items = dict(re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |\Z)", book.cells[-1].source, re.M | re.S))
        for edit in edits:
            text = " ".join(items[str(edit.question)].split())
            assert edit.said in text, f"{stem} question {edit.question} does not say {edit.said}: {text}"
            edited = apply(nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4), edit)
            for cell in edited.cells:
                if cell.cell_type == "code":
                    compile(cell.source, f"{stem} question {edit.question}, cell {cell.id}", "exec")


def test_05_says_its_drift_sentences_when_a_gap_is_exactly_zero(capsys):
    """05 prints the staleness-0 noise and divides by a correct engine's gap; either can be exactly 0 (identical
    kernels), and then the cells must still print their lines, not raise ZeroDivisionError."""
    from types import SimpleNamespace

    from cbkit.teach.notebook import record_phenomena

    book = nbformat.read(REPO / "notebooks" / "05_off_policy.ipynb", as_version=4)
    drift = next(c.source for c in book.cells if c.cell_type == "code" and "gap = {k: step_mean" in c.source)
    stale = next(c.source for c in book.cells if c.cell_type == "code" and "stale_gap, fixed_gap" in c.source)
    rows = {k: SimpleNamespace(rows=[{"offpolicy/logprob_mean_abs_diff": 0.1 * k, "offpolicy/kl": 0.0,
                                      "offpolicy/ratio_std": 0.0, "offpolicy/staleness_max": k}])
            for k in (0, 1, 2, 4)}
    exec(drift, {"runs": rows})
    exec(stale, {"record_phenomena": record_phenomena, "gaps": {name: {"new": new, "old": 1.0, "old prompt pages": 0.0}
                          for name, new in (("stale KV", 1.3), ("fixed", 0.0))}})
    out = capsys.readouterr().out
    assert "k=0: 0.00e+00" in out and "(exactly 0)" in out


def test_02s_update_is_linear_in_the_weights_and_blind_to_a_zero_advantage():
    """02's `update(*weights)` cell, run on the tiny model: GRPO's gradient at ratio 1 is sum_i A_i w_i grad log p_i,
    the batch's loss differentiated at once; so doubling every weight doubles it, a completion whose advantage is 0
    changes nothing whatever its weight, and zeroing the weight of one with a nonzero advantage turns it. The
    model's gradients are left cleared."""
    import torch

    from cbkit.train.logprobs import chunked_logits
    from cbkit.train.objective import policy_logprobs
    from tests.helpers import PROBLEMS, config, trainer

    book = nbformat.read(REPO / "notebooks" / "02_logprob_correctness.ipynb", as_version=4)
    cell = next(c.source for c in book.cells if c.cell_type == "code" and "def update(*weights)" in c.source)
    tr = trainer(config(use_transformers_continuous_batching=True))
    rollout = tr.rollout([0, 1], 0).rollout
    kept = tr.prepare(rollout, tr.score(rollout, PROBLEMS[:2])[0])
    n = len(kept.loss_mask)
    advantages = torch.arange(n, dtype=torch.float32) - n // 2  # A = 0 at n // 2
    space = {"model": tr.model, "kept": kept, "config": tr.config, "torch": torch, "advantages": advantages}
    exec(cell, space)
    ones = torch.ones(n)
    blind, turned = ones.clone(), ones.clone()
    blind[n // 2], turned[0] = 5.0, 0.0
    sums = space["update"](ones, 2 * ones, blind, turned)  # each a tensor per parameter
    g, doubled, same, other = (torch.cat([t.flatten() for t in total]) for total in sums)
    for rows, mb, logits in chunked_logits(tr.model, kept.batch, None):  # every row in one forward and backward
        logps = policy_logprobs(logits, mb.completion_ids, tr.config.temperature)
        mask = kept.loss_mask[rows, :mb.completion_width]
        (-(logps * advantages[rows, None] * mask).sum() / kept.loss_mask.sum()).backward()
    whole = torch.cat([p.grad.flatten() for p in tr.model.parameters() if p.requires_grad])
    tr.model.zero_grad(set_to_none=True)
    assert g.norm() > 0 and (g - whole).norm() <= 1e-4 * whole.norm()  # padding moves the floats, no more
    assert torch.allclose(doubled, 2 * g, rtol=1e-5, atol=1e-9) and torch.allclose(same, g, rtol=1e-5, atol=1e-9)
    assert float(other @ g / (other.norm() * g.norm())) < 1 - 1e-4
    assert all(p.grad is None for p in tr.model.parameters())
