"""Timing: device events on an accelerator, synchronised wall clock on the CPU.

Each measurement runs ``warmup`` untimed rounds, each calling every one of its ``sets`` input
sets once, then ``repeat`` timed calls, and reports the median and spread. The call receives
its running number so it can rotate among the input sets, which keeps caches from flattering
small sizes; the rounds make sure no timed call is the first on its set (on an H200, rows
timed with a cold set measured up to 11 % under their warm value:
docs/benchmarks/h200-2026-12-03c/).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from kvcore.errors import InvalidArgument
from kvcore.streams import current_stream, has_streams


@attrs.frozen
class Timing:
    """Samples of one measurement, in milliseconds."""

    samples_ms: tuple[float, ...]

    def __attrs_post_init__(self) -> None:
        if not self.samples_ms:
            raise InvalidArgument("samples_ms", "at least one sample", "none")

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.samples_ms))

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def spread_pct(self) -> float:
        """(max - min) / median, in percent."""
        med = self.median_ms
        return 100.0 * (self.max_ms - self.min_ms) / med if med > 0 else 0.0

    def gib_s(self, nbytes: int) -> float:
        """Throughput at the median."""
        return gib_per_s(nbytes, self.median_ms)

    def facts(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "spread_pct": self.spread_pct, "samples_ms": list(self.samples_ms)}


def gib_per_s(nbytes: int, ms: float) -> float:
    """Bytes per millisecond expressed in GiB/s (0 for a zero time)."""
    return nbytes / (ms / 1e3) / 2**30 if ms > 0 else 0.0


class Clock:
    """Times calls on ``device``: events on its current stream, or perf_counter on the CPU."""

    def __init__(self, device: torch.device, warmup: int, repeat: int) -> None:
        if warmup < 0:
            raise InvalidArgument("warmup", "a non-negative int", str(warmup))
        if repeat < 1:
            raise InvalidArgument("repeat", "a positive int", str(repeat))
        self.device = device
        self.warmup = warmup
        self.repeat = repeat

    @property
    def kind(self) -> str:
        """``device events`` or ``wall clock``, for reports."""
        return "device events" if has_streams(self.device) else "wall clock"

    def synchronize(self) -> None:
        if has_streams(self.device):
            torch.get_device_module(self.device).synchronize(self.device)

    def measure(self, call: Callable[[int], object], sets: int = 1) -> Timing:
        """Run ``call(i)`` for ``warmup`` rounds of ``sets`` calls, then for the timed
        repetitions; i counts every call from 0, so ``i % sets`` walks the input sets."""
        if sets < 1:
            raise InvalidArgument("sets", "a positive int", str(sets))
        warm = self.warmup * sets
        for i in range(warm):
            call(i)
        self.synchronize()
        if not has_streams(self.device):
            samples = []
            for i in range(self.repeat):
                t0 = time.perf_counter()
                call(warm + i)
                samples.append((time.perf_counter() - t0) * 1e3)
            return Timing(tuple(samples))
        module = torch.get_device_module(self.device)
        stream = current_stream(self.device)
        pairs = []
        for i in range(self.repeat):
            start, end = (module.Event(enable_timing=True) for _ in range(2))
            start.record(stream)
            call(warm + i)
            end.record(stream)
            pairs.append((start, end))
        self.synchronize()
        return Timing(tuple(float(s.elapsed_time(e)) for s, e in pairs))
