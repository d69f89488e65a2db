"""scripts/seed_bars.py: a seed run's cuda rows against their paths' bars."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "seed_bars.py"
SETTINGS = {"slowdown_tolerance": 0.03, "spread_tolerance": 0.05}


def _row(op: str, layout: str, element_bytes: int, ratio: float, backend: str = "cuda",
         spread: float = 0.5, slowdown: float = 0.0) -> dict[str, Any]:
    return {"backend": backend, "op": op, "layout": layout, "kind": "mha", "num_layers": 32,
            "element_bytes": element_bytes, "variant": "v", "status": "ok", "ratio": ratio,
            "timing": {"spread_pct": spread}, "host_slowdown": slowdown, "attempts": 1}


def _run(tmp_path: Path, rows: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "run.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for record in [{"schema": "kvcore.bench/1", "settings": SETTINGS}, *rows]:
            f.write(json.dumps(record) + "\n")
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True,
                          text=True, check=False)


def test_rows_at_their_bars_pass(tmp_path: Path) -> None:
    """Each path's bar, met exactly; the reference's rows are not judged."""
    out = _run(tmp_path, [_row("write_back", "page_first", 512, 0.95),
                          _row("write_back", "layer_first", 512, 0.90),
                          _row("load_all", "page_first", 4096, 0.90),
                          _row("load_layer", "page_first", 1024, 0.85),
                          _row("load_layer", "page_first", 2048, 0.90),
                          _row("load_layer", "layer_first", 512, 0.90),
                          _row("load_layer", "layer_first", 512, 0.05, backend="reference")])
    assert out.returncode == 0, out.stdout
    assert out.stdout.startswith("6 of 6 cuda rows at their bar")


def test_a_row_below_its_bar_fails_and_says_whether_it_was_disturbed(tmp_path: Path) -> None:
    """A page_first write-back at 0.949 misses its 0.95 (the 0.90 of the other paths would
    pass it); a noisy row below its bar is marked disturbed, a steady one is not."""
    out = _run(tmp_path, [_row("write_back", "page_first", 512, 0.949),
                          _row("load_layer", "layer_first", 512, 0.82, spread=7.0),
                          _row("load_layer", "page_first", 512, 0.86)])
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0] == "1 of 3 cuda rows at their bar"
    below = [line for line in lines if line.startswith("below:")]
    assert len(below) == 2
    assert "write_back page_first" in below[0] and "0.949 < 0.95" in below[0]
    assert "disturbed" not in below[0]
    assert "load_layer layer_first" in below[1] and below[1].endswith("; disturbed)")
    assert lines[-1] == "1 of the 2 below their bar were disturbed on their last attempt"
