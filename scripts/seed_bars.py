"""Check a seed-table run (``kvio bench --preset seed --json ...``) against the seed table's
bars: each cuda row's ratio to the ceiling must reach its path's bar.

The bars, by op, host layout and bytes per token and layer (``element_bytes``):

- write-back: page_first 0.95, layer_first 0.90;
- all-layer load: 0.90;
- per-layer load: page_first 0.85 up to 1024 B and 0.90 above, layer_first 0.90.

Prints how many rows reach their bar, each path's range, and every row below its bar with
its spread, its attempts and how slow the run's ceiling copy ran around it. A row whose case
the bench still found disturbed after its last attempt (``kvcore.bench.slowdown``: its
ceiling copy more than the run's ``slowdown_tolerance`` slow, or a row's samples spread more
than ``spread_tolerance``) is marked ``disturbed``: time it again before blaming the code.

    python scripts/seed_bars.py docs/benchmarks/h200-2026-12-07/bench_seed_full.jsonl.gz
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from kvcore.bench.merge import load
from kvcore.bench.row import Row
from kvcore.bench.slowdown import SLOWDOWN_TOLERANCE, SPREAD_TOLERANCE, Tolerances, worst_spread
from kvcore.layout import Layout, Op


def bar(row: Row) -> float:
    """The ratio ``row``'s path must reach."""
    case = row.case
    if case.op is Op.WRITE_BACK:
        return 0.95 if case.layout is Layout.PAGE_FIRST else 0.90
    if case.op is Op.LOAD_LAYER and case.layout is Layout.PAGE_FIRST and case.element_bytes <= 1024:
        return 0.85
    return 0.90


def rows(path: Path, backend: str) -> tuple[list[Row], set[tuple[object, ...]]]:
    """The rows of ``backend`` in a ``kvio bench --json`` file (any form it writes), and the
    keys of the cases the bench still found disturbed after their last attempt (its own rule,
    as the report's header counts them)."""
    result, _ = load(str(path))
    s = result.settings
    tolerances = Tolerances(s.get("slowdown_tolerance", SLOWDOWN_TOLERANCE),
                            s.get("spread_tolerance", SPREAD_TOLERANCE))
    by_case: dict[tuple[object, ...], list[Row]] = collections.defaultdict(list)
    for r in result.rows:
        by_case[r.case.key()].append(r)
    disturbed = {key for key, case_rows in by_case.items()
                 if tolerances.exceeded(case_rows[0].host_slowdown or 0.0,
                                        worst_spread(case_rows))}
    return [r for r in result.rows if r.backend == backend], disturbed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--backend", default="cuda")
    args = parser.parse_args()
    found: list[Row] = []
    disturbed: set[tuple[object, ...]] = set()
    for f in args.files:
        more, flagged = rows(f, args.backend)
        found += more
        disturbed |= flagged
    paths: dict[tuple[str, ...], list[float]] = collections.defaultdict(list)
    below = []
    for r in found:
        c, ratio = r.case, r.ratio
        if ratio is not None:
            size = "<=1024 B" if c.element_bytes <= 1024 else ">1024 B"
            paths[(c.op.value, c.layout.value, r.variant or "-", size)].append(ratio)
        if ratio is None or ratio < bar(r):
            below.append(r)
    print(f"{len(found) - len(below)} of {len(found)} {args.backend} rows at their bar")
    print("| op | layout | variant | bytes | rows | ratio |")
    print("|---|---|---|---|---|---|")
    for key, ratios in sorted(paths.items()):
        print(f"| {' | '.join(key)} | {len(ratios)} | {min(ratios):.3f}-{max(ratios):.3f} |")
    for r in below:
        c = r.case
        spread = r.timing.spread_pct if r.timing is not None else float("nan")
        print(f"below: {c.op.value} {c.layout.value} {c.kind.value} {c.num_layers} layers "
              f"{c.element_bytes} B: {r.status} {r.ratio or 0:.3f} < {bar(r):.2f} "
              f"(spread {spread:.1f}%, {r.attempts} attempt(s), ceiling "
              f"{100 * (r.host_slowdown or 0.0):.1f}% slow"
              f"{'; disturbed' if c.key() in disturbed else ''})")
    if below:
        noisy = sum(r.case.key() in disturbed for r in below)
        print(f"{noisy} of the {len(below)} below their bar were disturbed on their last "
              "attempt")
    return 1 if below else 0


if __name__ == "__main__":
    raise SystemExit(main())
