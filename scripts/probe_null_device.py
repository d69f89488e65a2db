"""kvcore's own CPU cost on a GPU's submit path, on a machine without a GPU.

The controller runs kvio_cuda's variants (its capabilities, kvcore.native's runners and
ctypes binding) against ``scripts/null_kvio.c``: the kvio ABI with every function doing
nothing. Streams and events are stand-ins that do nothing
(:mod:`kvcore.testing.stand_in_streams`), "device" tensors live on torch's meta device
(shapes and no data), pinned memory is plain memory. What is timed is then
kvcore's Python, NumPy and ctypes work inside ``write()`` and ``load()``, without the
runtime's calls and torch's CUDA stream and event objects (on an H200 host those added
about as much again, docs/benchmarks/h200-2026-12-04e). Use it to see what a change to the
submit path costs or saves before a GPU is at hand, not as a GPU figure.

    python scripts/probe_null_device.py                   # markdown table, median us
    python scripts/probe_null_device.py --per-layer       # SGLang's per-layer submits
    python scripts/probe_null_device.py --count           # runtime and library calls per call
    python scripts/probe_null_device.py --count --upload  # the same, host indices never inline
    python scripts/probe_null_device.py --loop write --pages 1 --seconds 8   # for py-spy:
    py-spy record --rate 4000 --format raw -o w.txt -- python scripts/probe_null_device.py \
        --loop write
    python scripts/probe_hot_path.py --summarize w.txt --root write

Needs a C compiler (``cc``) and the kvio_cuda package (its capabilities only; no CUDA).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import kvcore.controller
from kvcore.capabilities import Available, BackendSpec, Capabilities, HostMemory
from kvcore.native import NativeBackend
from kvcore.native_abi import INCLUDE_DIR, NativeLibrary
from kvcore.registry import Registry
from kvcore.testing.stand_in_streams import NullStream, stand_in_streams

HERE = Path(__file__).resolve().parent
P, LAYERS = 64, 32
DEVICE = torch.device("meta")
ROWS = (("mha", "page_first"), ("mla", "page_first"), ("mha", "layer_first"))


def build_library(folder: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("needs a C compiler (cc, gcc or clang) to build scripts/null_kvio.c")
    out = folder / "libnull_kvio.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-w", f"-I{INCLUDE_DIR}", "-o", str(out),
                    str(HERE / "null_kvio.c")], check=True)
    return out


class CountedLibrary:
    """Stands in for a ctypes library: counts each ``kvio_*`` call in ``calls``, then makes
    it."""

    def __init__(self, lib: Any, calls: collections.Counter[str]) -> None:
        self._lib, self._calls = lib, calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if not name.startswith("kvio_"):
            return fn
        calls = self._calls

        def call(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)
        return call


def null_registry(library: Path, current: NullStream,
                  calls: collections.Counter[str] | None = None) -> Registry:
    """A registry whose only backend runs kvio_cuda's variants against the null library
    (``calls``: where its library calls are counted)."""
    import kvio_cuda

    class NullCuda(NativeBackend):
        def __init__(self, device: torch.device) -> None:
            lib = NativeLibrary(library, runtime="cuda", name="null_kvio")
            if calls is not None:
                lib._lib = CountedLibrary(lib._lib, calls)
            super().__init__(device, lib)
            self.current_raw_stream = lambda: current.native_handle  # type: ignore[method-assign]
            self.current_stream_handle = self.current_raw_stream  # (as kvio_cuda's)

        def raw_stream(self, stream: Any) -> int:
            return 0 if stream is None else int(stream.native_handle)

        def allocate_host(self, shape: tuple[int, ...],
                          dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
            return torch.empty(shape, dtype=dtype), HostMemory.PLAIN

    caps = kvio_cuda.CAPABILITIES
    registry = Registry({"KVCORE_PLUGINS": ""})
    registry.register(BackendSpec(capabilities=Capabilities(
        name="null_cuda", version="0", api_version=caps.api_version, platform="null",
        priority=1000, probe=Available, ops=caps.ops, host_memory=HostMemory.PLAIN,
        device_types=frozenset({DEVICE.type})), factory=NullCuda))
    return registry


def controller(registry: Registry, kind: str, layout: str, pages: int,
               ) -> kvcore.controller.HiCacheController:
    from kvcore import DevicePool
    from kvcore.registry import allocate_host_pool

    heads, dim = (8, 128) if kind == "mha" else (1, 576)
    dev = DevicePool.allocate(kind, LAYERS, 4 * pages * P, heads, dim, torch.bfloat16, DEVICE, P)
    host = allocate_host_pool(kind, layout, LAYERS, 4 * pages * P, heads, dim, torch.bfloat16,
                              P, DEVICE, registry=registry)
    return kvcore.controller.HiCacheController(dev, host, registry=registry)


def measure(registry: Registry, kind: str, layout: str, pages: int,
            calls: int) -> tuple[float, float, float]:
    """Median us of one ``write()``, one ``load()`` of its ack's host indices, and the
    ``wait_layer`` of every layer after that load (device indices on the device, as an engine
    passes them)."""
    ctl = controller(registry, kind, layout, pages)
    d = torch.arange(pages * P, device=DEVICE)
    d2 = torch.arange(pages * P, 2 * pages * P, device=DEVICE)
    writes, loads, waits = [], [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        ctl.write(d)
        writes.append(time.perf_counter() - t0)
        for ack in ctl.poll_acks():
            t0 = time.perf_counter()
            handle = ctl.load(ack.host_indices, d2)
            t1 = time.perf_counter()
            for layer in range(LAYERS):
                handle.wait_layer(layer)
            t2 = time.perf_counter()
            loads.append(t1 - t0)
            waits.append(t2 - t1)
            ctl.free_host(ack.host_indices)
    return (1e6 * statistics.median(writes), 1e6 * statistics.median(loads),
            1e6 * statistics.median(waits))


def per_layer(registry: Registry, pages: int, indices_on: str, calls: int,
              current: NullStream) -> float:
    """Median us of one ``BoundPlan.submit(..., layer=i)`` as kvcore-sglang's hooks make it,
    32 per load with the same index tensors: both on the CPU (SGLang's "direct" io backend)
    or both on the device (its "kernel" backend moves them there first)."""
    from kvcore.layout import Op

    bound = controller(registry, "mha", "page_first", pages).bound[(0, Op.LOAD_LAYER)]
    where = DEVICE if indices_on == "device" else torch.device("cpu")
    h = torch.arange(pages * P, device=where)
    d = torch.arange(pages * P, 2 * pages * P, device=where)
    loads = []
    for _ in range(calls):
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            bound.submit(h, d, layer=layer, stream=current)
        loads.append((time.perf_counter() - t0) / LAYERS)
    return 1e6 * statistics.median(loads)


def count(registry: Registry, kind: str, layout: str, pages: int,
          calls: collections.Counter[str], upload: bool = False) -> list[dict[str, int]]:
    """What one ``write()``, one ``load()`` of its ack's host indices and the ``wait_layer``
    of every layer after it ask of the runtime (stand-in streams and events) and of the
    library: the calls of the third of each (the first two warm rings and pools up).
    ``upload``: CPU host indices go through the index ring even where they fit a launch."""
    ctl = controller(registry, kind, layout, pages)
    if upload:
        for bound in ctl.bound.values():
            bound._inline_host = dict.fromkeys(bound._inline_host, 0)
    d = torch.arange(pages * P, device=DEVICE)
    d2 = torch.arange(pages * P, 2 * pages * P, device=DEVICE)
    seen: list[dict[str, int]] = []
    for _ in range(3):
        seen.clear()
        calls.clear()
        ctl.write(d)
        seen.append(dict(calls))
        (ack,) = ctl.poll_acks()
        calls.clear()
        handle = ctl.load(ack.host_indices, d2)
        seen.append(dict(calls))
        calls.clear()
        for layer in range(LAYERS):
            handle.wait_layer(layer)
        seen.append(dict(calls))
        del handle  # (a job's release is the handle's, not the next load's)
        ctl.free_host(ack.host_indices)
    return seen


def show(counted: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counted.items())) or "none"


def loop(registry: Registry, op: str, pages: int, seconds: float, current: NullStream,
         ) -> None:
    """``op`` calls back to back for a sampling profiler (``per_layer``: 32 submits of one
    layer each with the same CPU index tensors, as kvcore-sglang's direct io backend)."""
    ctl = controller(registry, "mha", "page_first", pages)
    d = torch.arange(pages * P, device=DEVICE)
    end = time.perf_counter() + seconds
    if op == "per_layer":
        from kvcore.layout import Op

        bound = ctl.bound[(0, Op.LOAD_LAYER)]
        h, dc = torch.arange(pages * P), torch.arange(pages * P, 2 * pages * P)
        while time.perf_counter() < end:
            for layer in range(LAYERS):
                bound.submit(h, dc, layer=layer, stream=current)
        return
    if op == "write":
        while time.perf_counter() < end:
            for _ in range(4):
                ctl.write(d)
            for ack in ctl.poll_acks():
                ctl.free_host(ack.host_indices)
        return
    while time.perf_counter() < end:  # each load of a new ack's indices, as measure()'s
        ctl.write(d)
        for ack in ctl.poll_acks():
            ctl.load(ack.host_indices, d)
            ctl.free_host(ack.host_indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--pages", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--loop", choices=("write", "load", "per_layer"))
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--per-layer", action="store_true",
                    help="time per-layer submits as kvcore-sglang's hooks make them instead")
    ap.add_argument("--count", action="store_true",
                    help="count the runtime and library calls of each call instead of timing")
    ap.add_argument("--upload", action="store_true",
                    help="with --count: CPU host indices through the index ring, never in the "
                         "launch")
    args = ap.parse_args()
    calls: collections.Counter[str] | None = collections.Counter() if args.count else None
    with tempfile.TemporaryDirectory() as tmp, stand_in_streams(DEVICE.type,
                                                                calls) as current:
        registry = null_registry(build_library(Path(tmp)), current, calls)
        if calls is not None:
            print("| kind | layout | pages | write() | load() | wait_layer x32 |")
            print("|---|---|---|---|---|---|")
            for kind, layout in ROWS:
                for pages in args.pages:
                    cells = " | ".join(show(c) for c in count(registry, kind, layout, pages,
                                                              calls, args.upload))
                    print(f"| {kind} | {layout} | {pages} | {cells} |", flush=True)
            return
        if args.loop:
            loop(registry, args.loop, args.pages[0], args.seconds, current)
            return
        if args.per_layer:
            print("| pages | indices on | one submit(layer=i) us |")
            print("|---|---|---|")
            for pages in args.pages:
                for on in ("cpu", "device"):
                    us = per_layer(registry, pages, on, max(1, args.calls // 10), current)
                    print(f"| {pages} | {on} | {us:.1f} |", flush=True)
            return
        print("| kind | layout | pages | write() us | load() us | wait_layer x32 us |")
        print("|---|---|---|---|---|---|")
        for kind, layout in ROWS:
            for pages in args.pages:
                w, ld, wt = measure(registry, kind, layout, pages, args.calls)
                print(f"| {kind} | {layout} | {pages} | {w:.1f} | {ld:.1f} | {wt:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
