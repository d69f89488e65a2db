"""How far below today's ``write()`` a single flat function could go, on the null device.

``write()`` of one page (MHA, page_first, device indices on the device) against ``floor``: one
function that does only what such a call must do, with the controller's own objects and the
same library call (``kvio_write_back_staged_after`` of ``scripts/null_kvio.c``): take the
lock, check the tensor's form, take a page, make its host-index tensor, look up the streams,
issue the bounds, call the library, and queue the ack. It skips every general case (host
indices given, other variants, several pool-group members, plan-API checks), so it is a
bound on what flattening the Python path could save, not a path kvcore could ship as is.
Then the floor's parts, each timed alone in a warm loop.

    python scripts/probe_write_floor.py [--calls 4000]

Runs where ``scripts/probe_null_device.py`` does (a C compiler, kvio_cuda's capabilities).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import probe_null_device as null  # (scripts/ is on the path of a script run from there)
import torch

from kvcore.layout import Op
from kvcore.native_job import NativeJob
from kvcore.streams import current_stream
from kvcore.testing.stand_in_streams import stand_in_streams

NEEDED = ("overlapped", "k_ptrs", "v_ptrs", "num_layers", "host_base", "layout", "issue", "raw",
          "staging_of", "lib", "host_tokens", "device_tokens")


def runner_cells(ctl: Any) -> dict[str, Any]:
    """The prepared write-back runner's bound values (kvcore.native's closure)."""
    run = next(iter(ctl.bound[(0, Op.WRITE_BACK)]._runners.values()))
    cells = dict(zip(run.__code__.co_freevars,
                     (c.cell_contents for c in run.__closure__ or ()), strict=True))
    missing = [n for n in NEEDED if n not in cells]
    if missing:
        raise SystemExit(f"the staged write-back runner no longer binds {missing}: update "
                         "this probe to kvcore.native's _staged_async_runner")
    return cells


def flat_write(ctl: Any) -> Callable[[torch.Tensor], Any]:
    """The floor: one page, device indices on the device, no general case."""
    c = runner_cells(ctl)
    call, issue, raw, staging_of, lib = (c["overlapped"], c["issue"], c["raw"],
                                         c["staging_of"], c["lib"])
    fixed = (c["k_ptrs"], c["v_ptrs"], c["num_layers"], c["host_base"], c["layout"])
    host_tokens, device_tokens = c["host_tokens"], c["device_tokens"]
    alloc, lock, health, queue, issued = (ctl.allocator, ctl._lock, ctl._health, ctl._writes,
                                          ctl._issued)
    stream, device, page = ctl.write_stream, null.DEVICE, null.P
    int64, int32, from_numpy = torch.int64, torch.int32, torch.from_numpy

    def write(d: torch.Tensor) -> Any:
        with lock:
            if health.lost is not None:
                raise RuntimeError("lost")
            if (type(d) is not torch.Tensor or d.dtype not in (int64, int32) or d.dim() != 1
                    or d.device != device or not d.is_contiguous() or d.numel() != page):
                raise ValueError("device_indices")
            with alloc._lock:
                top = alloc._top
                p = int(alloc._free[top - 1])
                alloc._taken[p] = True
                alloc._top = top - 1
                tokens = alloc._tokens[p].copy()
            h = from_numpy(tokens)
            s = raw(stream)
            after = raw(current_stream(device))
            done = issue(host_tokens, device_tokens, Op.WRITE_BACK)
            staging = staging_of(s)
            out = ctypes.c_void_p()
            call(*fixed, h.data_ptr(), d.data_ptr(), 1 if d.dtype is int64 else 0, page,
                 staging.data_ptr(), staging.numel(), 0, s or None, after or None, done.bounds,
                 ctypes.byref(out))
            job = NativeJob(lib, out.value or 0, done, (h, d, staging),
                            "kvio_write_back_staged_after")
            issued.add(h, tokens)
            return queue.add(h, d, job, [job], True)

    return write


def median_us(fn: Callable[[], Any], calls: int, after: Callable[[int], None] | None = None,
              ) -> float:
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(i)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, stand_in_streams(null.DEVICE.type,
                                                                None) as current:
        registry = null.null_registry(null.build_library(Path(tmp)), current)
        ctl = null.controller(registry, "mha", "page_first", 1)
        d = torch.arange(null.P, device=null.DEVICE)
        flat = flat_write(ctl)

        def acks(i: int) -> None:  # as the bench's queues: acks taken between writes
            if i % 2:
                for ack in ctl.poll_acks():
                    ctl.free_host(ack.host_indices)

        print("| path | median us per call |\n|---|---|")
        for _ in range(2):
            print(f"| write() | {median_us(lambda: ctl.write(d), args.calls, acks):.1f} |")
            print(f"| floor | {median_us(lambda: flat(d), args.calls, acks):.1f} |")
        c = runner_cells(ctl)
        s = c["raw"](ctl.write_stream)
        tokens = ctl.allocator._tokens[0]
        h = torch.from_numpy(tokens.copy())
        done = c["issue"](c["host_tokens"], c["device_tokens"], Op.WRITE_BACK)
        staging = c["staging_of"](s)
        out = ctypes.c_void_p()
        fixed = (c["k_ptrs"], c["v_ptrs"], c["num_layers"], c["host_base"], c["layout"])
        parts: dict[str, Callable[[], Any]] = {
            "host-index tensor (copy, torch.from_numpy)": lambda: torch.from_numpy(
                tokens.copy()),
            "bounds (ReportRing.issue)": lambda: c["issue"](
                c["host_tokens"], c["device_tokens"], Op.WRITE_BACK),
            "library call (ctypes, 16 arguments)": lambda: c["overlapped"](
                *fixed, h.data_ptr(), d.data_ptr(), 1, null.P, staging.data_ptr(),
                staging.numel(), 0, s or None, s or None, done.bounds, ctypes.byref(out)),
            "stream lookups": lambda: (c["raw"](ctl.write_stream),
                                       current_stream(null.DEVICE)),
        }
        print("\n| part of the floor, warm | median us |\n|---|---|")
        for name, fn in parts.items():
            print(f"| {name} | {median_us(fn, args.calls):.2f} |")


if __name__ == "__main__":
    main()
