"""What checking CPU index tensors costs on the submit path (runs on the CPU, no GPU needed):
check_cpu_indices for host indices (whole pages, no duplicate for a write-back) and for device
indices (no duplicate for a load), and BoundPlan.check of new tensors against the same tensors
submitted again (each layer of a load submitted alone). Median of many calls, microseconds.

    python scripts/probe_check_cost.py
"""

# ruff: noqa: B023  (each lambda is called at once, inside its loop turn)
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvcore import DevicePool
from kvcore.layout import Op
from kvcore.registry import allocate_host_pool, default_registry, make_request
from kvcore.validate import check_cpu_indices

P, LAYERS, POOL_PAGES = 64, 32, 256


def median_us(fn: Callable[[], object], n: int = 3000) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


def tokens(pages: int, gen: torch.Generator) -> torch.Tensor:
    p = torch.randperm(POOL_PAGES, generator=gen)[:pages]
    return (p[:, None] * P + torch.arange(P)).flatten()


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    size = POOL_PAGES * P
    dev = DevicePool.allocate("mha", LAYERS, size, 8, 128, torch.bfloat16, "cpu", P)
    host = allocate_host_pool("mha", "page_first", LAYERS, size, 8, 128, torch.bfloat16, P,
                              "cpu")
    bound = default_registry().resolve(make_request(
        Op.LOAD_LAYER, "mha", "page_first", torch.bfloat16, dev.element_bytes, "cpu")).bind(
        dev, host)
    print("| pages | host indices, write-back | device indices, load | BoundPlan.check, new "
          "tensors | the same tensors again |")
    print("|---|---|---|---|---|")
    for pages in (1, 4, 16, 64):
        h, d = tokens(pages, gen), tokens(pages, gen)
        host_us = median_us(lambda: check_cpu_indices("host_indices", h, size, page_size=P,
                                                      unique=True))
        dev_us = median_us(lambda: check_cpu_indices("device_indices", d, size, unique=True,
                                                     runs=P))
        fresh, again = [], []
        for _ in range(1000):
            hc, dc = h.clone(), d.clone()
            t0 = time.perf_counter_ns()
            bound.check(hc, dc, 0)
            t1 = time.perf_counter_ns()
            bound.check(hc, dc, 1)
            fresh.append(t1 - t0)
            again.append(time.perf_counter_ns() - t1)
        print(f"| {pages} | {host_us:.1f} | {dev_us:.1f} | {statistics.median(fresh) / 1e3:.1f} "
              f"| {statistics.median(again) / 1e3:.1f} |")


if __name__ == "__main__":
    main()
