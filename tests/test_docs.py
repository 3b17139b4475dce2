"""docs/ is the user's documentation: small enough to read, and about the kit, not the machine it was written on.

How a number was found (timing logs, CPU results, probes) lives in lab/; docs/CHANGELOG.md is the release log and is
not counted."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "CHANGELOG.md")
# A path that names a machine: a home, a mount or a scratch folder, not one of the repository's own paths.
MACHINE_PATH = re.compile(r"(?<![\w./~-])/(?:work|root|home|Users|mnt|tmp|private)/")


def test_the_package_pages_stay_within_1500_lines():
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines()) for p in PAGES}
    assert "docs/workshop.md" in lines and "docs/ARCHITECTURE.md" in lines  # the glob still finds the pages
    assert sum(lines.values()) <= 1500, f"docs/ holds {sum(lines.values())} lines: {lines}"


def test_no_page_names_a_machine_path():
    assert MACHINE_PATH.search("see /work/cbkit/docs") and not MACHINE_PATH.search("cbkit/measure/workload.py")
    found = [(p.relative_to(ROOT).as_posix(), m.group(0)) for p in PAGES
             for m in MACHINE_PATH.finditer(p.read_text(encoding="utf-8"))]
    assert not found, f"machine paths in docs/: {found}"
