"""Cases timed while the host was slow: found by their own ceiling copy, then timed again.

The host of a shared machine slows down for seconds to minutes. On an H200 host the loads
and the pure-torch reference fell by 30 % and by 2-5x for the last minute of a nine-minute
sweep (docs/benchmarks/h200-2026-12-03e/). The runner copies each case's bytes contiguously
right after timing its backends, and that copy is the health signal: a case whose copy ran
more than the tolerance slower than the run's fastest copy of that size is run again at the
end of the sweep, and the attempt whose copy was fastest is kept. The rows' own times never
decide, so a slow backend cannot be re-timed into a fast one; every row reports its case's
slowdown and how many attempts it took.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvcore.bench.sweep import Case
from kvcore.bench.timing import Timing

if TYPE_CHECKING:
    from kvcore.bench.runner import Row

#: a case whose contiguous copy ran this much slower than the run's fastest is timed again
SLOWDOWN_TOLERANCE = 0.03


@attrs.frozen
class CaseRun:
    """One attempt at a case: its rows and the slowest ceiling copy measured during it."""

    case: Case
    rows: list[Row]
    copy: Timing
    attempts: int = 1


def slowdown(run: CaseRun, fastest: Timing) -> float:
    """How much slower the case's copy ran than the fastest copy of its size (0.05 = 5 %)."""
    return run.copy.median_ms / fastest.median_ms - 1.0 if fastest.median_ms > 0 else 0.0


def keep_healthier(old: CaseRun, new: CaseRun) -> CaseRun:
    """The attempt whose copy ran faster, counting both attempts."""
    best = new if new.copy.median_ms < old.copy.median_ms else old
    return attrs.evolve(best, attempts=old.attempts + 1)
