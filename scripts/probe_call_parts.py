"""What one controller call costs on the CPU, part by part: each piece of the submit path timed
alone (median of many calls, no profiler), then write(), load() and wait_layer() whole, for
1, 4, 16 and 64 pages (MHA, 32 layers, 8 x 128 bf16, page_first, 64-token pages, device
indices on the device), each controller call queued back to back and with the device idle,
and one MLA page. Run on a GPU machine:

    python scripts/probe_call_parts.py [--json FILE]
"""

# ruff: noqa: B023  (each lambda is called at once, inside its loop turn)
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcore import DevicePool, HiCacheController
from kvcore.layout import Op
from kvcore.registry import allocate_host_pool, default_registry
from kvcore.streams import recorded_event

RESULTS: dict[str, float] = {}


class Spy:
    """Stands in for a ctypes library: records the last call of each function, then makes it."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.calls: dict[str, tuple[Any, ...]] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.lib, name)
        if not name.startswith("kvio_"):
            return fn

        def call(*a: Any) -> Any:
            self.calls[name] = a
            return fn(*a)
        return call


def timed(name: str, fn: Callable[[], Any], n: int = 400, every: Callable[[], Any] | None = None,
          before: Callable[[], Any] | None = None) -> None:
    """Median microseconds of ``fn`` over ``n`` calls (``before`` runs untimed before each,
    ``every`` after each)."""
    samples = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if every is not None:
            every()
    us = 1e6 * statistics.median(samples)
    RESULTS[name] = round(us, 2)
    print(f"{name:58s} {us:8.2f} us", flush=True)


def raw_calls(dev: DevicePool, host: Any, tag: str, submit: Callable[[Any], Any]) -> None:
    """The library's own cost of each call a controller of ``dev`` and ``host`` makes: a
    controller built while the cuda backend's ctypes library is spied on (its prepared
    runners take their functions when it is built) runs ``submit(controller)`` once; then
    each library function it called is timed alone with the same arguments, the device idle
    before each. A job a call hands out is waited for and given back after each; the job
    functions themselves are not timed (a handle may be given back once only)."""
    lib = default_registry().instance("cuda", dev.device).lib
    spy = Spy(lib._lib)
    lib._lib = spy
    try:
        submit(HiCacheController(dev, host))
        torch.cuda.synchronize()
    finally:
        lib._lib = spy.lib
    real = spy.lib
    for name, a in spy.calls.items():
        if name.startswith("kvio_job"):
            continue
        fn = getattr(real, name)
        out = getattr(a[-1], "_obj", None) if a else None  # a job handed out, if any

        def settle(out: Any = out) -> None:
            if isinstance(out, ctypes.c_void_p) and out.value:
                real.kvio_job_wait(out)
                real.kvio_job_release(out)
            torch.cuda.synchronize()

        timed(f"{tag} raw {name}", lambda fn=fn, a=a: fn(*a), n=50, every=settle)


def write_then_load(ctl: Any, d: torch.Tensor) -> None:
    """One write-back of ``d`` and one load of it back, as an engine makes them."""
    ack = ctl.write(d)
    ctl.wait_acks()
    ctl.load(ack.host_indices, d).wait()
    ctl.free_host(ack.host_indices)


def idle_calls(ctl: Any, d: torch.Tensor, tag: str, n: int) -> None:
    """``write()`` and ``load()`` each timed with the device idle (synchronized after every
    call): set against the queued calls' times, what a deep queue adds to the runtime's
    calls."""
    acks: list[Any] = []
    # (a write a library thread issues is done once acknowledged, not once the device is idle)
    timed(f"{tag} ctl.write(d) (device idle)", lambda: acks.append(ctl.write(d)), n=n,
          every=lambda: (ctl.wait_acks(), torch.cuda.synchronize()))
    ctl.wait_acks()
    it = iter(acks)
    timed(f"{tag} ctl.load(ack.host_indices, d) (device idle)",
          lambda: ctl.load(next(it).host_indices, d), n=n, every=torch.cuda.synchronize)
    torch.cuda.synchronize()
    for a in acks:
        ctl.free_host(a.host_indices)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev_name = "cuda"
    idx = torch.cuda.current_device()
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record()
    t64 = torch.arange(64, device=dev_name)
    cpu64 = torch.arange(64)
    cpu4k = torch.arange(4096)
    timed("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
    timed("torch.cuda.current_stream(idx)", lambda: torch.cuda.current_stream(idx))
    timed("torch._C._cuda_getCurrentRawStream(idx)",
          lambda: torch._C._cuda_getCurrentRawStream(idx))
    print("torch.Stream has native_handle:", hasattr(torch.Stream, "native_handle"),
          "cuda Stream is torch.Stream:", isinstance(s, torch.Stream),
          "cuda Event is torch.Event:", isinstance(ev, torch.Event),
          "accelerator stream type:", type(torch.accelerator.current_stream(idx)))
    gs = torch.accelerator.current_stream(idx)
    if hasattr(gs, "native_handle"):
        timed("generic stream.native_handle", lambda: gs.native_handle)
    gev = torch.Event(device=dev_name)
    timed("torch.Event(device) + record(generic stream)", lambda: torch.Event(device=dev_name)
          .record(gs))
    gev.record(gs)
    timed("generic stream.wait_event(torch.Event)", lambda: gs.wait_event(gev))
    try:
        timed("cuda stream.wait_event(torch.Event)", lambda: s.wait_event(gev), n=20)
    except Exception as exc:  # noqa: BLE001
        print("cuda stream.wait_event(torch.Event) fails:", exc)
    try:
        timed("torch.Event.record(cuda stream)", lambda: gev.record(s), n=20)
    except Exception as exc:  # noqa: BLE001
        print("torch.Event.record(cuda stream) fails:", exc)
    timed("torch.accelerator.current_stream(idx)", lambda: torch.accelerator.current_stream(idx))
    timed("torch.cuda.Event()", lambda: torch.cuda.Event())
    timed("event.record(stream)", lambda: ev.record(s))
    timed("Event() + record", lambda: torch.cuda.Event().record(s))
    timed("stream.wait_event(event)", lambda: s.wait_event(ev))
    timed("event.query()", lambda: ev.query())
    timed("tensor.record_stream(stream)", lambda: t64.record_stream(s))
    timed("stream.cuda_stream", lambda: s.cuda_stream)
    timed("pinned empty(64)", lambda: torch.empty(64, dtype=torch.int64, pin_memory=True))
    pinned = torch.empty(64, dtype=torch.int64, pin_memory=True)
    timed("pinned.copy_(cpu64)", lambda: pinned.copy_(cpu64))
    timed("pinned64.to(cuda, non_blocking)", lambda: pinned.to(dev_name, non_blocking=True))
    dst = torch.empty(64, dtype=torch.int64, device=dev_name)
    timed("dev64.copy_(pinned64, non_blocking)", lambda: dst.copy_(pinned, non_blocking=True))
    timed("torch.empty(64, cuda)", lambda: torch.empty(64, dtype=torch.int64, device=dev_name))
    timed("cpu4k.numpy().min()/max()", lambda: (cpu4k.numpy().min(), cpu4k.numpy().max()))
    P, L = 64, 32
    for pages in (1, 4, 16, 64):
        n = pages * P
        dev = DevicePool.allocate("mha", L, 2 * n, 8, 128, torch.bfloat16, dev_name, P)
        calls = {1: 200, 4: 50, 16: 20, 64: 8}[pages]
        host = allocate_host_pool("mha", "page_first", L, (calls + 8) * n, 8, 128,
                                  torch.bfloat16, P, dev_name)
        d = torch.arange(n, device=dev_name)
        raw_calls(dev, host, f"[{pages}p]", lambda c: write_then_load(c, d))
        ctl = HiCacheController(dev, host)
        wb = ctl.bound[(0, Op.WRITE_BACK)]
        ll = ctl.bound[(0, Op.LOAD_LAYER)]
        h = ctl.allocator.alloc(n)
        hp, dp = wb.place(h, d)
        timed(f"[{pages}p] allocator.alloc+free", lambda: ctl.allocator.free(
            ctl.allocator.alloc(n)))
        timed(f"[{pages}p] bound.check(write, trusted)",
              lambda: wb.check(h, d, host_trusted=True))
        timed(f"[{pages}p] bound.check(write, untrusted)", lambda: wb.check(h, d))
        timed(f"[{pages}p] write bound.submit(check=False) on s",
              lambda: wb.submit(hp, dp, stream=s, check=False), n=50,
              every=torch.cuda.synchronize)
        torch.cuda.synchronize()
        lhp, ldp = ll.place(h, d)
        torch.cuda.synchronize()
        timed(f"[{pages}p] load_layer bound.place(cpu h, dev d)", lambda: ll.place(h, d),
              n=100)
        torch.cuda.synchronize()
        timed(f"[{pages}p] load_layer bound.submit(placed, check=False) on s",
              lambda: ll.submit(lhp, ldp, stream=s, check=False), n=50,
              every=torch.cuda.synchronize)
        # the submit's two runtime-side parts alone: the prepared runner (the signaled launch)
        # and the completion event recorded behind it. Both grow with the page count only
        # right after a synchronize() that waited for the previous load (h100-2026-12-05b)
        run = ll._lanes[False][False].run
        timed(f"[{pages}p] load_layer runner alone (placed) on s",
              lambda: run(lhp, ldp, None, s, False), n=50, every=torch.cuda.synchronize)
        timed(f"[{pages}p] recorded_event(s) after the runner",
              lambda: recorded_event(ll.device, s), n=50,
              before=lambda: (torch.cuda.synchronize(), run(lhp, ldp, None, s, False)))
        torch.cuda.synchronize()
        timed(f"[{pages}p] recorded_event(s), device idle", lambda: recorded_event(ll.device, s),
              n=50, every=torch.cuda.synchronize)
        torch.cuda.synchronize()
        sub = ll.submit(lhp, ldp, stream=s, check=False)
        cur = torch.cuda.current_stream()
        timed(f"[{pages}p] Submission.wait_layer(0, stream)", lambda: sub.wait_layer(0, cur))
        torch.cuda.synchronize()
        idle_calls(ctl, d, f"[{pages}p]", calls)  # (the host pool holds `calls` more)
        acks: list[Any] = []
        timed(f"[{pages}p] ctl.write(d)", lambda: acks.append(ctl.write(d)), n=calls)
        timed(f"[{pages}p] ctl.poll_acks() (all done)", lambda: ctl.wait_acks(), n=1)
        torch.cuda.synchronize()
        timed(f"[{pages}p] ctl.poll_acks() (empty)", lambda: ctl.poll_acks())
        it = iter(acks)
        handles: list[Any] = []
        timed(f"[{pages}p] ctl.load(ack.host_indices, d)",
              lambda: handles.append(ctl.load(next(it).host_indices, d)), n=calls)
        torch.cuda.synchronize()
        hs = iter(handles)
        timed(f"[{pages}p] handle.wait_layer x{L}",
              lambda: [hd.wait_layer(i) for hd in (next(hs),) for i in range(L)], n=calls)
        torch.cuda.synchronize()
        for a in acks:
            ctl.free_host(a.host_indices)
        ctl.allocator.free(h)
        del ctl, dev, host
    # one MLA page (2 MiB; MHA's is 8): on h200-2026-12-04e a queued one-page write() took
    # 34 us of CPU for MLA against 64 us for MHA, with the same Python path
    n = P
    dev = DevicePool.allocate("mla", L, 2 * n, 1, 576, torch.bfloat16, dev_name, P)
    host = allocate_host_pool("mla", "page_first", L, 208 * n, 1, 576, torch.bfloat16, P,
                              dev_name)
    d = torch.arange(n, device=dev_name)
    raw_calls(dev, host, "[mla 1p]", lambda c: write_then_load(c, d))
    ctl = HiCacheController(dev, host)
    idle_calls(ctl, d, "[mla 1p]", 200)
    acks = []
    timed("[mla 1p] ctl.write(d)", lambda: acks.append(ctl.write(d)), n=200)
    ctl.wait_acks()
    torch.cuda.synchronize()
    for a in acks:
        ctl.free_host(a.host_indices)
    del ctl, dev, host
    # the copy-engine per-layer load from layer_first: 16 pages of 128-KiB slices per layer
    n = 16 * P
    dev = DevicePool.allocate("mha", L, 2 * n, 8, 128, torch.bfloat16, dev_name, P)
    host = allocate_host_pool("mha", "layer_first", L, 2 * n, 8, 128, torch.bfloat16, P,
                              dev_name)
    d = torch.arange(n, device=dev_name)
    raw_calls(dev, host, "[lf16p]", lambda c: c.bound[(0, Op.LOAD_LAYER)].submit(
        torch.arange(n), d.cpu(), stream=s, layer=3))
    ctl = HiCacheController(dev, host)
    ll = ctl.bound[(0, Op.LOAD_LAYER)]
    print("layer_first per-layer load variant:", ll.support.variant)
    h = ctl.allocator.alloc(n)
    hp, dp = ll.place(h, d.cpu())
    timed("[lf16p] load_layer bound.submit(layer=3, placed) on s",
          lambda: ll.submit(hp, dp, stream=s, layer=3, check=False), n=50,
          every=torch.cuda.synchronize)
    timed("[lf16p] load_layer bound.submit(all layers, placed) on s",
          lambda: ll.submit(hp, dp, stream=s, check=False), n=20,
          every=torch.cuda.synchronize)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
