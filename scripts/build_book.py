"""`make book`: the executed notebooks and the facilitator's guide as a static site, built offline.

Reads the notebooks `make test-notebooks` executed (runs/notebooks), adds a PNG of every figure to them
(`add_png_fallbacks`: what github.com's viewer shows, where plotly.js does not run), stages them with
docs/workshop.md, docs/objective.md and docs/book/ into one source folder laid out as the repository is (so the guide's links to
../notebooks/ work on GitHub and in the book alike), and runs Sphinx with myst-nb on it, without executing
anything again. The site's front page is <out>/index.html.

Beside it, the facilitators' solutions book (<out>-solutions/index.html): the same executed notebooks with each
exercise's stub replaced by the package's solution and each check's output by that check grading it
(`with_solutions`, which runs the checks only, offline, in seconds), and under each notebook's Questions the
facilitator's answer key (`ANSWERS`).

    python scripts/build_book.py [--notebooks runs/notebooks] [--out runs/book]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

try:  # scripts/solutions.py: scripts.solutions where this file is imported (the tests), a sibling where it runs
    from scripts import solutions
except ImportError:
    import solutions  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["00_quickstart", "01_kv_slot_recycling", "02_logprob_correctness", "03_n_sweep", "04_grpo_live", "05_off_policy"]


def executed_notebooks(folder: Path) -> list[Path]:
    import nbformat

    paths = [folder / f"{stem}.ipynb" for stem in NOTEBOOKS]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        sys.exit(f"build_book: {', '.join(missing)} not in {folder}: run `make test-notebooks` first (it executes "
                 "every notebook there), or give --notebooks a folder of executed notebooks.")
    for p in paths:
        book = nbformat.read(p, as_version=4)
        unrun = [i for i, c in enumerate(book.cells) if c.cell_type == "code" and c.execution_count is None]
        if unrun:
            sys.exit(f"build_book: {p} has cells {unrun} that never ran: run `make test-notebooks` again.")
    return paths


# Mime types only a live front end reads: plotly's JSON (JupyterLab draws it; the saved text/html draws
# everywhere else) and the phenomena the guards read (cbkit.teach.notebook.record_phenomena). Sphinx would warn
# on each, so the staged copy keeps the rest of every bundle: text/html, the PNG and text/plain.
FRONT_END_ONLY = ("application/vnd.plotly.v1+json", "application/vnd.cbkit.phenomena+json")


def add_png_fallbacks(path: Path) -> int:
    """Add an ``image/png`` (`cbkit.viz.figures.figure_pngs`) to every plotly figure output of an executed notebook
    that has none, in place; returns how many it drew."""
    import base64

    import nbformat

    from cbkit.viz.figures import figure_pngs

    book = nbformat.read(path, as_version=4)
    plotly_json = FRONT_END_ONLY[0]
    outputs = [out for cell in book.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
               if out.get("output_type") in ("display_data", "execute_result")
               and plotly_json in out.get("data", {}) and "image/png" not in out["data"]]
    figures = [{"data": list(fig.get("data", [])), "layout": dict(fig.get("layout", {}))}
               for fig in (out["data"][plotly_json] for out in outputs)]
    for out, png in zip(outputs, figure_pngs(figures), strict=True):
        out["data"]["image/png"] = base64.b64encode(png).decode("ascii")
    if outputs:
        nbformat.write(book, path)
    return len(outputs)


def stage_notebook(path: Path, dest: Path, solutions: bool = False) -> None:
    import nbformat

    book = nbformat.read(path, as_version=4)
    if solutions:
        with_solutions(book, path.stem)
    for cell in book.cells:
        for out in cell.get("outputs", []):
            for mime in FRONT_END_ONLY:
                out.get("data", {}).pop(mime, None)
    nbformat.write(book, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=REPO / "runs" / "notebooks")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "book")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    paths = executed_notebooks(args.notebooks)
    drawn = sum(add_png_fallbacks(p) for p in paths)
    print(f"build_book: {drawn} figures drawn as PNG fallbacks in {time.perf_counter() - start:.1f} s")
    rc = build(paths, args.out, solutions=False)
    if rc == 0:
        print(f"build_book: {args.out / 'index.html'} in {time.perf_counter() - start:.1f} s")
        solutions_out = args.out.with_name(args.out.name + "-solutions")
        rc = build(paths, solutions_out, solutions=True)
        if rc == 0:
            print(f"build_book: the solutions book, {solutions_out / 'index.html'}, in "
                  f"{time.perf_counter() - start:.1f} s")
    return rc


SOLUTIONS_NOTE = (
    "\n**The solutions edition**, for facilitators: each exercise's stub is replaced by its solution from "
    "`scripts/solutions.py`, and the check under it shows that check grading the solution. Learners "
    "get the other edition, where every stub is still to write.\n")


def build(paths: list[Path], out: Path, solutions: bool) -> int:
    """Stage the notebooks (the solutions edition when `solutions`) with the guide and run Sphinx into `out`."""
    from sphinx.cmd.build import build_main

    src = out.with_name(out.name + "-src")
    shutil.rmtree(src, ignore_errors=True)
    (src / "notebooks").mkdir(parents=True)
    (src / "docs").mkdir()
    shutil.copy(REPO / "docs" / "book" / "conf.py", src / "conf.py")
    index = (REPO / "docs" / "book" / "index.md").read_text()
    if solutions:
        title, rest = index.split("\n", 1)
        index = f"{title} (solutions)\n{SOLUTIONS_NOTE}{rest}"
    (src / "index.md").write_text(index)
    # The guide (where its numbers come from is lab/workshop-provenance.md, outside the book).
    shutil.copy(REPO / "docs" / "workshop.md", src / "docs" / "workshop.md")
    # The GRPO objective, written once (its formulas drawn as MathML by conf.py, offline); the notebooks link to it.
    shutil.copy(REPO / "docs" / "objective.md", src / "docs" / "objective.md")
    # The learning results (docs/learning.md): the figure of CB against generate() and the hacking lesson, with the
    # numbers scripts/learning_report.py printed from the runs.
    shutil.copy(REPO / "docs" / "learning.md", src / "docs" / "learning.md")
    shutil.copytree(REPO / "docs" / "learning", src / "docs" / "learning")
    for p in paths:
        stage_notebook(p, src / "notebooks" / p.name, solutions=solutions)
    shutil.rmtree(out, ignore_errors=True)
    # -W: a warning (a broken toctree, an output it cannot render) fails the build; -n: nitpicky off.
    return build_main(["-b", "html", "-q", "-W", "--keep-going", str(src), str(out)])


# --- the solutions edition -----------------------------------------------------------------------------------------

# The facilitator's answer key: ANSWERS[stem][i] answers Question i + 1 of that notebook. A Question asks the learner
# to edit a cell, rerun and explain what moved (scripts/question_edits.py holds each edit); an answer says what the
# edit shows and why, and what to compare before and after, never the number a rerun will print (that is the run's
# to say). tests/test_notebook_text.py checks that every Question has one and that every metric named is logged.
ANSWERS: dict[str, list[str]] = {
    "00_quickstart": [
        "With N = 2 a group has no spread whenever its two completions score the same, which is common; with N = 32 "
        "all 32 must tie. Compare `reward/zero_std_frac` (and the printed share of groups without spread): it should "
        "fall as N grows. `rollout/tokens_per_s` rises with N because each engine forward decodes more sequences for "
        "about the same fixed cost per step. A group whose rewards are all equal has every advantage r_i - mean = 0, "
        "so its policy term is 0 at every token: no gradient (docs/objective.md, section 1).",
        "Temperature divides the logits before sampling, so 0.7 sharpens the distribution: the N completions of a "
        "group look more alike, which pushes `reward/std` down (and `reward/zero_std_frac` up). "
        "`completion/mean_length` moves with whatever the model's most likely continuation does (stop early or run "
        "on), so read its direction from the two metrics tables rather than predicting it.",
        "The error comes from the engine config check (`cbkit.rollout.engine_config`): `return_logprobs=False` would "
        "drop the sampling logprobs, and with them the importance-sampling correction and the `logprob/*` check. "
        "cbkit refuses rather than silently running without them, which is what released TRL's CB path does.",
    ],
    "01_kv_slot_recycling": [
        "Without block sharing every completion holds its own copy of its prompt's pages and prefills its whole "
        "prompt itself, so each needs more blocks and more query tokens. Compare section 2's step count and the "
        "first steps' `past+query` (the completions now start from past 0), section 3b's peak blocks and its waiting "
        "count, which should shift towards the blocks. The toy still shares prompt pages, so its first difference "
        "with the engine comes at the completions' first step: the rule that differs is the prefix hash.",
        "With room for every row at full length the pool never runs short of blocks, so compare section 3b's waiting "
        "count: what waiting is left comes from the read budget, which grows with the pool (page_size x num_blocks) "
        "and so binds later too. In section 4 the engine's peak rises towards the useful tokens minus the prompt "
        "sharing: with everyone running at once, recycling has little to save. The pool printed in section 4 is "
        "the price: it grows with POOL_ROWS whether or not the run uses it.",
        "A budget larger than a prompt lets the helper prefill each prompt in one step instead of in chunks of 64 "
        "tokens, and lets several completions finish their prompts in the same step, so the first steps hold more "
        "tokens and the run takes fewer steps. Compare the printed first steps (no `P` chunk cut at 64) and the "
        "step counts of section 2. Memory does not move much: the budget limits tokens per step, not KV held.",
    ],
    "02_logprob_correctness": [
        "With top_p = 0.95 the nucleus drops at most 5% of the mass at each token, so each TRL-style token ratio "
        "p_full / p_nucleus is at least 0.95, closer to 1 than at 0.7. Per sequence the ratios still multiply, so "
        "compare the printed per-sequence median for TRL-style against the 0.7 run: it moves towards 1 but stays "
        "below it. Doubling `MAX_NEW_TOKENS` doubles the number of factors, so the per-sequence median falls again; "
        "cbkit's stays at about 1 in every case, because it compares under the distribution that was sampled.",
        "In `token_truncate` each token gets its own ratio, clamped at `clip_max`, never zeroed. Compare the table's "
        "`is/ratio_min` and `is/ratio_max` (now token ratios, close to 1 for a bf16 rollout, not products over a "
        "completion) and `is/clipped_frac` (now a share of tokens clamped, which a token ratio rarely reaches at 3). "
        "The masked-completions line reads 0: truncation clamps, it never masks. The histogram below it still draws "
        "the per-completion products, which this mode no longer uses.",
        "fp16 keeps 10 mantissa bits against bf16's 7, so each value is rounded about 8x more finely and the rollout's "
        "logprobs sit closer to the fp32 policy's: compare the printed max and mean |diff| and the spread of the ratio "
        "histogram for the two runs. The price is range: fp16's 5-bit exponent can overflow where bf16's 8 bits do not.",
        "With `clip_max=1` every completion the policy finds likelier than the sampler did gets weight 0, so the "
        "printed masked count rises to those completions (for a bf16 rollout, some of them). A weight of 0 takes a "
        "completion's term out of the update, so the IS update turns further from the unweighted one: compare the IS "
        "cosine with the first run's. The shuffled weights are the same weights, zeros included, put on other "
        "completions, so their cosines fall too: the comparison still asks whether the mismatch fell on the "
        "completions that carry the update, now with weights of a wider spread.",
    ],
    "03_n_sweep": [
        "The printed length CV and decode padding share stay where they were, since the replayed lengths scale with "
        "the limit. The completions double against the same prompts, so (a) prompt sharing is a smaller part of the "
        "win: the prefill tokens saved are the same, the decode around them doubles. (b) padding keeps its share of a "
        "longer decode, so its seconds grow with it. Each full-length completion needs more blocks, so the same pool "
        "holds fewer of them (the pool cell prints how many) and (c) recycling has more to do. Each decode step also "
        "reads a longer context, which weighs on both backends; compare the rest and the ms per step with the first run.",
        "`max_batch_tokens` caps the tokens one engine forward takes: decode tokens plus a prefill chunk. A prompt that "
        "no longer fits is prefilled over more steps (chunked prefill), and once the running rows alone pass 512 not "
        "all of them decode in every step. Compare CB's measured peak (smaller activations and logits per forward) and "
        "its speed multiple of generate() with the first sweep's, N by N.",
        "Under `natural` EOS decides the lengths. Compare the three workloads' printed length CV and decode padding "
        "share: a model that runs most completions to the limit (SmolLM2 here, as 01 showed) puts `natural` close to "
        "`fixed`, but at the full limit rather than the replay's mean. Then check whether CB's speed multiple sits where "
        "the padding would put it; the split in *Why CB wins* says how much of the win padding carried on the replay.",
    ],
    "04_grpo_live": [
        "No metric disappears: the loop still computes and logs the `is/*` ratios (they describe the rollout), but "
        "`is/skipped` reads 1 and no weight reaches the loss. On a bf16 GPU rollout the ratios are no longer near 1 "
        "(02's section 2 measures how far), and without the correction the update is the on-policy gradient taken "
        "on off-policy samples: biased by exactly the gap the ratios show (02's section 3 prints how much the "
        "correction changes the gradient).",
        "With 16 completions per prompt a group lacks spread only if all 16 tie, so `reward/zero_std_frac` falls; each "
        "engine forward decodes more sequences for about the same fixed cost, so rollout tokens/s rises, while the "
        "step as a whole takes longer (the loss forwards grow with the number of completions). Compare the two runs' "
        "rows in the side-by-side table.",
        "A hook is any object with the `StepHooks` methods; `on_rollout_end(rollout)` receives the rollout but no "
        "rewards, so decode each completion (`policy.tokenizer.decode(c.completion_ids, skip_special_tokens=True)`) "
        "and score it yourself (for instance with `cbkit.tasks.rewards.format_reward`), or keep the rollout and print "
        "in `on_step_end`. Pass it in `hooks=[...]` next to the live chart's hook.",
        "Both backends still take about one forward per generated position, each now carrying 4x the tokens (on a "
        "CPU cbkit sizes the pool to the workload, so all 4N x prompts requests run at once: the most requests in one "
        "step grows 4x). Read the milliseconds a step of each: if CB's grow less than generate()'s, part of the "
        "engine's extra work was a fixed cost per step that more rows now share, and CB's tokens/s moves toward "
        "generate()'s; if both grow alike, the extra work grows with the requests in a step (per-request scheduling, "
        "block tables, cbkit's varlen attention gathering each sequence's keys). On a shared 2-core machine two CI "
        "runs disagreed (CB at 0.47x generate()'s tokens/s at both N in one, 0.38x -> 0.67x in the other): run it a "
        "few times before you decide. What moves the ratio for certain is what this shape lacks: unequal lengths "
        "(padding), a pool smaller than the rollout (recycling), prompts of several pages (sharing), and a model "
        "whose forward outweighs the engine's work.",
    ],
    "05_off_policy": [
        "In a sequence mode a completion's ratio is the product of its token ratios, so its log is the sum of the "
        "token log-ratios: it spreads with the completion's length. Compare section 1's printed std of the IS ratios "
        "(`offpolicy/ratio_std`, now per completion, far wider) and section 2's `clipped` column (`is/clipped_frac`, "
        "now the share of completions above `clip_max`, masked to weight 0) at staleness 4 with the token-mode run. "
        "One far-off token, or a small drift repeated over many tokens, takes a whole completion out of the band.",
        "At staleness 1 the rollout is one update old, so the drift (section 1's line for k=1 against k=4) is smaller, "
        "the IS ratios sit nearer 1, and the correction reweighs each token less; but the rollouts come from weights "
        "the two runs' updates made from step 3 on, not step 6, so the table has more steps whose tokens differ. "
        "Compare the printed distance between the two runs' weights, the table's `clipped` column and the step from "
        "which the rollouts differ with the staleness-4 run: the smaller reweighting and the longer feedback pull the "
        "distance in opposite directions, and the run says which wins.",
        "With two optimizer updates per step, the rollout queued on version v is trained on at version v + 2: its "
        "tokens are two updates old, past `max_staleness=1`, so the default `stale_rollouts='regenerate'` samples it "
        "again on the current weights. `offpolicy/regenerated` reads 1 at those steps, and the step time includes a "
        "whole rollout again: the overlap bought nothing.",
        "The prefix cache keeps full pages of KV keyed by token ids. A longer shared system prompt fills more full "
        "pages, so more positions of the second rollout read KV written by the old weights: compare the stale row's "
        "`vs new` gap and the printed ratio to a correct engine's gap before and after.",
    ],
}



def answer_key(stem: str) -> str:
    """The markdown of `stem`'s answer key, one numbered answer per Question."""
    items = "\n".join(f"{i}. {text}" for i, text in enumerate(ANSWERS[stem], start=1))
    return ("### Answer key (facilitators)\n"
            "What each Question's edit shows and why, and what to compare in the rerun's output.\n\n" + items)


def answer(stub: str, name: str) -> str:
    """The solution to `name` (scripts/solutions.py) under the stub's docstring, which states the exercise once."""
    solution = inspect.getsource(getattr(solutions, name)).rstrip().splitlines()
    asked = next(n for n in ast.parse(stub).body if isinstance(n, ast.FunctionDef) and n.name == name).body[0]
    first = ast.parse("\n".join(solution)).body[0].body[0].lineno - 1  # the solution's first statement
    return "\n".join(solution[:first] + stub.splitlines()[asked.lineno - 1:asked.end_lineno] + solution[first:])


def with_solutions(book: Any, stem: str, *, seed: int = 1) -> Any:
    """`book` (an nbformat notebook of `stem`, executed or not) with, in place, each stub cell's source replaced by
    its solution (self-contained), each check cell's output by that check grading it now, and the answer
    key under the Questions. Nothing else is run again: the exercises never read the notebook's state.

    Raises when a stub or its check cell is missing, when a check refuses its solution, or when the Questions and
    the answer key do not number alike."""
    import nbformat

    from cbkit.teach.exercises import EXERCISES

    code = [cell for cell in book.cells if cell.cell_type == "code"]
    for name, check in EXERCISES[stem]:
        stubs = [i for i, cell in enumerate(code) if f"def {name}(" in cell.source]
        if len(stubs) != 1 or stubs[0] + 1 >= len(code) or check.__name__ not in code[stubs[0] + 1].source:
            raise ValueError(f"{stem}: expected one cell defining {name}() followed by a cell running {check.__name__}")
        stub, graded = code[stubs[0]], code[stubs[0] + 1]
        stub.source = answer(stub.source, name)
        stub.outputs = []
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = check(getattr(solutions, name), seed=seed)
        if not result.passed:
            raise AssertionError(f"{stem}: {check.__name__} refuses the solution: {result.message}")
        graded.outputs = [nbformat.v4.new_output("stream", name="stdout", text=out.getvalue())]
    questions = [i for i, cell in enumerate(book.cells)
                 if cell.cell_type == "markdown" and cell.source.startswith("## Questions")]
    if len(questions) != 1:
        raise ValueError(f"{stem}: expected one '## Questions' cell, found {len(questions)}")
    asked = len(re.findall(r"^\d+\. ", book.cells[questions[0]].source, re.M))
    if asked != len(ANSWERS[stem]):
        raise ValueError(f"{stem}: {asked} Questions but {len(ANSWERS[stem])} answers in ANSWERS "
                         "(scripts/build_book.py); write the missing answer")
    key = nbformat.v4.new_markdown_cell(answer_key(stem))
    key.id = "answer-key"
    book.cells.insert(questions[0] + 1, key)
    return book


if __name__ == "__main__":
    sys.exit(main())
