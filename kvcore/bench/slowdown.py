"""Cases timed while the host was disturbed: found by their own measurements, timed again.

The host of a shared machine slows down for seconds to minutes. On an H200 host the loads
and the pure-torch reference fell by 30 % and by 2-5x for the last minute of a nine-minute
sweep, and in another run 21 rows fell under their bar with samples spread up to 27 %
against a median spread of 2 % (docs/benchmarks/h200-2026-12-03e/). Two signals say a case
was disturbed, neither of them how fast its rows were:

- its ceiling copy, made contiguously right after its rows, ran more than
  ``SLOWDOWN_TOLERANCE`` slower than the run's fastest copy of that size (a slow host);
- a row of a backend other than the reference spread its samples more than
  ``SPREAD_TOLERANCE`` (a dip during that row's own calls; the reference is CPU-bound and
  spreads by nature).

A disturbed case is run again at the end of the sweep. Of its attempts, an undisturbed one is
kept before a disturbed one, and among equals the one whose copy ran fastest, so a slow
backend cannot be re-timed into a fast one; every row reports its case's slowdown and how
many attempts it took.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs

from kvcore.bench.sweep import Case
from kvcore.bench.timing import Timing
from kvcore.registry import REFERENCE

if TYPE_CHECKING:
    from kvcore.bench.row import Row

#: a case whose contiguous copy ran this much slower than the run's fastest is timed again
SLOWDOWN_TOLERANCE = 0.03

#: a case with a row whose samples spread more than this (max - min over median) is timed again
SPREAD_TOLERANCE = 0.05


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


def worst_spread(rows: Iterable[Row]) -> float:
    """The widest spread of samples among timed rows, the reference's apart (0.05 = 5 %)."""
    return max((r.timing.spread_pct / 100.0 for r in rows
                if r.timing is not None and r.backend != REFERENCE), default=0.0)


@attrs.frozen
class Tolerances:
    """When a case counts as disturbed (see the module's docstring)."""

    slowdown: float = SLOWDOWN_TOLERANCE
    spread: float = SPREAD_TOLERANCE

    def exceeded(self, slowdown: float, spread: float) -> bool:
        """Whether a case with this copy slowdown and this worst row spread was disturbed."""
        return slowdown > self.slowdown or spread > self.spread

    def disturbed(self, run: CaseRun, fastest: Timing) -> bool:
        return self.exceeded(slowdown(run, fastest), worst_spread(run.rows))

    def keep(self, old: CaseRun, new: CaseRun, fastest: Timing) -> CaseRun:
        """Of two attempts, the undisturbed before the disturbed, then the one whose copy
        ran faster; counting both attempts."""
        def rank(run: CaseRun) -> tuple[bool, float]:
            return self.disturbed(run, fastest), run.copy.median_ms

        best = new if rank(new) < rank(old) else old
        return attrs.evolve(best, attempts=old.attempts + 1)
