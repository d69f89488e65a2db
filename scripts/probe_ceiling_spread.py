"""How much the bench's ceiling (one contiguous copy of a size, kvcore.bench.ceiling) moves
between samples, and whether fresh host memory is what moves it: each sample as the bench
takes it (new pinned and device buffers, warm-up, 21 timed copies, the median), against the
same copy timed again on one pair of buffers. Controller rows of 9 and 32 MiB read ceilings
from 38.6 to 51.4 GiB/s on H100s while their own rate stayed within 41-46
(h100-2026-12-05c).

    python scripts/probe_ceiling_spread.py      # on a CUDA machine; prints a markdown table
"""

from __future__ import annotations

import statistics

import torch

from kvcore.bench.ceiling import Ceiling
from kvcore.bench.timing import Clock, gib_per_s
from kvcore.registry import REFERENCE, default_registry

MIB = 2**20
SIZES = (9 * MIB // 4, 8 * MIB, 9 * MIB, 32 * MIB, 36 * MIB, 128 * MIB)
SAMPLES = 6


def cell(rates: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in rates) + f" (median {statistics.median(rates):.1f})"


def same_buffers(ceiling: Ceiling, direction: str, size: int) -> list[float]:
    """GiB/s of SAMPLES timings of the bench's copy on one pair of buffers."""
    device = ceiling.clock.device
    host = ceiling.allocate_host((size,), torch.uint8)[0].fill_(0x5A)
    dev = torch.empty(size, dtype=torch.uint8, device=device).fill_(0x5A)
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    steady = Clock(device, 3, 21)

    def copy(i: int) -> None:
        dst.copy_(src, non_blocking=True)

    return [gib_per_s(size, steady.measure(copy).median_ms) for _ in range(SAMPLES)]


def main() -> None:
    device = torch.device("cuda")
    reference = default_registry().instance(REFERENCE, device)
    ceiling = Ceiling(Clock(device, 2, 7), reference.allocate_host)  # type: ignore[attr-defined]
    print("| direction | MiB | GiB/s, fresh buffers per sample | GiB/s, one pair of buffers |")
    print("|---|---|---|---|")
    for direction in ("h2d", "d2h"):
        for size in SIZES:
            fresh = [gib_per_s(size, ceiling._measure(direction, size, 1).median_ms)
                     for _ in range(SAMPLES)]
            same = same_buffers(ceiling, direction, size)
            print(f"| {direction} | {size / MIB:g} | {cell(fresh)} | {cell(same)} |", flush=True)

if __name__ == "__main__":
    main()
