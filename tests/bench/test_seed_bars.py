"""scripts/seed_bars.py: a seed run's cuda rows against their paths' bars."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kvcore.bench.report import json_bytes
from kvcore.bench.row import Row
from kvcore.bench.runner import BenchResult
from kvcore.bench.sweep import Case
from kvcore.bench.timing import Timing
from kvcore.layout import Kind, Layout, Op

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "seed_bars.py"
CEILING_MS = 1.0


def _row(op: Op, layout: Layout, element_dim: int, ratio: float, backend: str = "cuda",
         spread: float = 0.0, layers: int = 32) -> Row:
    """A row of bf16 elements of ``element_dim`` (2 B each) that read ``ratio`` of a 1 ms
    ceiling, its samples spread by ``spread`` (0.07 = 7%) around their median."""
    case = Case(op=op, kind=Kind.MHA, layout=layout, dtype=torch.bfloat16, page_size=64,
                batch_pages=64, total_pages=128, num_layers=layers, element_dim=element_dim)
    median = CEILING_MS / ratio
    samples = (median * (1 - spread / 2), median, median * (1 + spread / 2))
    return Row(case=case, backend=backend, variant="v", timing=Timing(samples),
               ceiling=Timing((CEILING_MS,)), ceiling_kind="d2h", host_slowdown=0.0)


def _run(tmp_path: Path, rows: list[Row]) -> subprocess.CompletedProcess[str]:
    result = BenchResult(rows=rows, machine={}, backends=[], started="2026-12-07T00:00:00",
                         settings={"slowdown_tolerance": 0.03, "spread_tolerance": 0.05})
    path = tmp_path / "run.jsonl.gz"
    path.write_bytes(json_bytes(result, "kvio bench --preset seed", str(path)))
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True,
                          text=True, check=False)


def test_rows_at_their_bars_pass(tmp_path: Path) -> None:
    """Each path's bar, met; the reference's rows are not judged."""
    wb, la, ll = Op.WRITE_BACK, Op.LOAD_ALL, Op.LOAD_LAYER
    pf, lf = Layout.PAGE_FIRST, Layout.LAYER_FIRST
    out = _run(tmp_path, [_row(wb, pf, 256, 0.951), _row(wb, lf, 256, 0.901),
                          _row(la, pf, 2048, 0.901), _row(ll, pf, 512, 0.851),
                          _row(ll, pf, 1024, 0.901), _row(ll, lf, 256, 0.901),
                          _row(ll, lf, 256, 0.05, backend="reference", layers=16)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("6 of 6 cuda rows at their bar")


def test_a_row_below_its_bar_fails_and_says_whether_it_was_disturbed(tmp_path: Path) -> None:
    """A page_first write-back at 0.949 misses its 0.95 (the 0.90 of the other paths would
    pass it); a row below its bar whose samples spread more than the run's tolerance is
    marked disturbed, a steady one is not."""
    out = _run(tmp_path, [_row(Op.WRITE_BACK, Layout.PAGE_FIRST, 256, 0.949),
                          _row(Op.LOAD_LAYER, Layout.LAYER_FIRST, 256, 0.82, spread=0.07),
                          _row(Op.LOAD_LAYER, Layout.PAGE_FIRST, 256, 0.86, layers=16)])
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "1 of 3 cuda rows at their bar"
    below = [line for line in lines if line.startswith("below:")]
    assert len(below) == 2
    assert "write_back page_first" in below[0] and "0.949 < 0.95" in below[0]
    assert "disturbed" not in below[0]
    assert "load_layer layer_first" in below[1] and below[1].endswith("; disturbed)")
    assert lines[-1] == "1 of the 2 below their bar were disturbed on their last attempt"
