"""Does a transfer in flight slow the caller's own CPU work down? (one GPU)

A ``write()`` of 64 pages cost the caller 90-94 us on an H200 host while its Python cost 35-42
us on the null device (h200-2026-12-07), and the extra grows with the page count. A write
of 64 pages makes and copies its host indices (32 KiB each time) while the GPU moves the
queued calls' bytes between host and device memory. This probe times the same host work
with the device idle, while device-to-host copies run, and while host-to-device copies run:

- ``take 64x64``: the allocator's ``take`` of 64 pages' token rows (a new 32 KiB array);
- ``tobytes 32K``: a copy of such an array into a new bytes object (``CheckedTensors.add``);
- ``copy 32K reused``: the same bytes copied into an array made once (no new memory);
- ``sum(range(1000))``: Python alone, touching no new memory (the control).

If the first two grow under copies and the control does not, the copies' traffic through host
memory is what a large ``write()`` pays for; if everything grows alike, the CPU itself is
slower then (its clock, or other tenants of the host).

    python scripts/probe_host_contention.py [--rounds 400]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

P, PAGES, MIB = 64, 64, 2**20


def cases() -> dict[str, Callable[[], object]]:
    table = np.arange(1 << 22, dtype=np.int64).reshape(-1, P)  # a pool's token rows
    rng = np.random.default_rng(0)
    pages = rng.permutation(table.shape[0])[:PAGES]
    made = table.take(pages, axis=0).reshape(-1)
    into = np.empty_like(made)
    return {
        "take 64x64": lambda: table.take(pages, axis=0).reshape(-1),
        "tobytes 32K": made.tobytes,
        "copy 32K reused": lambda: np.copyto(into, made),
        "sum(range(1000))": lambda: sum(range(1000)),
    }


def timed(fn: Callable[[], object], rounds: int) -> float:
    spent = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(spent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--mib", type=int, default=512, help="bytes of each queued copy")
    args = ap.parse_args()
    n = args.mib * MIB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host.fill_(1)
    dev.fill_(2)
    side = torch.cuda.Stream()
    work = cases()
    print(f"median us over {args.rounds} rounds; copies of {args.mib} MiB queued on a side "
          "stream while timing")
    print("| work | device idle | device-to-host copies | host-to-device copies |")
    print("|---|---|---|---|")
    results: dict[str, list[float]] = {name: [] for name in work}
    notes = []
    for mode in ("idle", "d2h", "h2d"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode != "idle":
            with torch.cuda.stream(side):
                for _ in range(40):  # about 0.4 s of copies at 50 GB/s
                    (host.copy_(dev, non_blocking=True) if mode == "d2h"
                     else dev.copy_(host, non_blocking=True))
        queued_s = time.perf_counter() - t0
        running = not side.query()
        for name, fn in work.items():
            results[name].append(timed(fn, args.rounds))
        still = not side.query()
        torch.cuda.synchronize()
        if mode != "idle":
            notes.append(f"{mode}: queueing the copies took {1e3 * queued_s:.0f} ms; copies "
                         f"running when the timing began: {running}, when it ended: {still}"
                         " (a column counts only where both say True)")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    print(*notes, sep="\n")


if __name__ == "__main__":
    main()
