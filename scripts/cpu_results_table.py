"""lab/cpu_results.md's CPU table, printed from the results files `scripts/cpu_sweeps.sh` wrote (nothing typed by hand).

MFU is put against one peak for the whole table: the highest matmul probe any of the files recorded (a probe
on a shared VM reads low when the host is busy, never high), so the rows compare with each other.

Usage: python scripts/cpu_results_table.py [lab/results]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cbkit.measure.results import aggregate, load_runs

ROWS = [
    ("`replay:gsm8k`", "cpu-replay.jsonl"),
    ("`fixed`", "cpu-fixed.jsonl"),
    ("`natural`", "cpu-natural.jsonl"),
    ("`replay:gsm8k`, 4 prompts x N", "cpu-replay-4prompts.jsonl"),
    ("`fixed`, per-sequence CPU attention (lab)", "cpu-fixed-n64-per_sequence.jsonl"),
    ("`fixed`, the engine's own CPU attention (lab)", "cpu-fixed-n64-engine.jsonl"),
]


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("lab/results")
    probes = {name: _probe(folder / name) for _, name in ROWS if (folder / name).exists()}
    peak = max(probes.values())
    ns = (8, 32, 64)
    head = ("| workload | " + " | ".join(f"N={n}" for n in ns) + " | at the largest N: CB peak memory vs generate | "
            "length mean / CV / max, static batch padding | MFU generate / CB | MFU at N=8 | repeats |")
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for label, name in ROWS:
        path = folder / name
        if not path.exists():
            continue
        points = aggregate(load_runs(path))
        cb = {p["N"]: p for p in points if p["backend"] == "continuous"}
        gen = {p["N"]: p for p in points if p["backend"] == "generate"}
        speed = [_x(cb[n]["speed_vs_generate"]) if n in cb else "-" for n in ns]
        if not cb:
            continue
        top = max(cb)
        c64, g64 = cb[top], gen.get(top, {})
        spread = "-"
        if c64.get("length_mean") is not None:
            spread = (f"{c64['length_mean']:.1f} / {c64['length_cv']:.2f} / {c64['length_max']:.0f}, "
                      f"{c64['decode_padding_share']:.2f}")
        scale = probes[name] / peak  # this file's MFU was against its own probe

        def mfu(g, c, scale=scale):
            if c.get("mfu") is None or g.get("mfu") is None:
                return "-"
            return f"{g['mfu'] * scale:.1%} / {c['mfu'] * scale:.1%}"

        print(f"| {label} | " + " | ".join(speed) + f" | N={top}: {_x(c64.get('mem_vs_generate'))} | {spread} | {mfu(g64, c64)} | "
              f"{mfu(gen.get(8, {}), cb.get(8, {}))} | "
              f"{c64.get('repeats', '-')} |")
    print()
    print(f"MFU against {peak / 1e9:.0f} GFLOP/s, the highest fp32 matmul probe of these files (each file's: "
          + ", ".join(f"{name.removesuffix('.jsonl')} {v / 1e9:.0f}" for name, v in probes.items()) + ").")


def _probe(path: Path) -> float:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return max(x["peak_flops"] for x in lines if x.get("kind") == "probe")


if __name__ == "__main__":
    main()
