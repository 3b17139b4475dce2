"""The notebooks' exercises (cbkit.teach.exercises): every check accepts the facilitator's answer, answers a stub
with "not implemented yet", and refuses plausible wrong answers, each on the case that exposes it; no check ever
raises, whatever the learner's function does; every notebook asks its exercises with the solution's own signature
and docstring, and calls the right check."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import nbformat
import pytest
import torch

from cbkit.teach.exercises import EXERCISES, Result
from scripts import solutions

REPO = Path(__file__).resolve().parents[1]
ALL = [(stem, name, check) for stem, exs in EXERCISES.items() for name, check in exs]
SEEDS = (1, 7, 2024, 31337, 99991)


def _ids(item):
    return item[1]


@pytest.mark.parametrize("item", ALL, ids=_ids)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_solution_passes(item, seed, capsys):
    _, name, check = item
    result = check(getattr(solutions, name), seed=seed)
    assert isinstance(result, Result)
    assert result.passed and result.case is None, result.message
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("item", ALL, ids=_ids)
def test_a_stub_is_not_implemented_yet(item, capsys):
    _, name, check = item

    def stub(*args):
        raise NotImplementedError

    result = check(stub, seed=1)
    assert not result.passed and result.not_implemented and result.case is None
    out = capsys.readouterr().out
    assert "not implemented yet" in out and "Traceback" not in out


def _format_keeps_specials(text):
    import re

    lines = [line.strip() for line in text.splitlines() if line.strip()]
    answer = re.compile(r"####\s*-?\d")
    if lines and re.fullmatch(r"####\s*-?\d+", lines[-1]) and len(answer.findall(text)) == 1:
        return 1.0
    return 0.5 if answer.search(text) else 0.0


def _format_stack(text):
    import re

    lines = [line.strip() for line in re.sub(r"<\|im_end\|>\s*$", "", text).splitlines() if line.strip()]
    if lines and re.fullmatch(r"####\s*-?\d+", lines[-1]):
        return 1.0
    return 0.5 if re.search(r"####\s*-?\d", text) else 0.0


def _seq_mean(old, sampled, mask, clip_max):
    rho = torch.exp(((old - sampled) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    return torch.where(rho > clip_max, 0.0, rho)


def _seq_truncate(old, sampled, mask, clip_max):
    return torch.exp(((old - sampled) * mask).sum(-1)).clamp(max=clip_max)


def _seq_no_mask(old, sampled, mask, clip_max):
    rho = torch.exp((old - sampled).sum(-1))
    return torch.where(rho > clip_max, 0.0, rho)


def _kv(factor=2, kv_heads=True, window=True, layer_types=True):
    def fn(config, rows, prompt_len, max_new_tokens, dtype_bytes):
        heads = config.num_key_value_heads if kv_heads else config.num_attention_heads
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        length = prompt_len + max_new_tokens
        kinds = (config.layer_types if layer_types else None) or (
            ["sliding_attention" if config.sliding_window else "full_attention"] * config.num_hidden_layers)
        tokens = sum(min(length, config.sliding_window) if k == "sliding_attention" and window else length
                     for k in kinds)
        return rows * tokens * factor * heads * head_dim * dtype_bytes
    return fn


def _adv(unbiased=True, eps=1e-4, per_group_mean=True):
    def fn(rewards, n):
        g = rewards.view(-1, n)
        mean = g.mean(1, keepdim=True) if per_group_mean else rewards.mean()
        return ((g - mean) / (g.std(1, unbiased=unbiased, keepdim=True) + eps)).flatten()
    return fn


def _agg_grpo_token_mean(loss, mask, loss_type, max_len):
    if loss_type == "grpo":
        return ((loss * mask).sum() / mask.sum()).item()
    return solutions.aggregate_loss(loss, mask, loss_type, max_len)


def _agg_grpo_no_clamp(loss, mask, loss_type, max_len):
    if loss_type == "grpo":
        return ((loss * mask).sum(1) / mask.sum(1)).mean().item()
    return solutions.aggregate_loss(loss, mask, loss_type, max_len)


def _agg_dr_grpo_tokens(loss, mask, loss_type, max_len):
    return solutions.aggregate_loss(loss, mask, "bnpo" if loss_type == "dr_grpo" else loss_type, max_len)


def _agg_unmasked(loss, mask, loss_type, max_len):
    return solutions.aggregate_loss(loss, torch.ones_like(mask), loss_type, max_len)


def _step_no_read_budget(candidates, token_budget, read_budget, max_requests):
    """Forgets the engine's read budget: schedules whatever fits the tokens."""
    return solutions.schedule_step(candidates, token_budget, 10**9, max_requests)


def _step_no_chunks(candidates, token_budget, read_budget, max_requests):
    """Gives every request all it wants: no chunked prefill."""
    return solutions.schedule_step(candidates, 10**9, read_budget, max_requests)


def _step_stops_at_a_skip(candidates, token_budget, read_budget, max_requests):
    """Ends the step at the first request the read budget cannot pay, where the engine goes on to the next."""
    batch = []
    for request_id, past_len, wants, fits in candidates:
        if past_len > read_budget or not fits:
            break
        batch.append((request_id, min(wants, token_budget)))
        token_budget, read_budget = token_budget - batch[-1][1], read_budget - past_len
        if token_budget == 0 or read_budget <= 0 or len(batch) == max_requests:
            break
    return batch


# exercise -> [(a plausible wrong answer, the case that must expose it)]
WRONG = {
    "format_score": [
        (_format_stack, "a stack of answer lines"),  # never counted the answer lines
        (_format_keeps_specials, "a special token after the answer"),
        (lambda text: 1.0 if text.strip() and text.strip().splitlines()[-1].startswith("#### ")
         and text.count("####") == 1 else 0.5 if "####" in text else 0.0, "words after the number"),
    ],
    "padding_share": [
        (lambda p, c: 1 - sum(c) / (len(c) * max(c)), "prompts of different lengths"),  # decode padding only
        (lambda p, c: 1 - (sum(p) + sum(c)) / sum(max(p) + n for n in c), "one row finished after one token"),
    ],
    "schedule_step": [  # steps of the check's fixed recorded rollout
        (_step_no_read_budget, "engine step 7"),
        (_step_no_chunks, "engine step 0"),
        (_step_stops_at_a_skip, "engine step 31"),
    ],
    "token_is_weights": [
        (lambda o, s, m, c: torch.exp(o - s), "a clipped ratio"),  # forgot the clip
        (lambda o, s, m, c: torch.exp(s - o).clamp(max=c), "ratios close to 1"),  # the ratio upside down
    ],
    "sequence_mask_weights": [
        (_seq_mean, "ratios close to 1"),  # mean instead of sum
        (_seq_truncate, "a clipped ratio"),
        (_seq_no_mask, "ratios close to 1"),
    ],
    "static_kv_bytes": [
        (_kv(factor=1), "one row"),  # K only
        (_kv(kv_heads=False), "grouped-query attention"),
        (_kv(window=False), "a sliding window shorter than the rows"),
        (_kv(layer_types=False), "some layers slide, some do not"),
    ],
    "group_advantages": [
        (_adv(unbiased=False), "one group"),
        (_adv(eps=0.0), "a group of ties"),
        (_adv(per_group_mean=False), "a group of ties"),
    ],
    "aggregate_loss": [
        (_agg_grpo_token_mean, "'grpo', rows of different lengths"),
        (_agg_dr_grpo_tokens, "'dr_grpo', rows of different lengths"),
        (_agg_grpo_no_clamp, "'grpo' with a row of length 0"),
        (_agg_unmasked, "'grpo', rows of different lengths"),
    ],
    "fresh_groups": [
        (lambda gv, now, k: [i for i, g in enumerate(gv) if all(now - v < k for c in g for v in c)],
         "exactly max_staleness old"),  # < for <=
        (lambda gv, now, k: [i for i, g in enumerate(gv) if all(now - c[-1] <= k for c in g if c)],
         "one stale token in one completion"),  # looked at the last token only
        (lambda gv, now, k: [i for i, g in enumerate(gv) if all(now - c[0] <= k for c in g)],
         "a completion with no tokens"),  # indexes an empty completion
    ],
}


def test_every_exercise_has_a_wrong_answer():
    assert set(WRONG) == {name for _, name, _ in ALL}


@pytest.mark.parametrize("name,wrong,case", [(n, w, c) for n, ws in WRONG.items() for w, c in ws],
                         ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_wrong_answer_fails_on_the_case_that_exposes_it(name, wrong, case, seed, capsys):
    check = next(c for _, n, c in ALL if n == name)
    result = check(wrong, seed=seed)
    assert not result.passed and not result.not_implemented
    assert result.case == case, result.message
    out = capsys.readouterr().out
    assert f"'{case}'" in out and "expected" in out and "hint" in out and "Traceback" not in out


@pytest.mark.parametrize("item", ALL, ids=_ids)
@pytest.mark.parametrize("answer", [lambda *a: None, lambda *a: "0", lambda *a: torch.zeros(2, 3, 4),
                                    lambda *a: [], lambda *a: 1 / 0, lambda *a: float("nan")],
                         ids=["none", "text", "wrong-shape", "empty-list", "raises", "nan"])
def test_a_check_never_raises(item, answer, capsys):
    _, _, check = item
    result = check(answer, seed=3)
    assert not result.passed and result.case
    assert "FAIL" in capsys.readouterr().out


def test_without_a_seed_each_run_draws_new_cases(capsys):
    check = EXERCISES["05_off_policy"][0][1]
    seeds = {check(solutions.fresh_groups).message.split("seed ")[1].split(":")[0] for _ in range(4)}
    assert len(seeds) > 1


# --- the notebooks ask them -------------------------------------------------------------------------------------


def _stub_and_check(book, name):
    """The stub cell defining `name` and the check cell after it."""
    code = [c for c in book.cells if c.cell_type == "code"]
    stubs = [i for i, c in enumerate(code) if f"def {name}(" in c.source]
    assert len(stubs) == 1, f"no single cell defines {name}()"
    return code[stubs[0]], code[stubs[0] + 1]


def _docstring(source, name):
    return next(ast.get_docstring(n) for n in ast.parse(source).body if getattr(n, "name", None) == name)


@pytest.mark.parametrize("item", ALL, ids=_ids)
def test_the_notebook_asks_with_the_solutions_signature_and_states_it(item):
    stem, name, check = item
    book = nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4)
    stub, check_cell = _stub_and_check(book, name)
    tree = ast.parse(stub.source)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert defs, f"{stem}: the stub cell does not define {name}"
    solution = ast.parse(inspect.getsource(getattr(solutions, name))).body[0]
    assert ast.dump(defs[0].args) == ast.dump(solution.args), f"{stem}: {name}'s stub and solution signatures differ"
    assert ast.get_docstring(defs[0]), f"{stem}: {name}'s stub states the exercise in its docstring"
    body = [n for n in defs[0].body if not isinstance(n, ast.Expr)]
    assert len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])
    assert f"{check.__name__}({name})" in check_cell.source, f"{stem}: the cell after {name} must run {check.__name__}"
    assert "solutions" not in stub.source + check_cell.source, f"{stem}: a notebook never holds the solution"


@pytest.mark.parametrize("stem", list(EXERCISES))
def test_the_solutions_edition_answers_and_passes_every_exercise(stem):
    """What `make book` shows facilitators (scripts/build_book.py): each stub replaced by the solution's source under
    the stub's docstring, which runs on its own, and each check's output that check's PASS on it."""
    from scripts.build_book import with_solutions

    book = with_solutions(nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4), stem)
    assert "raise NotImplementedError" not in "\n".join(c.source for c in book.cells)
    for name, check in EXERCISES[stem]:
        answer, graded = _stub_and_check(book, name)
        scope: dict = {}
        exec(compile(answer.source, f"<{stem}: {name}>", "exec"), scope)  # self-contained, imports included
        assert check(scope[name], seed=11).passed
        asked, _ = _stub_and_check(nbformat.read(REPO / "notebooks" / f"{stem}.ipynb", as_version=4), name)
        assert _docstring(answer.source, name) == _docstring(asked.source, name)  # the exercise above its answer
        (out,) = graded.outputs
        assert out["text"].startswith(f"PASS  {name}: correct"), out["text"]


def test_the_guide_lists_every_exercise_and_every_notebook_in_both_agendas():
    import re

    guide = (REPO / "docs" / "workshop.md").read_text()
    for stem, name, _ in ALL:
        row = next((line for line in guide.splitlines() if f"`{name}`" in line and line.startswith("|")), "")
        assert f"`{stem}`" in row and re.search(r"\| \d+ \|", row), f"workshop.md: no row for {stem}'s {name} with minutes"
    words = {5: "Five", 6: "Six", 7: "Seven"}
    assert guide.split("\n\n")[1].startswith(f"{words[len(EXERCISES)]} notebooks"), "workshop.md miscounts the notebooks"
    agendas = guide.split("## Agendas")[1].split("\n## ")[0].split("**Half a day**")
    for agenda in agendas:
        for stem in EXERCISES:
            assert f"`{stem}`" in agenda, f"workshop.md: an agenda leaves out {stem}"


def test_the_setup_text_asks_for_the_torch_pyproject_requires():
    import re

    floor = re.search(r'"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        said = set(re.findall(r"torch>=([\d.]+)", nbformat.read(path, as_version=4).cells[1].source))
        assert said <= {floor}, f"{path.name} says torch>={said}, pyproject.toml asks for torch>={floor}"
