"""Why a queue of MHA ``write()`` calls cost the caller more in ``kvio bench`` than in
``scripts/probe_call_parts.py`` on the same machine (h100-2026-12-05b, calls 10-11: 54 against
29 us per one-page ``write()``, while one-page MLA cost 26 in both): the same queue with one
factor changed at a time, and the time spent inside the library's write-back call measured in
each (the library is wrapped before any controller is built, so its prepared runners call
through the wrapper; the wrapper's own cost is the same in every row).

Factors: the bench's own queue (``kvcore.bench.queue._run``) against a plain loop; the device
indices (one ``arange`` tensor, as probe_call_parts, or the bench's four random page sets);
the host pool (exactly the queue's pages, as the bench, or eight pages to spare); MHA or MLA;
1 or 64 pages. Run on a GPU machine:

    python scripts/probe_write_queue.py [--json FILE]
    python scripts/probe_write_queue.py --backend reference --device cpu --pages 1  # dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kvcore import DevicePool, HiCacheController
from kvcore.bench.ceiling import Ceiling
from kvcore.bench.queue import QueueCase, _run, _synchronizer
from kvcore.bench.timing import Clock
from kvcore.layout import Kind, Layout
from kvcore.registry import REFERENCE, allocate_host_pool, default_registry

P, LAYERS = 64, 32
SHAPE = {Kind.MHA: (8, 128), Kind.MLA: (1, 576)}


class TimedLibrary:
    """Stands in for a ctypes library: adds the wall time of each ``kvio_write_back_*`` call
    to ``spent`` (seconds, per function), then returns what it returned."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.spent: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.lib, name)
        if not name.startswith("kvio_write_back"):
            return fn
        spent = self.spent.setdefault(name, [])

        def call(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent.append(time.perf_counter() - t0)
        return call


def loop_queue(kind: Kind, pages: int, calls: int, indices: str, spare: int,
               gen: torch.Generator, backend: str, device: torch.device,
               sync: Any) -> tuple[float, float]:
    """Median us of one queued ``write()`` and one made with the device idle: three queues
    of ``calls`` back-to-back writes after a warm-up queue, each followed by its acks."""
    heads, dim = SHAPE[kind]
    dev = DevicePool.allocate(kind, LAYERS, 2 * pages * P, heads, dim, torch.bfloat16, device, P)
    for t in dev.all_buffers():
        t.view(torch.int16).random_(-2**15, 2**15)
    host = allocate_host_pool(kind, Layout.PAGE_FIRST, LAYERS, calls * pages * P + spare * P,
                              heads, dim, torch.bfloat16, P, device, backend=backend)
    ctl = HiCacheController(dev, host, backend=backend)
    ramp = torch.arange(P)
    if indices == "same":
        sets = [torch.arange(pages * P, device=device)]
    else:
        sets = [(torch.randperm(2 * pages, generator=gen)[:pages, None] * P + ramp).flatten()
                .to(device) for _ in range(4)]
    queued: list[float] = []
    for rep in range(4):
        sync()
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            ctl.write(sets[i % len(sets)])
            times.append(time.perf_counter() - t0)
        for ack in ctl.wait_acks():
            ctl.free_host(ack.host_indices)
        if rep:
            queued += times
    idle = []
    for i in range(min(calls, 32)):
        sync()
        t0 = time.perf_counter()
        ctl.write(sets[i % len(sets)])
        idle.append(time.perf_counter() - t0)
        for ack in ctl.wait_acks():
            ctl.free_host(ack.host_indices)
    return 1e6 * statistics.median(queued), 1e6 * statistics.median(idle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pages", type=int, nargs="*", default=[1, 64])
    args = ap.parse_args()
    registry = default_registry()
    device = torch.device(args.device)
    sync = _synchronizer(device)
    native = getattr(registry.instance(args.backend, device), "lib", None)
    timed = TimedLibrary(native._lib if native is not None else None)
    if native is not None:
        native._lib = timed
    clock = Clock(device, 1, 3)
    ceiling = Ceiling(clock, registry.instance(REFERENCE, device).allocate_host)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    rows = []
    print("| kind | pages | queue | device indices | host pool | write() queued us | "
          "write() idle us | library call us (median) | library function |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in (Kind.MHA, Kind.MLA):
        for pages in args.pages:
            calls = 128 if pages == 1 else 8
            variants: list[tuple[str, str, int]] = [
                ("bench", "bench", 0), ("loop", "bench", 0), ("loop", "same", 0),
                ("loop", "same", 8), ("loop", "bench", 8), ("bench", "bench", 0)]
            for queue, indices, spare in variants:
                for spent in timed.spent.values():
                    spent.clear()
                if queue == "bench":
                    row = _run(QueueCase("write", kind, Layout.PAGE_FIRST, pages, calls),
                               args.backend, registry, device, ceiling, 3, gen)
                    if row.error is not None:
                        raise SystemExit(f"bench queue failed: {row.error}")
                    assert row.cpu_us is not None and row.cpu_idle_us is not None
                    q, idle = row.cpu_us, row.cpu_idle_us
                else:
                    q, idle = loop_queue(kind, pages, calls, indices, spare, gen, args.backend,
                                         device, sync)
                name, spent = max(timed.spent.items(), key=lambda kv: len(kv[1]),
                                  default=("-", []))
                inside = 1e6 * statistics.median(spent) if spent else float("nan")
                rows.append({"kind": kind.value, "pages": pages, "queue": queue,
                             "indices": indices, "spare_pages": spare, "queued_us": q,
                             "idle_us": idle, "library_us": inside, "function": name})
                print(f"| {kind.value} | {pages} | {queue} | {indices} | "
                      f"{'exact' if not spare else f'+{spare} pages'} | {q:.1f} | {idle:.1f} | "
                      f"{inside:.1f} | {name} |", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
