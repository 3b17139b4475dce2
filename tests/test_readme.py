"""The README is the front door: it stays short, its links resolve, and its Python example runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_fits_a_five_minute_read_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(((?:docs|notebooks)/[^)#]+)\)", text)
    assert links and all((README.parent / link).is_file() for link in links), links
    assert len(_python_blocks(text)) == 1


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
