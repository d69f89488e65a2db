"""Why queues of controller calls cost the caller more in ``kvio bench`` than in
``scripts/probe_call_parts.py`` on the same machine (h100-2026-12-05b, calls 10-11: 54 against
29 us per one-page MHA ``write()``, 83 against 59 per 64-page ``load()``, while one-page MLA
writes cost 26 in both): the same queues with one factor changed at a time, and the time spent
inside the library's transfer call measured in each (the library is wrapped before any
controller is built, so its prepared runners call through the wrapper; the wrapper's own cost
is the same in every row).

Factors: the bench's own queue (``kvcore.bench.queue._run``) against a plain loop; the device
indices (one ``arange`` tensor, as probe_call_parts, or the bench's four random page sets);
the host pool (exactly the queue's pages, as the bench, or eight pages to spare); write or
load; MHA or MLA; 1 or 64 pages. Run on a GPU machine:

    python scripts/probe_queue_factors.py [--json FILE]
    python scripts/probe_queue_factors.py --backend reference --device cpu --pages 1  # dry run
    python scripts/probe_queue_factors.py --null   # kvcore's own share, on a machine without GPU
"""

from __future__ import annotations

import argparse
import itertools
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
from kvcore.registry import REFERENCE, Registry, allocate_host_pool, default_registry

P, LAYERS = 64, 32
SHAPE = {Kind.MHA: (8, 128), Kind.MLA: (1, 576)}


TIMED = ("kvio_write_back", "kvio_load")  # the transfer calls timed inside the library


class TimedLibrary:
    """Stands in for a ctypes library: adds the wall time of each transfer call
    (:data:`TIMED`) to ``spent`` (seconds, per function), then returns what it returned."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.spent: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.lib, name)
        if not name.startswith(TIMED):
            return fn
        spent = self.spent.setdefault(name, [])

        def call(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent.append(time.perf_counter() - t0)
        return call


def loop_queue(op: str, kind: Kind, pages: int, calls: int, indices: str, spare: int,
               gen: torch.Generator, backend: str, registry: Registry, device: torch.device,
               sync: Any) -> tuple[float, float]:
    """Median us of one queued ``write()`` (``load()``) and of one made with the device idle:
    three queues of ``calls`` back-to-back calls after a warm-up queue; writes followed by
    their acks, each load by ``wait_layer`` of every layer (loads of acks' pages, written
    before each queue)."""
    heads, dim = SHAPE[kind]
    dev = DevicePool.allocate(kind, LAYERS, 2 * pages * P, heads, dim, torch.bfloat16, device, P)
    for t in dev.all_buffers():
        t.view(torch.int16).random_(-2**15, 2**15)
    host = allocate_host_pool(kind, Layout.PAGE_FIRST, LAYERS, calls * pages * P + spare * P,
                              heads, dim, torch.bfloat16, P, device, backend=backend,
                              registry=registry)
    ctl = HiCacheController(dev, host, backend=backend, registry=registry)
    ramp = torch.arange(P)
    if indices == "same":
        sets = [torch.arange(pages * P, device=device)]
    else:
        sets = [(torch.randperm(2 * pages, generator=gen)[:pages, None] * P + ramp).flatten()
                .to(device) for _ in range(4)]

    def call(i: int, hosts: list[torch.Tensor]) -> float:
        t0 = time.perf_counter()
        if op == "write":
            ctl.write(sets[i % len(sets)])
            return time.perf_counter() - t0
        handle = ctl.load(hosts[i], sets[(i + 1) % len(sets)])
        spent = time.perf_counter() - t0
        for layer in range(LAYERS):
            handle.wait_layer(layer)
        return spent

    def queue(n: int, paced: bool) -> list[float]:
        hosts = []
        if op == "load":
            hosts = [ctl.write(sets[i % len(sets)]).host_indices for i in range(n)]
            ctl.wait_acks()
        sync()
        times = []
        for i in range(n):
            if paced:
                sync()
            times.append(call(i, hosts))
            if paced and op == "write":  # (a write the library's thread issues: done once acked)
                for ack in ctl.wait_acks():
                    ctl.free_host(ack.host_indices)
        sync()
        for ack in ctl.wait_acks():
            ctl.free_host(ack.host_indices)
        for h in hosts:
            ctl.free_host(h)
        return times

    queued = [t for rep in range(4) for t in queue(calls, False) if rep]
    idle = queue(min(calls, 32), True)
    return 1e6 * statistics.median(queued), 1e6 * statistics.median(idle)


def positions(spent: list[float], calls: int) -> dict[str, float]:
    """Median us of the library call by position in a loop queue (its three timed queues,
    after the warm-up queue; a call that grows with its position waits for room in the
    device's queues, i.e. for the device)."""
    timed = spent[calls:4 * calls]
    if len(timed) < 3 * calls:
        return {}
    edges = [e for e in (0, 4, 16, 32, 64, calls) if e <= calls]
    out = {}
    for lo, hi in itertools.pairwise(edges):
        part = [timed[r * calls + i] for r in range(3) for i in range(lo, hi)]
        if part:
            out[f"[{lo},{hi})"] = 1e6 * statistics.median(part)
    return out


class NoCeiling:
    """The bench queue's ceiling where no copy can be timed (the null device): this probe
    reports CPU times only."""

    class Copy:
        median_ms = 1.0

    def measure(self, direction: str, nbytes: int) -> Copy:
        return self.Copy()


def table(registry: Registry, backend: str, device: torch.device, ceiling: Any,
          pages_list: list[int], ops: list[str]) -> list[dict[str, Any]]:
    """Every factor's row, printed as a markdown table as it comes."""
    sync = _synchronizer(device)
    native = getattr(registry.instance(backend, device), "lib", None)
    timed = TimedLibrary(native._lib if native is not None else None)
    if native is not None:
        native._lib = timed
    gen = torch.Generator().manual_seed(0)
    rows = []
    print("| op | kind | pages | queue | device indices | host pool | queued us | idle us | "
          "library call us (median) | library function | library call us by queue position |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    variants = [("bench", "bench", 0), ("loop", "bench", 0), ("loop", "same", 0),
                ("loop", "same", 8), ("loop", "bench", 8), ("bench", "bench", 0)]
    for op in ops:
        prefix = "kvio_write_back" if op == "write" else "kvio_load"
        for kind in (Kind.MHA, Kind.MLA):
            for pages in pages_list:
                calls = 128 if pages == 1 else 8
                for queue, indices, spare in variants:
                    for spent in timed.spent.values():
                        spent.clear()
                    if queue == "bench":
                        row = _run(QueueCase(op, kind, Layout.PAGE_FIRST, pages, calls),
                                   backend, registry, device, ceiling, 3, gen)
                        if row.error is not None:
                            raise SystemExit(f"bench queue failed: {row.error}")
                        assert row.cpu_us is not None and row.cpu_idle_us is not None
                        q, idle = row.cpu_us, row.cpu_idle_us
                    else:
                        q, idle = loop_queue(op, kind, pages, calls, indices, spare, gen,
                                             backend, registry, device, sync)
                    name, spent = max(((n, t) for n, t in timed.spent.items()
                                       if n.startswith(prefix)),
                                      key=lambda kv: len(kv[1]), default=("-", []))
                    inside = 1e6 * statistics.median(spent) if spent else float("nan")
                    by_position = positions(spent, calls) if queue == "loop" else {}
                    rows.append({"op": op, "kind": kind.value, "pages": pages, "queue": queue,
                                 "indices": indices, "spare_pages": spare, "queued_us": q,
                                 "idle_us": idle, "library_us": inside, "function": name,
                                 "library_us_by_position": by_position})
                    pool = "exact" if not spare else f"+{spare} pages"
                    print(f"| {op} | {kind.value} | {pages} | {queue} | {indices} | {pool} | "
                          f"{q:.1f} | {idle:.1f} | {inside:.1f} | {name} | "
                          + ", ".join(f"{k} {v:.1f}" for k, v in by_position.items()) + " |",
                          flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pages", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--ops", nargs="*", choices=("write", "load"), default=["write", "load"])
    ap.add_argument("--null", action="store_true",
                    help="kvio_cuda's variants against scripts/null_kvio.c on the meta device "
                         "(scripts/probe_null_device.py): kvcore's own CPU share, no GPU")
    args = ap.parse_args()
    if args.null:
        import tempfile
        from pathlib import Path

        from probe_null_device import build_library, null_registry, stand_in_streams

        with tempfile.TemporaryDirectory() as tmp, stand_in_streams("meta", None) as current:
            registry = null_registry(build_library(Path(tmp)), current)
            rows = table(registry, "null_cuda", torch.device("meta"), NoCeiling(), args.pages,
                         args.ops)
    else:
        registry = default_registry()
        device = torch.device(args.device)
        clock = Clock(device, 1, 3)
        ceiling = Ceiling(clock, registry.instance(REFERENCE, device).allocate_host)  # type: ignore[attr-defined]
        rows = table(registry, args.backend, device, ceiling, args.pages, args.ops)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
