"""Why the signaled per-layer load lost 3% of its rate between h200-2026-12-04 and
h200-2026-12-05 (seed table, kernel path: every signaled row -3.0% GiB/s, every other variant
within 0.2%; the kernel's hot loop compiles to the same SASS).

The same submit of every layer (one signaled grid, indices placed on the device), timed with
events over back-to-back calls, against one contiguous copy of the same bytes:

- ``shipped``: ready flags in pinned host memory, counters zeroed by a memset before each
  launch (what main did then; the kernel now leaves them zero itself);
- ``device flags``: the flags in device memory (as at h200-2026-12-04), nothing else changed;
- ``per-layer launches``: the same load as one plain copy launch per layer (no signals).

    python scripts/probe_signaled_flags.py      # on a CUDA machine; prints a markdown table
"""

# ruff: noqa: B023  (each closure is called inside its loop turn)
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

import kvcore.native
from kvcore import DevicePool
from kvcore.layout import Op
from kvcore.plan import BoundPlan
from kvcore.registry import allocate_host_pool, default_registry, make_request

PAGE, PAGES, CALLS, REPEAT = 64, 64, 8, 5
SHAPES = [("mha", "page_first", 32, 8), ("mha", "layer_first", 32, 2), ("mla", "page_first", 32, 1)]


def device_flags(self: kvcore.native.SignalBuffer, device: torch.device, capacity: int) -> None:
    self.capacity = capacity
    self.counter_memory = torch.zeros(capacity, dtype=torch.int32, device=device)
    self.flag_memory = torch.zeros(capacity, dtype=torch.int32, device=device)
    self.counters = self.counter_memory.data_ptr()
    self.flags = self.flag_memory.data_ptr()
    self.landed = np.zeros(capacity, dtype="<u4")  # (never read as landed: no waits here)
    self.epoch = 0


def timed(fn: Callable[[], object], stream: torch.cuda.Stream) -> float:
    """Median ms per call of ``CALLS`` back-to-back calls."""
    out = []
    for _ in range(REPEAT + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # the calls are all queued before the first starts
        start.record(stream)
        for _ in range(CALLS):
            fn()
        end.record(stream)
        end.synchronize()
        out.append(start.elapsed_time(end) / CALLS)
    return statistics.median(out[1:])


class Case(NamedTuple):
    """One shape's bound per-layer load, its indices, and the buffers of its ceiling copy."""

    bound: BoundPlan
    host_idx: torch.Tensor
    device_idx: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    nbytes: int


def make_case(kind: str, layout: str, layers: int, heads: int) -> Case:
    """A cuda per-layer load of ``PAGES`` random pages of random host bytes, indices on the
    device."""
    dim = 128 if kind == "mha" else 576
    dev = DevicePool.allocate(kind, layers, 2 * PAGES * PAGE, heads, dim, torch.bfloat16,
                              "cuda", PAGE)
    host = allocate_host_pool(kind, layout, layers, 2 * PAGES * PAGE, heads, dim,
                              torch.bfloat16, PAGE, "cuda")
    host.buffer.view(torch.int16).random_()
    elem = heads * dim * 2
    plan = default_registry().resolve(make_request(Op.LOAD_LAYER, kind, layout,
                                                   torch.bfloat16, elem, "cuda"))
    pages = torch.randperm(2 * PAGES)[:PAGES]
    h = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten().cuda()
    d = (torch.randperm(2 * PAGES)[:PAGES, None] * PAGE + torch.arange(PAGE)).flatten().cuda()
    nbytes = (2 if kind == "mha" else 1) * layers * PAGES * PAGE * elem
    return Case(plan.bind(dev, host), h, d,
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                torch.empty(nbytes, dtype=torch.uint8, device="cuda"), nbytes)


def main() -> None:
    print("| kind | layout | layers | heads | MiB | path | ms/call | ceiling ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    shipped_init = kvcore.native.SignalBuffer.__init__
    for kind, layout, layers, heads in SHAPES:
        bound, h, d, src, dst, nbytes = make_case(kind, layout, layers, heads)
        rows = []
        for path in ("shipped", "device flags", "per-layer launches", "shipped"):
            stream = torch.cuda.Stream()  # a new stream: a new signal buffer
            kvcore.native.SignalBuffer.__init__ = (  # type: ignore[method-assign]
                device_flags if path == "device flags" else shipped_init)
            with torch.cuda.stream(stream):
                if path == "per-layer launches":
                    def call() -> None:
                        for layer in range(layers):
                            bound.submit(h, d, layer=layer, stream=stream, check=False,
                                         chained=layer > 0)
                else:
                    def call() -> None:
                        bound.submit(h, d, stream=stream, check=False)
                call()
                ms = timed(call, stream)
                ceil = timed(lambda: dst.copy_(src, non_blocking=True), stream)
            rows.append((path, ms, ceil))
        kvcore.native.SignalBuffer.__init__ = shipped_init  # type: ignore[method-assign]
        for path, ms, ceil in rows:
            print(f"| {kind} | {layout} | {layers} | {heads} | {nbytes / 2**20:.0f} | {path} | "
                  f"{ms:.3f} | {ceil:.3f} | {ceil / ms:.3f} |", flush=True)
        print("variant:", bound.variant_for(h, d).variant)


if __name__ == "__main__":
    main()
