"""``kvio bench``: a backend-agnostic transfer benchmark (sweeps, timing, ceiling, reports)."""

from kvcore.bench.row import Row, ratio
from kvcore.bench.runner import Bench, BenchResult
from kvcore.bench.sweep import PRESETS, Case, Sweep, bytes_moved, expand

__all__ = ["PRESETS", "Bench", "BenchResult", "Case", "Row", "Sweep", "bytes_moved", "expand",
           "ratio"]
