"""Each notebook Question's code edit, applied, so CI runs it: a Question a learner cannot run as worded is a bug.

Every notebook ends with open Questions ("set N = 32: what changes?"). `EDITS` holds the edit each Question asks
for, as a text replacement in one code cell; tests/test_notebooks.py checks that each edit still applies, that its
words are the Question's, and that the edited notebook compiles (03's "add cb_config=..." beside an existing
`cb_config=POOL` was a SyntaxError). This script writes one copy per edit, cut after the cell the Question reads
(`until`), and `make test-questions` (part of `make test-more`, which CI runs) executes them at CI sizes, so the edit also runs: configs
validate, shapes fit. To keep that cheap, a copy keeps only the code cells the edited cell and the cell the Question
reads need: the setup cell, those two, and every earlier cell that binds a name a kept cell reads (by their syntax
trees). A cell that only draws or prints what nothing later reads is left out; the rest runs as in the notebook.

    python scripts/question_edits.py --out runs/notebooks-questions
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edit:
    question: int
    old: str  # the text in one code cell that the edit replaces (it must occur exactly once in the notebook)
    new: str
    said: str  # what the Question's text says, so its words and the edit cannot drift apart
    until: str = ""  # run up to the cell containing this (default: the edited cell)
    gpu_only: bool = False  # compiled in CI, not executed (the Question asks for a GPU)
    raises: bool = False  # the Question asks the learner to read the error the edited cell raises


EDITS = {
    "00_quickstart": [
        Edit(1, "N = S.n  # completions per prompt", "N = 32  # completions per prompt", "`N = 32`"),
        Edit(2, "temperature=1.0, learning_rate", "temperature=0.7, learning_rate", "`temperature=0.7`"),
        Edit(3, "transformers_continuous_batching_config=env.pool_config(policy.model),",
             'transformers_continuous_batching_config={**env.pool_config(policy.model), "return_logprobs": False},',
             '"return_logprobs": False', raises=True),
    ],
    "01_kv_slot_recycling": [
        Edit(1, 'cb_config={"page_size": PAGE_SIZE, "num_blocks": pool_blocks,',
             'cb_config={"page_size": PAGE_SIZE, "num_blocks": pool_blocks, "allow_block_sharing": False,',
             '"allow_block_sharing": False', until="print(f\"request-steps spent waiting"),
        Edit(2, "POOL_ROWS = 0.25", "POOL_ROWS = 1.0", "`POOL_ROWS = 1.0`", until="saved = {"),
        Edit(3, "TOKEN_BUDGET = 64", "TOKEN_BUDGET = 1024", "`TOKEN_BUDGET = 1024`", until="for s in trace.steps[:8]"),
    ],
    "02_logprob_correctness": [
        Edit(1, "TOP_P = 0.7", "TOP_P = 0.95", "`TOP_P = 0.95`", until="trl_seq = torch.stack("),
        Edit(2, "                      disable_tqdm=True)",
             '                      disable_tqdm=True, importance_sampling_mode="token_truncate")',
             '`importance_sampling_mode="token_truncate"`', until="seq_weight = kept.is_weights"),
        Edit(3, "copy.deepcopy(model).to(torch.bfloat16)", "copy.deepcopy(model).to(torch.float16)",
             "`.to(torch.float16)`", gpu_only=True),
        Edit(4, "                      disable_tqdm=True)", "                      disable_tqdm=True, clip_max=1.0)",
             "`clip_max=1.0`", until="shuffled vs none"),
    ],
    "03_n_sweep": [
        Edit(1, "MAX_NEW_TOKENS = S.max_new_tokens", "MAX_NEW_TOKENS = 2 * S.max_new_tokens", "`MAX_NEW_TOKENS`"),
        Edit(2, "max_new_tokens=MAX_NEW_TOKENS, dtype=env.rollout_dtype, cb_config=POOL)",
             'max_new_tokens=MAX_NEW_TOKENS, dtype=env.rollout_dtype, cb_config={**POOL, "max_batch_tokens": 512})',
             '`cb_config={**POOL, "max_batch_tokens": 512}`'),
        Edit(3, "WORKLOADS = S.workloads", 'WORKLOADS = [*S.workloads, "natural"]', '`"natural"`',
             until='cb.get("speed_vs_generate") is None'),
    ],
    "04_grpo_live": [
        Edit(1, "    transformers_continuous_batching_config=env.pool_config(policy.model),\n",
             "    transformers_continuous_batching_config=env.pool_config(policy.model),\n"
             "    importance_sampling_correction=False,\n", "`importance_sampling_correction=False`"),
        Edit(2, "S.prompts, S.n\n", "S.prompts, 16\n", "`N` to 16"),
        Edit(4, "TRACED_N = N ", "TRACED_N = 4 * N ", "`TRACED_N = 4 * N`"),
    ],
    "05_off_policy": [
        Edit(1, 'importance_sampling_mode="token_truncate"', 'importance_sampling_mode="sequence_mask"',
             '`importance_sampling_mode="sequence_mask"`', until="gap = {k: step_mean"),
        Edit(2, "CORRECTION_AT = 4 ", "CORRECTION_AT = 1 ", "`CORRECTION_AT = 1`", until="apart = distance(now, corrected)"),
        Edit(3, "async_rollouts=True, async_update_at=ASYNC_UPDATE_AT)",
             "async_rollouts=True, async_update_at=ASYNC_UPDATE_AT,\n"
             "                                            num_iterations=2, max_staleness=1)",
             "`num_iterations=2, max_staleness=1`"),
    ],
}


def code_cells(book) -> list:
    return [c for c in book.cells if c.cell_type == "code"]


def apply(book, edit: Edit):
    """`book` with `edit` applied (in place) and cut after the cell it runs up to; raises if it no longer applies."""
    hits = [c for c in code_cells(book) if edit.old in c.source]
    if len(hits) != 1 or hits[0].source.count(edit.old) != 1:
        raise ValueError(f"question {edit.question}: {edit.old!r} occurs {sum(c.source.count(edit.old) for c in hits)} "
                         "times in the notebook's code, not once: update scripts/question_edits.py")
    hits[0].source = hits[0].source.replace(edit.old, edit.new)
    if edit.raises:  # nbclient lets a cell tagged so raise, and fails the run if it does not
        hits[0].metadata.setdefault("tags", []).append("raises-exception")
    last = hits[0] if not edit.until else next((c for c in code_cells(book) if edit.until in c.source), None)
    if last is None:
        raise ValueError(f"question {edit.question}: no cell contains {edit.until!r}")
    book.cells = book.cells[: book.cells.index(last) + 1]
    return book


def names(source: str) -> tuple[set[str], set[str]] | None:
    """(names a cell binds, names it reads) by its syntax tree; None where it is not plain Python (a magic)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound, read


def only_what_it_needs(book, edit: Edit):
    """`apply`'s copy without the code cells that neither the edited cell nor the last one needs: kept are the setup
    cell, those two, and (walking back) every cell binding a name a kept cell reads; every cell that is not plain
    Python is kept too. Markdown stays, so the copy still reads as the notebook."""
    code = code_cells(book)
    targets = {id(code[0]), id(code[-1])} | {id(c) for c in code if edit.new in c.source}
    keep, needed = set(), set()
    for cell in reversed(code):
        found = names(cell.source)
        if id(cell) in targets or found is None or found[0] & needed:
            keep.add(id(cell))
            needed |= found[1] if found else set()
    book.cells = [c for c in book.cells if c.cell_type != "code" or id(c) in keep]
    return book


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, edits in EDITS.items():
        for edit in edits:
            if edit.gpu_only:
                continue
            book = only_what_it_needs(apply(nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4), edit), edit)
            # One folder per copy: a notebook writes its results under runs/ beside itself, and two copies of one
            # sweep with different settings must not share (or resume) one results file.
            folder = args.out / f"{stem}-q{edit.question}"
            folder.mkdir(exist_ok=True)
            nbformat.write(book, folder / f"{stem}-q{edit.question}.ipynb")
            print(f"question_edits: {stem} question {edit.question}, {len(code_cells(book))} code cells")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
