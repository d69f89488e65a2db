#!/usr/bin/env python
"""Where does Python spend the issue time of one per-layer load call? (one GPU)

Profiles 200 per-layer transfers (16 layers each, MLA page_first, 512-B elements) as
`kvio bench` issues them, and prints the cumulative-time table of cProfile.

    python scripts/probe_issue_cost.py [--backend cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from kvcore.bench.runner import Call, index_sets
from kvcore.bench.sweep import Case
from kvcore.layout import Kind, Layout, Op
from kvcore.pools import DevicePool
from kvcore.registry import allocate_host_pool, default_registry, make_request


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda")
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    reg = default_registry()
    case = Case(Op.LOAD_LAYER, Kind.MLA, Layout.PAGE_FIRST, torch.bfloat16, 64, 64, 128, 16, 256)
    sets = index_sets(case, torch.Generator().manual_seed(0), dev)
    dpool = DevicePool.allocate(case.kind, 16, case.pool_tokens, case.head_num, case.head_dim,
                                case.dtype, dev, case.page_size)
    hpool = allocate_host_pool(case.kind, case.layout, 16, case.pool_tokens, case.head_num,
                              case.head_dim, case.dtype, case.page_size, dev,
                              backend=args.backend, registry=reg)
    req = make_request(Op.LOAD_LAYER, case.kind, case.layout, case.dtype, case.element_bytes, dev)
    call = Call(reg.resolve(req, args.backend), (dpool, hpool), sets, case)
    call.check_and_run(0)
    torch.cuda.synchronize()
    # One load (16 launches) at a time from an idle stream: thousands of launches in a row
    # fill the launch queue and then time the GPU instead (the first version of this probe did
    # that, and read 32 us per call on an H200 host, where a 2-MiB layer takes 43 us).
    for _ in range(3):
        per_load = []
        for i in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call(i)
            per_load.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"issue: {statistics.median(per_load) / 16 * 1e6:.2f} us per layer call "
              f"(median of 200 loads of 16 layers, each from an idle stream)")
    prof = cProfile.Profile()
    for i in range(200):
        torch.cuda.synchronize()
        prof.enable()
        call(i)
        prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
