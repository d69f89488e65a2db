"""Check a seed-table run (``kvio bench --preset seed --json ...``) against the seed table's
bars: each cuda row's ratio to the ceiling must reach its path's bar.

The bars, by op, host layout and bytes per token and layer (``element_bytes``):

- write-back: page_first 0.95, layer_first 0.90;
- all-layer load: 0.90;
- per-layer load: page_first 0.85 up to 1024 B and 0.90 above, layer_first 0.90.

Prints how many rows reach their bar, each path's range, and every row below its bar with
its spread (a row below its bar with a high spread is worth timing again before blaming the
code).

    python scripts/seed_bars.py docs/benchmarks/h200-2026-12-07/bench_seed_full.jsonl.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path
from typing import Any


def bar(row: dict[str, Any]) -> float:
    """The ratio ``row``'s path must reach."""
    op, layout = row["op"], row["layout"]
    if op == "write_back":
        return 0.95 if layout == "page_first" else 0.90
    if op == "load_layer" and layout == "page_first" and row["element_bytes"] <= 1024:
        return 0.85
    return 0.90


def rows(path: Path, backend: str) -> list[dict[str, Any]]:
    """The rows of ``backend`` in a bench JSON file (gzip-compressed JSON lines or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        text = f.read()
    records = [json.loads(line) for line in text.splitlines() if line.strip()] \
        if "\n{" in text else json.loads(text).get("rows", [])
    return [r for r in records if "op" in r and r.get("backend") == backend]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--backend", default="cuda")
    args = parser.parse_args()
    found = [r for f in args.files for r in rows(f, args.backend)]
    paths: dict[tuple[str, ...], list[float]] = collections.defaultdict(list)
    below = []
    for r in found:
        ok = r["status"] == "ok"
        size = "<=1024 B" if r["element_bytes"] <= 1024 else ">1024 B"
        if ok:
            paths[(r["op"], r["layout"], r["variant"], size)].append(r["ratio"])
        if not ok or r["ratio"] < bar(r):
            below.append(r)
    print(f"{len(found) - len(below)} of {len(found)} {args.backend} rows at their bar")
    print("| op | layout | variant | bytes | rows | ratio |")
    print("|---|---|---|---|---|---|")
    for key, ratios in sorted(paths.items()):
        print(f"| {' | '.join(key)} | {len(ratios)} | {min(ratios):.3f}-{max(ratios):.3f} |")
    for r in below:
        spread = r.get("timing", {}).get("spread_pct", float("nan"))
        print(f"below: {r['op']} {r['layout']} {r['kind']} {r['num_layers']} layers "
              f"{r['element_bytes']} B: {r['status']} {r.get('ratio', 0):.3f} < {bar(r):.2f} "
              f"(spread {spread:.1f}%)")
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
