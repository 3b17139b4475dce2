"""Write the repository's address, pyproject.toml's `[project.urls] Repository`, into every copy of it.

The address cannot be read where it is needed: a notebook's Colab install runs before anything is cloned, a Colab
badge is a URL on GitHub's page, and a notebook's link to `docs/` or `cbkit/` must work for a learner who has only
the notebook (Colab, nbviewer). So the copies are written out, and this script keeps them one value: edit
pyproject.toml, then

    make publish-address          # or: python scripts/publish_address.py [--check]

A copy is any GitHub repository named in a tracked text file: `github.com/<owner>/<name>`, or Colab's, nbviewer's
or raw.githubusercontent's form of it. Every one that is not pyproject's address and not listed in THIRD_PARTY is
the old address, and there must be only one such: a second means a link to another project's repository (add it
to THIRD_PARTY) or a half-finished edit, and the script changes nothing. tests/test_publish_address.py fails while
any copy disagrees. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Other projects' repositories that a file links to on purpose, as "owner/name" (lower case): never rewritten.
THIRD_PARTY: frozenset[str] = frozenset({
    "googlecolab/backend-info",  # Colab's list of preinstalled packages (scripts/colab_dry_run.py)
})
# Files whose addresses are made-up examples, not copies (relative to the root).
EXAMPLES = frozenset({"tests/test_publish_address.py"})

_HOSTS = r"(?:(?:www\.)?github\.com|raw\.githubusercontent\.com|colab\.research\.google\.com/github|nbviewer\.org/github)"
# A name may contain dots but does not end with one (a sentence's full stop); a clone URL's ".git" is not part of it.
_SLUG = re.compile(r"(?<![\w.-])" + _HOSTS + r"/(?P<slug>[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9_.-]*[A-Za-z0-9_-])")
_REPOSITORY = re.compile(r'^Repository\s*=\s*"https://github\.com/([^/"]+/[^/"]+?)/?"', re.M)
_SKIP_DIRS = {".git", "runs", "node_modules", "__pycache__"}


@dataclass(frozen=True)
class Copy:
    path: Path
    line: int
    slug: str  # owner/name as written (".git" removed)


def repository(root: Path = ROOT) -> str:
    """pyproject's `[project.urls] Repository` as owner/name (a regex: tomllib is 3.11+, cbkit supports 3.10)."""
    match = _REPOSITORY.search((root / "pyproject.toml").read_text())
    if not match:
        raise SystemExit('pyproject.toml: [project.urls] needs Repository = "https://github.com/<owner>/<name>" '
                         "(Colab opens notebooks from GitHub only)")
    return _strip_git(match.group(1))


def _strip_git(slug: str) -> str:
    return slug[: -len(".git")] if slug.endswith(".git") else slug


def text_files(root: Path = ROOT) -> list[Path]:
    """The files git tracks or would (a git checkout), or every file outside build and run folders (an unpacked archive)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout
        paths = [root / p for p in listed.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in root.rglob("*")
                 if not any(part in _SKIP_DIRS or part.startswith(".venv") for part in p.relative_to(root).parts)]
    return [p for p in paths if p.is_file() and not p.is_symlink() and p.relative_to(root).as_posix() not in EXAMPLES]


def _read(path: Path) -> str | None:
    try:
        with path.open(encoding="utf-8", newline="") as f:  # newline="": write back exactly the line endings read
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None  # an image, a binary result


def copies(root: Path = ROOT, files: Iterable[Path] | None = None) -> list[Copy]:
    """Every GitHub repository named in the text files, with where."""
    out = []
    for path in text_files(root) if files is None else files:
        text = _read(path)
        if text is None:
            continue
        for match in _SLUG.finditer(text):
            out.append(Copy(path, text.count("\n", 0, match.start()) + 1, _strip_git(match.group("slug"))))
    return out


def stale(root: Path = ROOT, third_party: frozenset[str] = THIRD_PARTY) -> list[Copy]:
    """The copies that are neither pyproject's address nor another project's (GitHub names ignore case)."""
    keep = {repository(root).lower(), *third_party}
    return [c for c in copies(root) if c.slug.lower() not in keep]


def publish(root: Path = ROOT, third_party: frozenset[str] = THIRD_PARTY) -> list[Path]:
    """Rewrite every stale copy to pyproject's address; returns the files changed. Refuses (SystemExit, nothing
    written) when the stale copies name more than one repository."""
    old = stale(root, third_party)
    if not old:
        return []
    slugs = sorted({c.slug.lower() for c in old})
    if len(slugs) > 1:
        where = "\n".join(f"  {c.path.relative_to(root)}:{c.line}: {c.slug}" for c in old)
        raise SystemExit(f"Several repositories differ from pyproject's {repository(root)}: {', '.join(slugs)}.\n"
                         f"{where}\nA link to another project belongs in THIRD_PARTY (scripts/publish_address.py); "
                         "nothing was changed.")
    new = repository(root)
    changed = []
    for path in sorted({c.path for c in old}):
        text = _read(path)
        assert text is not None
        rewritten = _SLUG.sub(lambda m: _swap(m, slugs[0], new), text)
        if rewritten != text:
            with path.open("w", encoding="utf-8", newline="") as f:
                f.write(rewritten)
            changed.append(path)
    return changed


def _swap(match: re.Match[str], old: str, new: str) -> str:
    slug = _strip_git(match.group("slug"))
    if slug.lower() != old:
        return match.group(0)
    start = match.start("slug") - match.start()
    return match.group(0)[:start] + new + match.group(0)[start + len(slug):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list the copies that disagree; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        old = stale(ROOT, THIRD_PARTY)
        for c in old:
            print(f"{c.path.relative_to(ROOT)}:{c.line}: {c.slug} (pyproject: {repository(ROOT)})")
        if old:
            print("Run `make publish-address` to write pyproject's address into them.")
        return 1 if old else 0
    changed = publish(ROOT, THIRD_PARTY)
    for path in changed:
        print(f"wrote https://github.com/{repository(ROOT)} into {path.relative_to(ROOT)}")
    if not changed:
        print(f"every copy already says https://github.com/{repository(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
