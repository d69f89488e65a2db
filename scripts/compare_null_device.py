"""The null-device probe (scripts/probe_null_device.py) on two source trees, run alternately,
for a before/after figure of a change to the submit path on a machine without a GPU.

Each round runs the probe once per tree; a row's figure is the fastest of its rounds'
medians (this machine's noise only ever adds time). The tree's own kvcore and plugins are
imported (PYTHONPATH), whatever is installed.

    git worktree add /tmp/base <rev>
    python scripts/compare_null_device.py /tmp/base . --rounds 6      # base -> new, median us
    python scripts/compare_null_device.py /tmp/base . --rounds 6 --per-layer
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
from pathlib import Path


def run(tree: Path, extra: list[str]) -> dict[tuple[str, ...], tuple[float, ...]]:
    """One probe run on ``tree``: each row's key columns and its figures."""
    paths = [tree, tree / "plugins" / "kvio_cuda", tree / "plugins" / "kvio_reference"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths))
    out = subprocess.run([sys.executable, str(tree / "scripts" / "probe_null_device.py"),
                          *extra], capture_output=True, text=True, env=env, cwd=tree,
                         check=True).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        figures = 0  # the row's trailing figures (microseconds, with a decimal point)
        while figures < len(cells) and _figure(cells[len(cells) - 1 - figures]):
            figures += 1
        if 0 < figures < len(cells):
            split = len(cells) - figures
            rows[tuple(cells[:split])] = tuple(float(c) for c in cells[split:])
    return rows


def _figure(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return "." in text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--per-layer", action="store_true")
    args = ap.parse_args()
    extra = ["--calls", str(args.calls)] + (["--per-layer"] if args.per_layer else
                                            ["--pages", "1", "16"])
    seen: dict[str, dict[tuple[str, ...], list[tuple[float, ...]]]] = {
        "base": collections.defaultdict(list), "new": collections.defaultdict(list)}
    for _ in range(args.rounds):
        for name, tree in (("base", args.base), ("new", args.new)):
            for key, figures in run(tree.resolve(), extra).items():
                seen[name][key].append(figures)
    for key, news in seen["new"].items():
        bases = seen["base"].get(key)
        if not bases:
            continue
        cells = [f"{min(b[i] for b in bases):.1f} -> {min(n[i] for n in news):.1f}"
                 for i in range(len(news[0]))]
        print(f"| {' | '.join(key)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
