#!/usr/bin/env python
"""Where does a per-layer load lose time? One GPU, a few shapes, five timings each.

Per-layer load (one call per layer) reaches a lower fraction of the host->device ceiling than
one all-layer call moving the same bytes. For each shape this prints, per layer call, in us:

* ``paced``: the per-layer loop as `kvio bench` runs it (Python issues each call);
* ``queued``: the same loop issued while the GPU is held busy by a sleep kernel, so every
  launch is queued before the first runs: GPU time alone, no Python pacing;
* ``cpu``: Python's time to issue one call (measured in the queued loop);
* ``all``: one all-layer call of the same backend, divided by the layer count;
* ``dma``: one contiguous pinned->device copy of the layer's bytes per call, queued;
* ``ceiling``: one contiguous copy of all layers' bytes, divided by the layer count.

    python scripts/probe_layer_load.py [--backend cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from kvcore.bench.runner import Call, index_sets
from kvcore.bench.sweep import Case
from kvcore.layout import Kind, Layout, Op
from kvcore.pools import DevicePool
from kvcore.registry import allocate_host_pool, default_registry, make_request
from kvcore.verify import random_fill

SHAPES = [  # (kind, layout, num_layers, element_dim)
    (Kind.MLA, Layout.PAGE_FIRST, 16, 256), (Kind.MLA, Layout.PAGE_FIRST, 16, 1024),
    (Kind.MHA, Layout.PAGE_FIRST, 16, 256), (Kind.MLA, Layout.LAYER_FIRST, 16, 256),
]
REPEAT = 10


def events_us(fn: Callable[[], None], hold_gpu: bool) -> float:
    """Median GPU time of ``fn`` in us; with ``hold_gpu`` its launches queue behind a sleep."""
    out = []
    for _ in range(REPEAT):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold_gpu:
            torch.cuda._sleep(20_000_000)  # ~10 ms: longer than issuing the whole loop
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    out.sort()
    return out[len(out) // 2]


def probe(backend: str, kind: Kind, layout: Layout, layers: int, elem: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    reg = default_registry()
    cases = {op: Case(op, kind, layout, torch.bfloat16, 64, 64, 128, layers, elem)
             for op in (Op.LOAD_LAYER, Op.LOAD_ALL)}
    c = cases[Op.LOAD_LAYER]
    gen = torch.Generator().manual_seed(0)
    sets = index_sets(c, gen, dev)
    dpool = DevicePool.allocate(kind, layers, c.pool_tokens, c.head_num, c.head_dim,
                                c.dtype, dev, c.page_size)
    hpool = allocate_host_pool(kind, layout, layers, c.pool_tokens, c.head_num, c.head_dim,
                              c.dtype, c.page_size, dev, backend=backend, registry=reg)
    for t in (*dpool.all_buffers(), hpool.buffer):
        random_fill(t, gen, on=dev)
    calls = {}
    for op, case in cases.items():
        req = make_request(op, kind, layout, case.dtype, case.element_bytes, dev)
        call = Call(reg.resolve(req, backend), (dpool, hpool), sets, case)
        call.check_and_run(0)
        calls[op] = call
    torch.cuda.synchronize()
    per_layer = c.bytes_moved // layers
    src = torch.empty(c.bytes_moved, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(c.bytes_moved, dtype=torch.uint8, device=dev)
    chunks = [(src[i * per_layer:(i + 1) * per_layer], dst[i * per_layer:(i + 1) * per_layer])
              for i in range(layers)]

    def dma() -> None:
        for s, d in chunks:
            d.copy_(s, non_blocking=True)

    layer_call = calls[Op.LOAD_LAYER]
    cpu = []

    def issue_timed() -> None:
        t0 = time.perf_counter()
        layer_call(0)
        cpu.append((time.perf_counter() - t0) * 1e6 / layers)

    row = {
        "kind": kind.value, "layout": layout.value, "layers": layers, "element_dim": elem,
        "variant": layer_call.bound.variant_for(*layer_call.placed[0]).variant,
        "layer_MiB": per_layer / 2**20,
        "paced": events_us(lambda: layer_call(0), False) / layers,
        "queued": events_us(issue_timed, True) / layers,
        "all": events_us(lambda: calls[Op.LOAD_ALL](0), False) / layers,
        "dma": events_us(dma, True) / layers,
        "ceiling": events_us(lambda: dst.copy_(src, non_blocking=True), False) / layers,
    }
    row["cpu"] = sorted(cpu)[len(cpu) // 2]
    for c_ in calls.values():
        c_.check_completions()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [probe(args.backend, *shape) for shape in SHAPES]
    cols = ["kind", "layout", "layers", "element_dim", "variant", "layer_MiB", "paced",
            "queued", "cpu", "all", "dma", "ceiling"]
    print(" ".join(f"{c:>11}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>11.2f}" if isinstance(r[c], float) else f"{r[c]!s:>11}"
                       for c in cols))
    print("us per layer call; ratio to ceiling = ceiling / column")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
