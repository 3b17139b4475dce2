"""The README is the front door: it stays short, its links resolve, and its Python example runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_fits_a_five_minute_read_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 90
    links = re.findall(r"\]\(((?:docs|notebooks)/[^)#]+)(?:#([^)]+))?\)", text)
    assert links and all((README.parent / link).is_file() for link, _ in links), links
    # An anchor names a heading of its page (docs/ARCHITECTURE.md's reading order above all): renaming it fails here.
    for link, anchor in links:
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (README.parent / link).read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{link}#{anchor}: no such heading in {headings}"
    assert len(_python_blocks(text)) == 1


def test_the_two_commands_are_make_targets_and_ci_runs_the_test_one():
    """The README's two commands, and the order .ci/run keeps: set-up, then the README's test command, then the
    rest of CI (`make test-more`), each a target of the Makefile."""
    (block,) = re.findall(r"## Two commands.*?```bash\n(.*?)```", README.read_text(), flags=re.S)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make setup", "make test"]
    makefile = (README.parent / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, flags=re.M))
    assert {"setup", "test", "test-more"} <= targets
    steps = re.findall(r"^step (\S+)$", (README.parent / ".ci" / "run").read_text(), flags=re.M)
    assert steps[0] == "setup" and steps.index("test") < steps.index("test-more") and set(steps) <= targets, steps


@pytest.mark.real_model
def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    """The example as a newcomer pastes it, in an empty folder (it must write nothing into the checkout)."""
    monkeypatch.chdir(tmp_path)
    (code,) = _python_blocks(README.read_text())
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.splitlines()
    tokens, per_s = re.fullmatch(r"(\d+) tokens, (\d+) tokens/s", out[0]).groups()
    assert 0 < int(tokens) <= 2 * 4 * 32 and int(per_s) > 0
    assert "'reward/mean'" in out[-1] and "'train/loss'" in out[-1]


def test_the_reading_order_names_real_ranges_in_at_most_eight_files_and_1000_lines():
    """docs/ARCHITECTURE.md's "Read one step in this order": every file exists, every range lies inside its file and
    starts and ends where the text is (not on a blank line), at most 8 code files, at most 1,000 lines with the
    README's example, and the rows name where the sampling logprobs are kept (asked for, then cut into completions)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Read one step in this order", 1)[1].split("\nThe folders are the layers.", 1)[0]
    rows = re.findall(r"^\| \d \| `(cbkit/[^`]+)`: ([\d\-, ]+) \|", section, flags=re.M)
    assert rows, "no file: lines rows found"
    files = {path for path, _ in rows}
    assert len(files) <= 8, files
    total = 13  # the README's example
    for path, ranges in rows:
        lines = (ROOT / path).read_text().splitlines()
        for part in ranges.split(","):
            start, stop = (int(x) for x in part.strip().split("-"))
            assert 1 <= start <= stop <= len(lines), (path, part, len(lines))
            assert lines[start - 1].strip() and lines[stop - 1].strip(), (path, part, "starts or ends on a blank line")
            total += stop - start + 1
    assert total <= 1000, total
    assert {"return_logprobs", "to_completions"} <= set(re.findall(r"\w+", section)), "where logprobs are kept"
    stated = re.search(r"About ([\d,]+) lines", section)
    assert stated and abs(int(stated.group(1).replace(",", "")) - total) <= 50, (stated, total)
