"""Issue 25, item 10: ``spread%`` stays readable on a CPU, where one preempted call is 100x."""

from __future__ import annotations

from kvcore.bench import report
from kvcore.bench.runner import BenchResult, Row
from kvcore.bench.timing import Timing
from kvcore.layout import Kind, Op

from .helpers import case

#: one timed call preempted for ~158 ms among calls of ~1 ms: (max - min) / median = 15,771 %
OUTLIER_SAMPLES = (1.0, 1.01, 1.02, 0.99, 158.70)


def _result(*samples: tuple[float, ...]) -> BenchResult:
    c = case(Op.WRITE_BACK, Kind.MHA, layers=2, elem=128, page=4, batch=2, total=4)
    rows = [Row(c, f"b{i}", timing=Timing(s), ceiling=Timing((1.0,)))
            for i, s in enumerate(samples)]
    return BenchResult(rows=rows, machine={}, backends=[], settings={}, started="now")


def _spread_cells(text: str) -> list[str]:
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if " spread% " in line)
    col = lines[head].split().index("spread%")
    return [line.split()[col] for line in lines[head + 2:] if line.startswith("b")]


def test_a_row_with_one_outlier_is_flagged_not_thousands_of_percent() -> None:
    assert Timing(OUTLIER_SAMPLES).spread_pct > 15_000  # the JSON keeps the raw spread
    text = report.text_table(_result(OUTLIER_SAMPLES, (1.0, 1.02, 1.01)))
    assert _spread_cells(text) == ["3*", "2"]
    assert "* spread% without the one sample over 2x the median in 1 row(s)" in text
    md = report.markdown(_result(OUTLIER_SAMPLES), "kvio bench")
    assert "| 3* |" in md and "* spread% without the one sample" in md


def test_a_spread_beyond_reading_is_capped() -> None:
    wild = (1.0, 1.0, 1.0, 30.0, 40.0)  # two outliers: nothing single to leave out
    cells = _spread_cells(report.text_table(_result(wild)))
    assert cells == [">999"]


def test_an_ordinary_row_is_unchanged() -> None:
    text = report.text_table(_result((1.0, 1.1, 0.9)))
    assert _spread_cells(text) == ["20"]
    assert "spread% without" not in text
