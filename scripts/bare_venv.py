"""Make a venv that holds torch, transformers and what they require, and nothing else: a GPU machine
with no network (no trl, plotly, datasets, gguf, widgets, psutil). `make test-bare` runs the bare-path tests in it.

    python scripts/bare_venv.py .venv-bare            # link from the running venv (~2 s)
    python scripts/bare_venv.py .venv-bare --from-index   # pip install torch==2.13.0 transformers (slow)

Why link by default. `pip install torch==2.13.0 transformers` into a fresh venv took 78 s and 141 s on the
2-core CI machine (with the pip cache warm; it unpacks 1.2 GB), more than the whole bare-path check may
cost. The same files are already installed in the venv running this script. So the default makes a fresh
venv and symlinks into it exactly the distributions pip would install: torch, transformers and the closure
of their requirements read from their own metadata (no extras), each with its .dist-info, so `pip list`
in the new venv shows those and only those. Anything else imported there fails with ModuleNotFoundError,
which is what the tests rely on. cbkit is then installed with `pip install --no-deps -e .`, as a user would.
Never pip-install, upgrade or uninstall anything else in a linked venv: its packages are the source venv's
files, and pip would change them there (`make test-bare` deletes and rebuilds it each time; rm -rf removes
the links, not what they point to).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from packaging.requirements import Requirement

# pytest too: the GPU image has it (its package list, /work/.library/device/KINDS.md in this workplace), and the GPU
# script (scripts/gpu_check.sh) runs the gpu-marked tests with it.
ROOTS = ("torch", "transformers", "pytest")
TORCH_PIN = "torch==2.13.0"


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...] = ROOTS) -> dict[str, md.Distribution]:
    """The distributions pip installs for ``roots``: each root and, recursively, its unconditional
    requirements (markers evaluated for this interpreter, no extras)."""
    found: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _key(name) in found:
            continue
        dist = md.distribution(name)
        found[_key(name)] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def top_level_entries(dist: md.Distribution) -> set[str]:
    """The names a distribution puts directly into site-packages (packages, modules, .pth, .dist-info)."""
    names = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if parts and parts[0] != ".." and parts[0] != "__pycache__":
            names.add(parts[0])
    return names


def link_bare(dest: Path) -> list[str]:
    here = Path(sysconfig.get_paths()["purelib"])
    dists = closure((*ROOTS, "pip"))
    entries: dict[str, str] = {}
    for key, dist in sorted(dists.items()):
        for name in top_level_entries(dist):
            if name in entries and entries[name] != key:
                # A directory two distributions share (a namespace package) would carry the other's files too.
                raise SystemExit(f"{name} is shared by {entries[name]} and {key}; use --from-index")
            entries[name] = key
    site = Path(venv_site(dest))
    for name in sorted(entries):
        target = here / name
        if target.exists():
            (site / name).symlink_to(target)
    return sorted(dists)


def venv_site(dest: Path) -> str:
    out = subprocess.run([str(dest / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--from-index", action="store_true",
                        help=f"pip install {TORCH_PIN} transformers instead of linking the running venv's copies")
    args = parser.parse_args()
    dest: Path = args.dest
    if dest.exists():
        raise SystemExit(f"{dest} exists; remove it first (make clean-bare)")
    # The user's `pip install --no-deps -e .` runs in it, as on the GPU machine: pip is linked too (ensurepip
    # would take seconds), or installed by ensurepip when installing from the index.
    venv.create(dest, with_pip=args.from_index, symlinks=True)
    if args.from_index:
        pip = [str(dest / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, TORCH_PIN, "transformers"], check=True)
        print(f"{dest}: installed {TORCH_PIN} transformers from the index")
    else:
        names = link_bare(dest)
        print(f"{dest}: linked {len(names)} distributions from {sys.prefix}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
