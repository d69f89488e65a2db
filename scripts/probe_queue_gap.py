"""Where a queue of per-layer loads loses time against its copies: the controller's queue
(load() then wait_layer() of every layer, as `kvio bench --through controller` times it) next
to the same loads with parts of the path taken away, and the library's own CPU cost per call.
MHA (32 layers, 8 x 128 bf16) or MLA (576 elements, ``--kind mla``), page_first, 64-token
pages. Run on a GPU machine:

    python scripts/probe_queue_gap.py [--pages 1,4,16] [--calls 64] [--kind mla]

Rows (ms per call over a queue, and its ratio to one contiguous copy of the same bytes):
  controller          load() + 32 wait_layer(), the bench's row
  controller, flag waits  the same, the last group's wait on its flag, not on the event after
                      the launch (as before NativeLayerSignals.ends_with)
  controller, upload on load stream  the same, the index ring's copies on the load stream
                      itself, not on the ring's own stream (as before IndexRing.ready)
  controller, uploaded  the same with the host indices uploaded through the index ring even
                      where they fit the launch (as before kvio_load_layers_signaled_inline)
  controller, 1 wait  load() + wait_layer(last): the caller's stream waits once
  no waits            load() alone: nothing on the caller's stream, the loads follow each other
  no waits, uploaded  the same, the host indices uploaded through the ring
  signaled, placed    the plan's submit on the load stream, indices placed, no fence, no waits
  placed, fenced      the same, ordered after the caller's stream (the controller's fence)
  cpu indices, no fence  the same with the CPU host indices as the controller passes them (in
                      the launch where they fit, kvcore.native_abi.inline_index_limit, else
                      uploaded through the index ring)
  indices in pinned memory  placed, fenced, with the host indices left in pinned host memory
                      for the kernel to read there (no upload, no event: what the ring could
                      hand a kernel that dereferences pinned memory)
  torch upload, load stream / side stream
                      placed device indices, the host indices copied by torch each call on
                      the load stream, or on a side stream the load stream waits for
  kernel time         device time of one signaled launch (events around it, median)

Then the signaled kernel alone (library calls, indices placed) in the controller's pattern:
the load stream waits for the caller's stream, the kernel raises its flags, the caller's
stream waits for each layer's flag; with the flags in pinned host memory and in device memory.
"""

# ruff: noqa: B023  (each closure runs inside its own loop turn)
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvcore import DevicePool, HiCacheController
from kvcore.layout import Op
from kvcore.native import NativeLayerSignals
from kvcore.native_abi import NativeLibrary
from kvcore.placement import IndexRing
from kvcore.registry import allocate_host_pool

P, L = 64, 32
SHAPE = {"mha": (8, 128), "mla": (1, 576)}  # heads, head dim
CALLS: dict[str, tuple[Any, ...]] = {}


def spy_unchecked() -> None:
    """Record the last arguments of every library function a prepared runner calls."""
    original = NativeLibrary.unchecked

    def unchecked(self: NativeLibrary, function: str, last: Any = None) -> Callable[..., None]:
        call = original(self, function, last) if last is not None else original(self, function)

        def recorded(*args: Any) -> None:
            CALLS[function] = (self, args)
            call(*args)
        return recorded

    NativeLibrary.unchecked = unchecked  # type: ignore[method-assign]


@contextlib.contextmanager
def uploads_on_the_transfer_stream() -> Iterator[None]:
    """The index ring copies on the stream it stages for (its upload stream set to that
    stream before each copy), and ``ready`` orders nothing: stream order covers the copy.
    Each ring gets its own upload stream back afterwards."""
    stage, ready = IndexRing._stage, IndexRing.ready
    own: dict[IndexRing, Any] = {}

    def on_stream(self: IndexRing, indices: torch.Tensor, dtype: torch.dtype, stream: Any,
                  ) -> Any:
        own.setdefault(self, self._upload_stream)
        self._upload_stream = stream
        return stage(self, indices, dtype, stream)

    IndexRing._stage = on_stream  # type: ignore[method-assign]
    IndexRing.ready = lambda self, stream: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        IndexRing._stage, IndexRing.ready = stage, ready  # type: ignore[method-assign]
        for ring, stream in own.items():
            ring._upload_stream = stream


class _Pinned:
    """A pinned CPU tensor's memory as a CUDA array (``__cuda_array_interface__``)."""

    def __init__(self, t: torch.Tensor) -> None:
        typestr = {torch.int64: "<i8", torch.int32: "<i4"}[t.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": typestr,
                                         "data": (t.data_ptr(), False), "version": 3}


def pinned_device_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned ``t``'s memory (no copy: the kernel reads host memory)."""
    view = torch.as_tensor(_Pinned(t), device="cuda")
    assert view.data_ptr() == t.data_ptr()
    return view


def ceiling_ms(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def queue_ms(body: Callable[[int], None], calls: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            body(i)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", default="1,4,16")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--kind", choices=sorted(SHAPE), default="mha")
    ap.add_argument("--rows-only", action="store_true",
                    help="only the queue rows (no library timings, no flag experiments)")
    args = ap.parse_args()
    spy_unchecked()
    for pages in (int(p) for p in args.pages.split(",")):
        probe(pages, max(8, args.calls // pages), args.rows_only, args.kind)


def probe(pages: int, calls: int, rows_only: bool = False, kind: str = "mha") -> None:
    n = pages * P
    heads, dim = SHAPE[kind]
    dev = DevicePool.allocate(kind, L, 4 * n, heads, dim, torch.bfloat16, "cuda", P)
    for t in dev.all_buffers():
        t.view(torch.int16).random_(-2**15, 2**15)
    host = allocate_host_pool(kind, "page_first", L, calls * n, heads, dim, torch.bfloat16, P,
                              "cuda")
    ctl = HiCacheController(dev, host)
    sets = [(torch.randperm(4 * pages)[:pages, None] * P + torch.arange(P)).flatten()
            .cuda() for _ in range(4)]
    hosts = [ctl.write(sets[i % 4]).host_indices for i in range(calls)]
    ctl.wait_acks()
    nbytes = (2 if kind == "mha" else 1) * L * n * heads * dim * 2
    ceil = ceiling_ms(nbytes)
    rows: list[tuple[str, float]] = []

    def load_waits(i: int) -> None:
        h = ctl.load(hosts[i], sets[(i + 1) % 4])
        for layer in range(L):
            h.wait_layer(layer)

    def load_one_wait(i: int) -> None:
        ctl.load(hosts[i], sets[(i + 1) % 4]).wait_layer(L - 1)

    def load_only(i: int) -> None:
        ctl.load(hosts[i], sets[(i + 1) % 4])

    rows.append(("controller", queue_ms(load_waits, calls)))
    ends_with = NativeLayerSignals.ends_with
    NativeLayerSignals.ends_with = lambda self, event: None  # type: ignore[method-assign]
    try:
        rows.append(("controller, flag waits", queue_ms(load_waits, calls)))
    finally:
        NativeLayerSignals.ends_with = ends_with  # type: ignore[method-assign]
    with uploads_on_the_transfer_stream():
        rows.append(("controller, upload on load stream", queue_ms(load_waits, calls)))
    ll = ctl.bound[(0, Op.LOAD_LAYER)]
    inline = ll._inline_host
    ll._inline_host = dict.fromkeys(inline, 0)  # every CPU host index through the ring
    try:
        rows.append(("controller, uploaded", queue_ms(load_waits, calls)))
        rows.append(("no waits, uploaded", queue_ms(load_only, calls)))
    finally:
        ll._inline_host = inline
    rows.append(("controller, 1 wait", queue_ms(load_one_wait, calls)))
    rows.append(("no waits", queue_ms(load_only, calls)))
    placed = [ll.place(hosts[i], sets[(i + 1) % 4]) for i in range(calls)]
    s = ctl.load_stream

    def signaled(i: int) -> None:
        ll.submit(*placed[i], stream=s, check=False)

    rows.append(("signaled, placed", queue_ms(signaled, calls)))
    caller = torch.cuda.current_stream()

    def placed_fenced(i: int) -> None:
        ll.submit(*placed[i], stream=s, after=caller, check=False)

    def cpu_indices(i: int) -> None:  # CPU host indices as the controller's, no fence
        ll.submit(hosts[i], sets[(i + 1) % 4], stream=s, check=False)

    rows.append(("placed, fenced", queue_ms(placed_fenced, calls)))
    rows.append(("cpu indices, no fence", queue_ms(cpu_indices, calls)))
    # the host indices' upload by torch, on the load stream or on a side stream the load
    # stream then waits for (an event)
    pinned = [p[0].cpu().pin_memory() for p in placed]
    targets = [p[0].clone() for p in placed]
    side, uploaded_event = torch.cuda.Stream(), torch.cuda.Event()

    def upload_on(i: int, stream: Any) -> None:
        with torch.cuda.stream(stream):
            targets[i].copy_(pinned[i], non_blocking=True)
        if stream is not s:
            uploaded_event.record(stream)
            s.wait_event(uploaded_event)
        ll.submit(targets[i], placed[i][1], stream=s, check=False)

    # the same indices, read by the kernel from pinned host memory through a device view of
    # their address (unified addressing: a pinned buffer's device address is its host one;
    # the torch-upload rows' pinned sources, which both only read)
    try:
        pinned_views = [pinned_device_view(t) for t in pinned]

        def pinned_fenced(i: int) -> None:
            ll.submit(pinned_views[i], placed[i][1], stream=s, after=caller, check=False)

        rows.append(("indices in pinned memory", queue_ms(pinned_fenced, calls)))
    except Exception as e:  # noqa: BLE001  (a probe row: say why and go on)
        print(f"  indices in pinned memory: not measured ({type(e).__name__}: {e})")
    rows.append(("torch upload, load stream", queue_ms(lambda i: upload_on(i, s), calls)))
    rows.append(("torch upload, side stream", queue_ms(lambda i: upload_on(i, side), calls)))
    kernel = []
    for i in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(s)
        ll.submit(*placed[i], stream=s, check=False)
        b.record(s)
        b.synchronize()
        kernel.append(a.elapsed_time(b))
    rows.append(("kernel time", statistics.median(kernel)))
    print(f"== {kind}, {pages} page(s), {nbytes / 2**20:g} MiB per call, {calls} calls, ceiling "
          f"{ceil:.4f} ms ({ll.support.variant})")
    for name, ms in rows:
        print(f"  {name:26s} {ms:8.4f} ms/call  ratio {ceil / ms:.3f}")
    if rows_only:
        for h in hosts:
            ctl.free_host(h)
        return
    # the library's own CPU time per call, with the arguments the queue passed: each call
    # alone (after a synchronize), then calls queued behind a sleeping kernel
    for function in ("kvio_load_layers_signaled", "kvio_copy_to_device",
                     "kvio_write_back_staged"):
        if function not in CALLS:
            continue
        lib, a = CALLS[function]
        raw = getattr(lib._lib, function)
        print(f"  raw {function:30s} {cpu_us(raw, a, 50, torch.cuda.synchronize):7.2f} us CPU")
        if function == "kvio_write_back_staged":  # one cudaMemcpyAsync per run instead
            b = (*a[:11], 0, *a[12:])
            print(f"  raw {function + ' (batched off)':30s} "
                  f"{cpu_us(raw, b, 50, torch.cuda.synchronize):7.2f} us CPU")
        if function != "kvio_copy_to_device":
            torch.cuda._sleep(5_000_000)
            print(f"  raw {function:30s} {cpu_us(raw, a, 20):7.2f} us CPU (device busy)")
            torch.cuda.synchronize()
    flag_memory(ctl, ceil, calls)
    CALLS.clear()
    for h in hosts:
        ctl.free_host(h)


def cpu_us(fn: Callable[..., Any], args: tuple[Any, ...], n: int,
           before: Callable[[], Any] | None = None) -> float:
    """Median microseconds of ``fn(*args)`` over ``n`` calls (``before`` untimed before each)."""
    samples = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def device_us(stream: Any, enqueue: Callable[[], Any]) -> float:
    """Device time of what ``enqueue`` puts on ``stream`` (the current stream), all of it
    queued before the device reaches it (behind a sleeping kernel), median of 20."""
    spans = []
    for _ in range(20):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        t0.record(stream)
        enqueue()
        t1.record(stream)
        t1.synchronize()
        spans.append(1e3 * t0.elapsed_time(t1))
    return statistics.median(spans)


def flag_memory(ctl: HiCacheController, ceil: float, calls: int) -> None:
    """The controller's stream pattern around raw signaled launches, flags here or there."""
    if "kvio_load_layers_signaled" not in CALLS or "kvio_wait_layer_signal" not in CALLS:
        return
    lib, a = CALLS["kvio_load_layers_signaled"]
    launch = lib._lib.kvio_load_layers_signaled
    wait = lib._lib.kvio_wait_layer_signal
    default = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    for caller, load, what in ((default, ctl.load_stream, "default caller stream"),
                               (default, torch.cuda.Stream(priority=-1),
                                "default caller stream, load stream of high priority"),
                               (side, ctl.load_stream, "caller on a side stream")):
        print(f"  -- {what}")
        with torch.cuda.stream(caller):
            flag_waits(load, caller, launch, wait, a, ceil, calls)


def flag_waits(load: Any, caller: Any, launch: Any, wait: Any, a: tuple[Any, ...],
               ceil: float, calls: int) -> None:
    ls, cs = load.cuda_stream, caller.cuda_stream
    event = torch.cuda.Event()
    counters = torch.zeros(128, dtype=torch.int32, device="cuda")
    for where in ("pinned", "device"):
        flags = (torch.zeros(128, dtype=torch.int32, pin_memory=True) if where == "pinned"
                 else torch.zeros(128, dtype=torch.int32, device="cuda"))
        base = flags.data_ptr()
        epoch = [0]

        def launch_one(fence: bool) -> int:
            """One signaled launch on the load stream (after the caller's stream where
            ``fence``); its epoch."""
            epoch[0] += 1
            e = epoch[0]
            if fence:
                event.record(caller)
                load.wait_event(event)
            args = list(a)
            args[10], args[11], args[12], args[13] = counters.data_ptr(), base, e, ls
            assert launch(*args) == 0
            return e

        def one(i: int, waits: int, fence: bool) -> None:
            e = launch_one(fence)
            for layer in range(L - waits, L):
                assert wait(base + 4 * layer, e, cs) == 0

        for waits, fence in ((L, True), (1, True), (L, False), (0, True)):
            ms = queue_ms(lambda i, w=waits, f=fence: one(i, w, f), calls)
            print(f"  raw signaled, flags {where:6s} {waits:2d} waits, fence {fence!s:5s} "
                  f"{ms:8.4f} ms/call  ratio {ceil / ms:.3f}")

        def same_flag(i: int) -> None:  # 32 waits, all for the last layer's flag
            e = launch_one(True)
            for _ in range(L):
                assert wait(base + 4 * (L - 1), e, cs) == 0

        ms = queue_ms(same_flag, calls)
        print(f"  raw signaled, flags {where:6s} 32 waits on the last flag      "
              f"{ms:8.4f} ms/call  ratio {ceil / ms:.3f}")
        end = torch.cuda.Event()

        def end_event(i: int) -> None:  # the caller waits for an event after the kernel
            launch_one(True)
            end.record(load)
            caller.wait_event(end)

        ms = queue_ms(end_event, calls)
        print(f"  raw signaled, flags {where:6s} 1 event wait instead, fence  "
              f"{ms:8.4f} ms/call  ratio {ceil / ms:.3f}")
        e = epoch[0]
        us = device_us(caller, lambda: [wait(base + 4 * la, e, cs) for la in range(L)])
        print(f"  device time of 32 satisfied flag waits ({where}): {us:6.1f} us")
    done = torch.cuda.Event()
    done.record(load)
    torch.cuda.synchronize()
    print(f"  device time of 32 satisfied event waits: "
          f"{device_us(caller, lambda: [caller.wait_event(done) for _ in range(L)]):6.1f} us")
    print(f"  device time of 32 tiny kernels: "
          f"{device_us(caller, lambda: [torch.cuda._sleep(1) for _ in range(L)]):6.1f} us")
    print(f"  device time of nothing: {device_us(caller, lambda: None):6.1f} us")


if __name__ == "__main__":
    main()
