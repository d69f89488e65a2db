"""Run the conformance suite programmatically and tally results per capability row.

``kvio check`` and the project's own tests use :func:`run_suite`, which calls ``pytest.main``
over :mod:`kvcore.testing.suite` with the plugin and a :class:`ResultCollector` that files
every outcome under its row (op kind layout variant).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import attrs
import pytest

from kvcore.testing.plugin import SUITE_PATH

#: matrix columns, in print order
OUTCOMES = ("passed", "failed", "not claimed", "skipped", "xfail", "xpass")


@attrs.define
class Failure:
    nodeid: str
    row: str
    message: str


@attrs.define
class SuiteResult:
    """Counts per row and outcome, the failures' messages, and pytest's exit code."""

    backend: str
    exit_code: int
    counts: dict[str, collections.Counter[str]]
    failures: list[Failure]
    skip_reasons: collections.Counter[str]

    @property
    def ok(self) -> bool:
        return not self.failures and self.exit_code in (0, pytest.ExitCode.NO_TESTS_COLLECTED)

    def totals(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for c in self.counts.values():
            out.update(c)
        return out


class ResultCollector:
    """A pytest plugin object that files each test's outcome under its kvio row."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.failures: list[Failure] = []
        self.skip_reasons: collections.Counter[str] = collections.Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = str(dict(report.user_properties).get("kvio_row", "other"))
        if report.failed:
            self.counts[row]["failed"] += 1
            self.failures.append(Failure(report.nodeid, row, report.longreprtext))
        elif report.skipped and report.when in ("setup", "call"):
            if hasattr(report, "wasxfail"):
                self.counts[row]["xfail"] += 1
                return
            reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple)
                         else report.longrepr).removeprefix("Skipped: ")
            self.counts[row]["not claimed" if reason.startswith("not claimed")
                             else "skipped"] += 1
            self.skip_reasons[reason] += 1
        elif report.passed and report.when == "call":
            self.counts[row]["xpass" if hasattr(report, "wasxfail") else "passed"] += 1


def suite_args(backend: str, device: str | None = None, quick: bool | None = None,
               extra: Sequence[str] = ()) -> list[str]:
    """The pytest command line that runs the shipped suite against ``backend``."""
    args = [str(SUITE_PATH), "-p", "kvcore.testing.plugin", "--kvio-backend", backend,
            "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if device:
        args += ["--kvio-device", device]
    if quick is True:
        args.append("--kvio-quick")
    elif quick is False:
        args.append("--kvio-full")
    return args + list(extra)


def run_suite(backend: str, device: str | None = None, quick: bool | None = None,
              extra: Sequence[str] = ("-q", "--tb=short", "--no-header"),
              plugins: Iterable[object] = ()) -> SuiteResult:
    """Run the suite in this process (``plugins`` are extra pytest plugin objects)."""
    collector = ResultCollector()
    code = pytest.main(suite_args(backend, device, quick, extra), plugins=[collector, *plugins])
    return SuiteResult(backend, int(code), dict(collector.counts), collector.failures,
                       collector.skip_reasons)


def matrix(result: SuiteResult) -> str:
    """The capability-by-result table: one row per op kind layout variant."""
    head = ("row (op kind layout variant)", *OUTCOMES)
    rows = [(row, *(str(c.get(o, 0)) for o in OUTCOMES))
            for row, c in sorted(result.counts.items())]
    totals = result.totals()
    rows.append(("total", *(str(totals.get(o, 0)) for o in OUTCOMES)))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    out = [line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in rows[:-1]] + [line(["-" * w for w in widths]), line(rows[-1])]
    return "\n".join(out)
