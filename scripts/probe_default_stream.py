"""Per-layer loads from layer_first through the plan on the legacy default stream, against a
side stream and one contiguous copy of the same bytes (issue 21: page slices of 128 KiB and
more go to the copy engine, which must not fall back to one copy per page on that stream).

Ways of calling: ``one submit`` is what the controller does (one ``submit`` moving every
layer, the indices checked once); ``per layer`` is one checked ``submit(layer=i)`` per layer,
as an engine driving the plan itself layer by layer would. The others ask why per-layer calls
ran faster on the device than one submit of the same copies (h200-2026-12-04e, 256-KiB
slices: 0.94-0.99 against 0.88-0.91): ``per layer, placed`` leaves the checks out (the CPU
runs further ahead); ``per layer, N us apart`` spaces the layers' copies on the CPU;
``one submit, queued`` issues the whole load behind 20 ms of work on the stream, so every
copy is queued before the first starts. If queued copies run slower than spaced ones, the
depth of the queue, not the calls, is what costs.

    python scripts/probe_default_stream.py     # on a CUDA machine; prints a markdown table
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcore import DevicePool
from kvcore.layout import Op
from kvcore.registry import allocate_host_pool, default_registry, make_request

LAYERS, PAGE, PAGES, REPEAT = 32, 64, 16, 7


def _time(fn, stream: torch.cuda.Stream,  # type: ignore[no-untyped-def]
          queued: bool = False) -> float:
    times = []
    for _ in range(REPEAT + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:  # every copy is enqueued while the stream still runs this
            torch.cuda._sleep(20_000_000)  # about 10-20 ms of clock cycles
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def main() -> None:
    print("| heads x dim | slice KiB | stream | variant | calls | ms | ceiling ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for heads in (8, 16):
        dev = DevicePool.allocate("mha", LAYERS, 4 * PAGES * PAGE, heads, 128, torch.bfloat16,
                                  "cuda", PAGE)
        host = allocate_host_pool("mha", "layer_first", LAYERS, 4 * PAGES * PAGE, heads, 128,
                                  torch.bfloat16, PAGE, "cuda")
        host.buffer.view(torch.int16).random_()
        plan = default_registry().resolve(make_request(Op.LOAD_LAYER, "mha", "layer_first",
                                                       torch.bfloat16, heads * 256, "cuda"))
        bound = plan.bind(dev, host)
        pages = torch.randperm(4 * PAGES)[:PAGES]
        h = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        d = (torch.randperm(4 * PAGES)[:PAGES, None] * PAGE + torch.arange(PAGE)).flatten()
        nbytes = 2 * LAYERS * PAGES * PAGE * heads * 256
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for name, stream in (("default (legacy)", torch.cuda.default_stream()),
                             ("side", torch.cuda.Stream())):
            for calls in CALLS:
                ms, ceil = _measure(bound, h, d, src, dst, stream, calls)
                print(f"| {heads} x 128 | {PAGE * heads * 256 // 1024} | {name} | "
                      f"{bound.variant_for(h, d).variant} | {calls} | {ms:.3f} | {ceil:.3f} | "
                      f"{ceil / ms:.3f} |")

CALLS = ("one submit", "per layer", "per layer, placed", "per layer, 20 us apart",
         "per layer, 60 us apart", "one submit, queued")


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _measure(bound, h, d, src, dst, stream, calls: str,  # type: ignore[no-untyped-def]
             ) -> tuple[float, float]:
    """(ms of a per-layer load of every layer, ms of one contiguous copy), both on ``stream``;
    the load's time starts when its first copy can start (after the 20 ms of a queued one)."""
    apart = float(calls.split()[2]) if calls.endswith("apart") else 0.0

    def load() -> None:
        if calls.startswith("one submit"):
            bound.submit(h, d, stream=stream)
            return
        placed = calls == "per layer, placed" or apart
        for layer in range(LAYERS):
            bound.submit(h, d, layer=layer, stream=stream, chained=layer > 0,
                         check=not placed)
            if apart:
                _spin(apart)

    with torch.cuda.stream(stream):
        return (_time(load, stream, queued=calls.endswith("queued")),
                _time(lambda: dst.copy_(src, non_blocking=True), stream))

if __name__ == "__main__":
    main()
