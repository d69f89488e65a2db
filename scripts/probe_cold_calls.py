"""What one ``write()`` and one ``load()`` cost the caller when its caches are cold.

`kvio bench --through controller` reports two CPU figures per row: ``CPU us/call``, the
median inside a queue of back-to-back calls, and ``CPU us/call, device idle``, each call made
after a device synchronize. The second is the larger on every GPU measured (1.4 to 3.3
times at 64 pages in h200-2026-12-06b). This probe asks whether the device has anything to
do with it: the same calls, back to back (``warm``), and each after something else ran on
the caller's thread:

- ``after 2 ms spin``: a loop reading the clock for 2 ms (as a synchronize that spins does);
- ``after 2 ms sleep``: the thread sleeps 2 ms (as a synchronize that yields does);
- ``after 8 MiB read``: the caller reads 8 MiB first (as an engine's own work between two
  calls: its scheduler, the forward pass's launches), which evicts what the call had cached.

Each is the median of ``--calls`` calls; ``second`` is a call made right after a cold one.
Without ``--gpu`` the controller runs kvio_cuda's variants against ``scripts/null_kvio.c`` on
torch's meta device (see ``probe_null_device.py``): no device at all. With ``--gpu`` it runs
the real backend on the current CUDA device, and ``--sync`` adds a row of calls each made
after a device synchronize (the bench's ``device idle``).

    python scripts/probe_cold_calls.py                    # null device, markdown table
    python scripts/probe_cold_calls.py --gpu --sync       # on a GPU
    python scripts/probe_cold_calls.py --ops              # single torch/NumPy calls instead
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

P, LAYERS = 64, 32
EVICT = np.ones(8 << 20, dtype=np.uint8)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def befores(sync: Callable[[], None] | None) -> dict[str, Callable[[], Any]]:
    """What runs on the caller's thread before each timed call, by row name."""
    rows: dict[str, Callable[[], Any]] = {
        "warm": lambda: None,
        "after 2 ms spin": lambda: spin(2e-3),
        "after 2 ms sleep": lambda: time.sleep(2e-3),
        "after 8 MiB read": EVICT.sum,
    }
    if sync is not None:
        rows["after a device synchronize"] = sync
    return rows


@contextmanager
def controllers(gpu: bool) -> Iterator[tuple[Callable[..., Any], torch.device,
                                             Callable[[], None] | None]]:
    """(make a controller for kind, layout, pages; the device; a device synchronize)."""
    if gpu:
        from kvcore import DevicePool, HiCacheController
        from kvcore.registry import allocate_host_pool

        device = torch.device("cuda", torch.cuda.current_device())

        def make_gpu(kind: str, layout: str, pages: int) -> HiCacheController:
            heads, dim = (8, 128) if kind == "mha" else (1, 576)
            dev = DevicePool.allocate(kind, LAYERS, 4 * pages * P, heads, dim, torch.bfloat16,
                                      device, P)
            host = allocate_host_pool(kind, layout, LAYERS, 8 * pages * P, heads, dim,
                                      torch.bfloat16, P, device)
            return HiCacheController(dev, host)

        yield make_gpu, device, torch.cuda.synchronize
        return
    import probe_null_device as null

    from kvcore.testing.stand_in_streams import stand_in_streams

    with tempfile.TemporaryDirectory() as tmp, stand_in_streams(null.DEVICE.type) as current:
        registry = null.null_registry(null.build_library(Path(tmp)), current)

        def make_null(kind: str, layout: str, pages: int) -> Any:
            return null.controller(registry, kind, layout, pages)

        yield make_null, null.DEVICE, None


def measure(ctl: Any, device: torch.device, pages: int, op: str, before: Callable[[], Any],
            calls: int) -> tuple[float, float]:
    """Median us of a call made after ``before()``, and of one made right after that."""
    d = torch.arange(pages * P, device=device)
    d2 = torch.arange(pages * P, 2 * pages * P, device=device)
    hosts = []
    if op == "load":
        hosts = [ctl.write(d).host_indices for _ in range(2)]
        ctl.wait_acks()
    first, second = [], []
    for i in range(calls + 3):
        if op == "write":
            for ack in ctl.wait_acks():
                ctl.free_host(ack.host_indices)
        before()
        t0 = time.perf_counter()
        ctl.write(d) if op == "write" else ctl.load(hosts[0], d2)
        t1 = time.perf_counter()
        ctl.write(d) if op == "write" else ctl.load(hosts[1], d2)
        t2 = time.perf_counter()
        if i >= 3:  # (the first calls warm pools and rings up)
            first.append(t1 - t0)
            second.append(t2 - t1)
    for ack in ctl.wait_acks():
        ctl.free_host(ack.host_indices)
    for h in hosts:
        ctl.free_host(h)
    return 1e6 * statistics.median(first), 1e6 * statistics.median(second)


def calls_table(gpu: bool, sync: bool, pages_list: list[int], calls: int) -> None:
    print("| op | layout | pages | before the call | us | second call us |")
    print("|---|---|---|---|---|---|")
    with controllers(gpu) as (make, device, synchronize):
        for layout in ("page_first", "layer_first"):
            for pages in pages_list:
                ctl = make("mha", layout, pages)
                for op in ("write", "load"):
                    for name, before in befores(synchronize if sync else None).items():
                        us, again = measure(ctl, device, pages, op, before, calls)
                        print(f"| {op} | {layout} | {pages} | {name} | {us:.1f} | "
                              f"{again:.1f} |", flush=True)


def ops_table(calls: int) -> None:
    """Single calls a submit makes, warm and after the 8 MiB read."""
    tokens = np.arange(P, dtype=np.int64)
    t = torch.arange(1 << 16)
    ops: dict[str, Callable[[], Any]] = {
        "NumPy array copy (64 int64)": tokens.copy,
        "torch.from_numpy": lambda: torch.from_numpy(tokens),
        "tensor.dtype": lambda: t.dtype,
        "tensor.data_ptr()": t.data_ptr,
        "tensor slice": lambda: t[128:192],
        "Python call": lambda: None,
    }
    print("| call | warm us | after 8 MiB read us |")
    print("|---|---|---|")
    for name, fn in ops.items():
        warm, cold = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - t0)
        for _ in range(calls):
            EVICT.sum()
            t0 = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - t0)
        print(f"| {name} | {1e6 * statistics.median(warm):.2f} | "
              f"{1e6 * statistics.median(cold):.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the real backend on the CUDA device")
    ap.add_argument("--sync", action="store_true",
                    help="with --gpu: also calls made after a device synchronize")
    ap.add_argument("--ops", action="store_true", help="time single torch/NumPy calls instead")
    ap.add_argument("--pages", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    if args.ops:
        ops_table(max(args.calls, 100))
        return
    calls_table(args.gpu, args.sync and args.gpu, args.pages, args.calls)


if __name__ == "__main__":
    main()
