#!/usr/bin/env python
"""Per-layer load from layer_first: the copy engine (the ``dma`` variant) against the
zero-copy kernel (kvio_cuda's per-layer kernel variant, signaled where it is declared), timed
the way `kvio bench` times a row (one GPU).

Seed-table shapes (bf16, 64-token pages, 64 of 128 pages, 16 and 48 layers): each line gives
the ratio to the contiguous host->device copy of the same bytes, measured in this run, for
the kernel and the dma variant, on a dedicated stream as the bench uses.

    python scripts/probe_dma_load.py
"""

from __future__ import annotations

import attrs
import torch

from kvcore.bench.ceiling import Ceiling
from kvcore.bench.runner import Call, index_sets
from kvcore.bench.sweep import Case
from kvcore.bench.timing import Clock
from kvcore.layout import Kind, Layout, Op
from kvcore.native import native_ops
from kvcore.pools import DevicePool
from kvcore.registry import allocate_host_pool, default_registry, make_request
from kvcore.streams import new_stream, on_stream


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    reg = default_registry()
    clock = Clock(dev, 2, 10)
    ceiling = Ceiling(clock, reg.instance("reference", dev).allocate_host)
    dma = next(v for v in native_ops(dma_load_layouts=(Layout.LAYER_FIRST,))
               if v.variant == "dma")
    print(f"{'kind':4} {'layers':>6} {'elem B':>6} {'MiB/layer':>9} {'kernel':>7} {'dma':>7}")
    for kind in (Kind.MLA, Kind.MHA):
        for layers in (16, 48):
            for dim in (256, 512, 1024, 2048):
                case = Case(Op.LOAD_LAYER, kind, Layout.LAYER_FIRST, torch.bfloat16, 64, 64,
                            128, layers, dim)
                dpool = DevicePool.allocate(kind, layers, case.pool_tokens, case.head_num,
                                            case.head_dim, case.dtype, dev, case.page_size)
                hpool = allocate_host_pool(kind, case.layout, layers, case.pool_tokens,
                                          case.head_num, case.head_dim, case.dtype,
                                          case.page_size, dev, backend="cuda", registry=reg)
                sets = index_sets(case, torch.Generator().manual_seed(0), dev)
                req = make_request(Op.LOAD_LAYER, kind, case.layout, case.dtype,
                                   case.element_bytes, dev)
                cuda = reg.resolve(req, "cuda")
                kernel = tuple(v for v in cuda.variants if v.variant != "dma")
                ratios = []
                for plan in (attrs.evolve(cuda, variants=kernel),
                             attrs.evolve(cuda, variants=(dma, *kernel))):
                    call = Call(plan, (dpool, hpool), sets, case)
                    call.check_and_run(0)
                    t = clock.measure(call, len(sets))
                    c = ceiling.measure("h2d", case.bytes_moved, again=True)
                    ratios.append(c.median_ms / t.median_ms)
                mib = case.bytes_moved / layers / 2**20
                print(f"{kind.value:4} {layers:6} {case.element_bytes:6} {mib:9.1f} "
                      f"{ratios[0]:7.3f} {ratios[1]:7.3f}", flush=True)
                del dpool, hpool


if __name__ == "__main__":
    with on_stream(new_stream(torch.device("cuda"))):
        main()
