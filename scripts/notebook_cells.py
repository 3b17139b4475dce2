"""Run one notebook cell by cell and print, for each code cell, its wall time, the kernel's peak RSS during that
cell and its RSS after it: which section holds the memory, and whether the next one starts from the baseline.

The kernel is its own process: its `VmHWM` is reset (`/proc/<pid>/clear_refs`, "5") before each cell and read
with `VmRSS` after it, so a peak belongs to one cell. Linux only. The notebook runs at the sizes its environment
picks (no `CBKIT_PROFILE`: the `full` profile, a CPU's `cpu` tier); run it alone on a quiet machine to read its
times. The executed copy is written beside it as `<stem>.out.ipynb`.

    python scripts/notebook_cells.py notebooks/04_grpo_live.ipynb --cwd /tmp/scratch
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

GiB = 2**30


def _status(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024 / GiB
    return out


def main() -> None:
    import nbformat
    from nbclient import NotebookClient

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("--cwd", type=Path, default=Path("."), help="the kernel's working folder (runs/ goes there)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds one cell may take")
    args = ap.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(args.cwd)}})
    peak = 0.0
    with client.setup_kernel():
        pid = client.km.provisioner.process.pid
        start = time.perf_counter()
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            t = time.perf_counter()
            client.execute_cell(cell, i)
            s = _status(pid)
            peak = max(peak, s["VmHWM"])
            last = cell.source.strip().splitlines()[-1][:60] if cell.source.strip() else ""
            print(f"cell {i:2d}  {time.perf_counter() - t:7.1f} s  peak {s['VmHWM']:5.2f} GiB  "
                  f"after {s['VmRSS']:5.2f} GiB  | {last}", flush=True)
        print(f"{args.notebook.name}: {time.perf_counter() - start:.0f} s, peak RSS {peak:.2f} GiB", flush=True)
    nbformat.write(nb, args.notebook.with_suffix(".out.ipynb"))


if __name__ == "__main__":
    main()
