"""Where a queued ``write()`` spends the caller's CPU as its page count grows (one GPU).

For each layout and page count: a queue of back-to-back ``write()`` + ``poll_acks()`` calls
as ``kvio bench --through controller`` makes them (MHA, 32 layers, 8 x 128 bf16, 64-token
pages, device indices on the device), with every library (``kvio_*``) call timed on the
caller's thread. Prints, per row, the median us of the whole ``write()``, of the library
calls inside it (by function) and of the rest (kvcore's Python and torch's runtime calls), and
the same with the device idle before each call.

``(thread CPU)`` is the CPU time the calling thread spent inside ``write()``
(``time.thread_time``): well under the wall time, the thread waited (a lock, the scheduler,
the runtime) rather than computed. ``(page faults, mean)`` counts the calling thread's minor
page faults inside ``write()`` (first touches of memory the process had not used, or had given
back), per call. ``--no-gc`` turns Python's collector off while timing;
``--queues N`` times N queues per row, for more samples.

    python scripts/probe_write_parts.py [--pages 1,16,64] [--layouts page_first,layer_first]
    python scripts/probe_write_parts.py --pages 64 --queues 8 --no-gc
"""

from __future__ import annotations

import argparse
import collections
import gc
import resource
import statistics
import time
from typing import Any

import torch

from kvcore import DevicePool, HiCacheController
from kvcore.registry import allocate_host_pool, default_registry

P, LAYERS = 64, 32


class TimedLibrary:
    """Stands in for the ctypes library: adds each ``kvio_*`` call's seconds to ``spent``."""

    def __init__(self, lib: Any, spent: dict[str, float]) -> None:
        self._lib, self._spent = lib, spent

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if not name.startswith("kvio_"):
            return fn
        spent, clock = self._spent, time.perf_counter

        def call(*args: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args)
            finally:
                spent[name] += clock() - t0
        return call


def rows(layout: str, pages: int, calls: int,
         queues: int = 1) -> list[tuple[str, float, dict[str, float]]]:
    """(mode, median us of write(), median us of its parts) over ``queues`` queues of
    ``calls``, then with the device idle before each call."""
    n = pages * P
    dev = DevicePool.allocate("mha", LAYERS, 2 * n, 8, 128, torch.bfloat16, "cuda", P)
    host = allocate_host_pool("mha", layout, LAYERS, (calls + 2) * n, 8, 128, torch.bfloat16,
                              P, "cuda")
    backend: Any = default_registry().instance("cuda", dev.device)
    lib = backend.lib
    spent: dict[str, float] = collections.defaultdict(float)
    real = lib._lib
    lib._lib = TimedLibrary(real, spent)  # (prepared runners take their functions at build)
    out = []
    try:
        ctl = HiCacheController(dev, host)
        d = torch.arange(n, device="cuda")
        for _ in range(3):  # warm-up: rings, events, staging
            ctl.write(d)
            for ack in ctl.wait_acks():
                ctl.free_host(ack.host_indices)
        for mode in ("queue", "idle"):
            totals: list[float] = []
            thread: list[float] = []
            faults: list[int] = []
            parts: dict[str, list[float]] = collections.defaultdict(list)
            for _ in range(queues):
                torch.cuda.synchronize()
                acks = []
                for _ in range(calls):
                    if mode == "idle":
                        acks += ctl.wait_acks()
                        torch.cuda.synchronize()
                    spent.clear()
                    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                    c0, t0 = time.thread_time(), time.perf_counter()
                    ctl.write(d)
                    totals.append(time.perf_counter() - t0)
                    thread.append(time.thread_time() - c0)
                    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
                    for name in spent:
                        parts[name] += [0.0] * (len(totals) - 1 - len(parts[name]))
                        parts[name].append(spent[name])
                    acks += ctl.poll_acks()
                acks += ctl.wait_acks()
                for ack in acks:
                    ctl.free_host(ack.host_indices)
            for v in parts.values():
                v += [0.0] * (len(totals) - len(v))
            library = [sum(v[i] for v in parts.values()) for i in range(len(totals))]
            us = {name: 1e6 * statistics.median(v) for name, v in parts.items()}
            us["(library, all)"] = 1e6 * statistics.median(library)
            rest = [t - x for t, x in zip(totals, library, strict=True)]
            us["(rest)"] = 1e6 * statistics.median(rest)
            us["(thread CPU)"] = 1e6 * statistics.median(thread)
            us["(page faults, mean)"] = statistics.mean(faults)
            out.append((mode, 1e6 * statistics.median(totals), us))
        torch.cuda.synchronize()
    finally:
        lib._lib = real
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="1,16,64")
    ap.add_argument("--layouts", default="page_first,layer_first")
    ap.add_argument("--queues", type=int, default=1, help="queues timed per row")
    ap.add_argument("--no-gc", action="store_true", help="Python's collector off while timing")
    args = ap.parse_args()
    if args.no_gc:
        gc.collect()
        gc.disable()
    for layout in args.layouts.split(","):
        for pages in (int(p) for p in args.pages.split(",")):
            calls = max(8, min(200, 512 // pages))
            for mode, total, parts in rows(layout, pages, calls, args.queues):
                shown = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items()) if v >= 0.1)
                print(f"{layout} {pages:>3}p {mode:5s} write() {total:6.1f} us | {shown}",
                      flush=True)


if __name__ == "__main__":
    main()
