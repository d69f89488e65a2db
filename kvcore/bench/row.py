"""One row of ``kvio bench``: a (case, backend) result and its ratio to the ceiling."""

from __future__ import annotations

from typing import Any

import attrs

from kvcore.bench.sweep import Case
from kvcore.bench.timing import Timing, gib_per_s

OK, FAILED, UNSUPPORTED = "ok", "failed", "unsupported"


@attrs.define
class Row:
    """One (case, backend) result. ``timing`` is None unless the row passed its check."""

    case: Case
    backend: str
    backend_version: str | None = None
    variant: str | None = None
    status: str = OK
    reason: str | None = None
    timing: Timing | None = None
    ceiling: Timing | None = None
    ceiling_kind: str | None = None
    speedup: float | None = None
    #: how much slower the case's own ceiling copy ran than the run's fastest (see slowdown.py)
    host_slowdown: float | None = None
    #: how many times the case was run (more than 1 where the host was slow the first time)
    attempts: int = 1

    @property
    def gib_s(self) -> float | None:
        return self.timing.gib_s(self.case.bytes_moved) if self.timing else None

    @property
    def ceiling_gib_s(self) -> float | None:
        return self.ceiling.gib_s(self.case.bytes_moved) if self.ceiling else None

    @property
    def ratio(self) -> float | None:
        """Achieved throughput over the ceiling's (= ceiling time / achieved time)."""
        if self.timing is None or self.ceiling is None:
            return None
        return ratio(self.case.bytes_moved, self.timing.median_ms, self.ceiling.median_ms)

    def facts(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "backend_version": self.backend_version,
            "variant": self.variant, **self.case.facts(), "status": self.status,
            "reason": self.reason,
            "timing": self.timing.facts() if self.timing else None,
            "gib_s": self.gib_s,
            "ceiling": (None if self.ceiling is None else
                        {"copy": self.ceiling_kind, **self.ceiling.facts(),
                         "gib_s": self.ceiling_gib_s}),
            "ratio": self.ratio, "speedup": self.speedup,
            "host_slowdown": self.host_slowdown, "attempts": self.attempts,
        }


def ratio(nbytes: int, achieved_ms: float, ceiling_ms: float) -> float:
    """achieved GiB/s / ceiling GiB/s for the same byte count."""
    ceiling = gib_per_s(nbytes, ceiling_ms)
    return gib_per_s(nbytes, achieved_ms) / ceiling if ceiling > 0 else 0.0
