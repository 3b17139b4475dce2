"""What the notebooks' Colab install would change on today's Colab, without Colab: pip's own resolver, dry run.

Colab publishes the packages of its runtime image (googlecolab/backend-info, `pip-freeze.gpu.txt`). This script
builds a venv that holds every one of them as an empty .dist-info folder (name, version and, for the packages
cbkit's install can reach and Colab's server, their real requirements, read from the package index), then asks pip what installing
the first cell's requirement would do there: install this checkout the way the cell installs the repository
(`cbkit @ git+...` becomes `cbkit @ file://<checkout>`). It prints each package that would be replaced, old ->
new, and each new one; it exits 1 when the install would replace torch or a piece of Colab's notebook server.

    python scripts/colab_dry_run.py [--freeze PATH_OR_URL] [--extras notebooks] [--keep DIR]

Needs the network (the index, and the freeze unless given a file) and a minute. Its limits: it runs under this
machine's Python, which may not be Colab's (`os-info-gpu.txt` says which), and it knows the requirements only of
the packages in cbkit's reach, so pip's list of conflicts with the rest of Colab's packages is not complete.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FREEZE = "https://raw.githubusercontent.com/googlecolab/backend-info/main/pip-freeze.gpu.txt"
# Never replaced on Colab: its CUDA torch, and what its kernel and notebook server run on.
PROTECTED = {"torch", "google-colab", "ipykernel", "ipython", "jupyter-client", "jupyter-server", "notebook",
             "tornado", "pyzmq", "traitlets"}
# Too large to read metadata for, and their requirements do not decide anything here.
_NO_METADATA = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def colab_requirement() -> str:
    """The requirement the notebooks' first cell installs, pointed at this checkout."""
    cell = "".join(json.loads((ROOT / "notebooks" / "00_quickstart.ipynb").read_text())["cells"][2]["source"])
    match = re.search(r'"(cbkit[^"@]*)@ git\+[^"]+"', cell)
    if not match:
        raise SystemExit("notebooks/00_quickstart.ipynb: no `cbkit @ git+...` install in its setup cell")
    return f"{match.group(1).strip()} @ {ROOT.as_uri()}"


def read_freeze(source: str) -> dict[str, tuple[str, str, bool]]:
    """normalised name -> (name, version, on the index) from a `pip freeze` file or URL; a `name @ url` line (not on
    the index: google-colab itself) takes the url's version."""
    if re.match(r"https?://", source):
        try:
            with urllib.request.urlopen(source, timeout=60) as response:
                text = response.read().decode()
        except OSError as error:
            raise SystemExit(f"Could not read {source} ({error}); save it from a machine that can and pass "
                             "--freeze FILE.") from error
    else:
        text = Path(source).read_text()
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "==" in line:
            name, version = line.split("==", 1)
            indexed = True
        elif " @ " in line:
            name, url = line.split(" @ ", 1)
            found = re.search(r"-(\d[\w.+]*?)(?:-py|-cp|\.tar|\.zip)", url)
            version = found.group(1) if found else "0"
            indexed = False
        else:
            continue
        out[norm(name)] = (name.strip(), version.strip(), indexed)
    return out


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def report(python: Path, path: Path, *args: str) -> list[dict]:
    pip(python, "install", "--dry-run", "--report", str(path), *args)
    return [item["metadata"] for item in json.loads(path.read_text())["install"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze", default=FREEZE, help="Colab's pip freeze, a file or a URL (default: %(default)s)")
    parser.add_argument("--extras", help="install these extras too, e.g. 'notebooks' (what the cell must not do)")
    parser.add_argument("--keep", type=Path, help="build the venv here and keep it (default: a temporary folder)")
    args = parser.parse_args(argv)
    colab = read_freeze(args.freeze)
    requirement = colab_requirement()
    if args.extras:
        name, _, where = requirement.partition(" @ ")
        requirement = f"{name.split('[')[0]}[{args.extras}] @ {where}"
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        venv.create(work / "venv", with_pip=True, clear=True)
        python = work / "venv" / "bin" / "python"
        # Which packages can the install reach at all? Resolve it once where nothing is installed.
        reach = {norm(m["name"]) for m in report(python, work / "reach.json", "--ignore-installed", requirement)}
        wanted = sorted(f"{colab[n][0]}=={colab[n][1]}" for n in (reach | PROTECTED) & colab.keys()
                        if colab[n][2] and not _NO_METADATA.match(n) and n not in ("pip", "setuptools", "wheel"))
        (work / "colab-reach.txt").write_text("\n".join(wanted) + "\n")
        known = {norm(m["name"]): m for m in report(python, work / "colab-meta.json", "--ignore-installed",
                                                    "--no-deps", "-r", str(work / "colab-reach.txt"))}
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        for key, (name, version, _) in colab.items():
            if key in ("pip", "setuptools", "wheel"):
                continue  # the venv's own, which pip needs to run
            folder = site / f"{re.sub(r'[-.]+', '_', name)}-{version}.dist-info"
            folder.mkdir(exist_ok=True)
            meta = known.get(key, {})
            lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
            lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist", [])]
            lines += [f"Provides-Extra: {e}" for e in meta.get("provides_extra", [])]
            (folder / "METADATA").write_text("\n".join(lines) + "\n")
            (folder / "INSTALLER").write_text("pip\n")
            (folder / "RECORD").write_text("")
        result = report(python, work / "colab-install.json", requirement)
    replaced = sorted((norm(m["name"]), colab[norm(m["name"])][1], m["version"]) for m in result
                      if norm(m["name"]) in colab)
    new = sorted(f"{m['name']} {m['version']}" for m in result if norm(m["name"]) not in colab)
    print(f"On Colab ({args.freeze}), `pip install {requirement}` would")
    print(f"  replace {len(replaced)}: " + ", ".join(f"{n} {a} -> {b}" for n, a, b in replaced))
    print(f"  add {len(new)}: " + ", ".join(new))
    print(f"(resolved under Python {sys.version.split()[0]}; Colab's is in os-info-gpu.txt beside the freeze)")
    hit = [n for n, _, _ in replaced if n in PROTECTED]
    if hit:
        print(f"It would replace {', '.join(hit)}, which Colab's runtime depends on.")
    return 1 if hit else 0


if __name__ == "__main__":
    sys.exit(main())
