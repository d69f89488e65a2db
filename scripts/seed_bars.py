"""Check a seed-table run (``kvio bench --preset seed --json ...``) against the seed table's
bars: each cuda row's ratio to the ceiling must reach its path's bar.

The bars, by op, host layout and bytes per token and layer (``element_bytes``):

- write-back: page_first 0.95, layer_first 0.90;
- all-layer load: 0.90;
- per-layer load: page_first 0.85 up to 1024 B and 0.90 above, layer_first 0.90.

Prints how many rows reach their bar, each path's range, and every row below its bar with
its spread, its attempts and how slow the run's ceiling copy ran around it. A row the bench
still found disturbed after its last attempt (its ceiling copy more than the run's
``slowdown_tolerance`` slow, or its samples spread more than ``spread_tolerance``) is marked
``disturbed``: time it again before blaming the code.

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
    """The rows of ``backend`` in a bench JSON file (gzip-compressed JSON lines or not), each
    with the run's ``settings`` under ``_settings``."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        text = f.read()
    if "\n{" in text:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        settings = records[0].get("settings", {}) if records else {}
    else:
        run = json.loads(text)
        records, settings = run.get("rows", []), run.get("settings", {})
    return [dict(r, _settings=settings) for r in records
            if "op" in r and r.get("backend") == backend]


def disturbed(row: dict[str, Any]) -> bool:
    """Whether the bench still found ``row``'s timing disturbed after its last attempt."""
    settings = row["_settings"]
    spread = row.get("timing", {}).get("spread_pct", 0.0) / 100
    return (row.get("host_slowdown", 0.0) > settings.get("slowdown_tolerance", 0.03)
            or spread > settings.get("spread_tolerance", 0.05))


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
              f"(spread {spread:.1f}%, {r.get('attempts', 1)} attempt(s), ceiling "
              f"{100 * r.get('host_slowdown', 0.0):.1f}% slow"
              f"{'; disturbed' if disturbed(r) else ''})")
    if below:
        print(f"{sum(map(disturbed, below))} of the {len(below)} below their bar were "
              "disturbed on their last attempt")
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
