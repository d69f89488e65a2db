"""Where the CPU time of one controller call goes: cProfile over queues of write() and of
load() + wait_layer() of every layer (MHA, 32 layers, 8 x 128 bf16, page_first, 1 page of 64
tokens, device indices on the device as an engine passes them). Run on a GPU machine:

    python scripts/probe_submit_cost.py [--calls N] [--layout page_first]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kvcore import DevicePool, HiCacheController
from kvcore.registry import allocate_host_pool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--pages", type=int, default=1)
    args = ap.parse_args()
    dev_name = "cuda"
    P, L, n = 64, 32, args.pages
    dev = DevicePool.allocate("mha", L, 4 * n * P, 8, 128, torch.bfloat16, dev_name, P)
    host = allocate_host_pool("mha", args.layout, L, 2 * args.calls * n * P + n * P, 8, 128,
                              torch.bfloat16, P, dev_name)
    ctl = HiCacheController(dev, host)
    d = torch.arange(n * P, device=dev_name)

    warm = [ctl.write(d) for _ in range(args.calls)]
    ctl.wait_acks()
    for a in warm:
        ctl.free_host(a.host_indices)
    for label in ("write", "load"):
        prof = cProfile.Profile()
        if label == "write":
            t0 = time.perf_counter()
            prof.enable()
            acks = [ctl.write(d) for _ in range(args.calls)]
            prof.disable()
            t1 = time.perf_counter()
            ctl.wait_acks()
        else:
            t0 = time.perf_counter()
            prof.enable()
            for a in acks:
                ctl.load(a.host_indices, d)
            prof.disable()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            h = ctl.load(acks[0].host_indices, d)
            w0 = time.perf_counter()
            for layer in range(L):
                h.wait_layer(layer)
            w1 = time.perf_counter()
            print(f"wait_layer x{L}: {1e6 * (w1 - w0):.1f} us")
            torch.cuda.synchronize()
        print(f"== {label}: {1e6 * (t1 - t0) / args.calls:.1f} us per call (profiled)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    for a in acks:
        ctl.free_host(a.host_indices)


if __name__ == "__main__":
    main()
