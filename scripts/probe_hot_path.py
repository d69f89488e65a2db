"""Controller calls in a loop for a sampling profiler: where one write() or load() spends its
CPU time, Python and native frames alike, without a tracing profiler's per-call cost.

    py-spy record --native --rate 2000 --format raw -o write.txt -- \
        python scripts/probe_hot_path.py --op write --pages 1 --seconds 6
    python scripts/probe_hot_path.py --summarize write.txt --root write

MHA, 32 layers, 8 x 128 bf16, 64-token pages, device indices on the device. Writes are acked
and their slots freed every ``--batch`` calls, loads waited for every ``--batch`` calls (what
that waiting costs is outside the call being profiled). ``--summarize`` reads py-spy's raw
(collapsed) output and prints, for the samples under the frame named ``--root``, the share of
each function (self and total).
"""

from __future__ import annotations

import argparse
import collections
import time

P, LAYERS = 64, 32


def run(op: str, pages: int, seconds: float, batch: int, layout: str, device: str) -> None:
    import torch

    from kvcore import DevicePool, HiCacheController
    from kvcore.registry import allocate_host_pool

    dev = DevicePool.allocate("mha", LAYERS, 4 * pages * P, 8, 128, torch.bfloat16, device, P)
    host = allocate_host_pool("mha", layout, LAYERS, (batch + 1) * pages * P, 8, 128,
                              torch.bfloat16, P, device)
    ctl = HiCacheController(dev, host)
    d = torch.arange(pages * P, device=device)
    sync = torch.get_device_module(device).synchronize if device != "cpu" else lambda: None
    calls = 0
    cpu = 0.0
    end = time.perf_counter() + seconds
    if op == "write":
        while time.perf_counter() < end:
            for _ in range(batch):
                t0 = time.perf_counter()
                ctl.write(d)
                cpu += time.perf_counter() - t0
            calls += batch
            for ack in ctl.wait_acks():
                ctl.free_host(ack.host_indices)
    else:
        acks = [ctl.write(d) for _ in range(batch)]
        ctl.wait_acks()
        d2 = torch.arange(pages * P, 2 * pages * P, device=device)
        while time.perf_counter() < end:
            for a in acks:
                t0 = time.perf_counter()
                h = ctl.load(a.host_indices, d2)
                cpu += time.perf_counter() - t0
                for layer in range(LAYERS):
                    h.wait_layer(layer)
            calls += batch
            sync()
    print(f"{op} {pages}p: {calls} calls, {1e6 * cpu / max(calls, 1):.1f} us per call "
          "(mean, under the sampler)")


def _function(frame: str) -> str:
    """``name (file:line)`` -> ``name (file)``."""
    head, _, rest = frame.partition(" (")
    return f"{head} ({rest.rsplit(':', 1)[0].rstrip(')')})" if rest else head


def summarize(path: str, root: str, top: int) -> None:
    """Shares of the samples whose stack holds a frame of function ``root``: per function
    with everything below it, per function as the leaf, and per leaf line."""
    totals: collections.Counter[str] = collections.Counter()
    selfs: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    n = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            # py-spy names methods Class.method: HiCacheController.write matches "write"
            hits = [i for i, fr in enumerate(frames)
                    if (name := fr.split(" (")[0]) == root or name.endswith("." + root)]
            if not hits:
                continue
            below = frames[hits[0]:]
            k = int(count)
            n += k
            lines[below[-1]] += k
            selfs[_function(below[-1])] += k
            for fn in {_function(fr) for fr in below}:
                totals[fn] += k
    print(f"{n} samples under {root!r}")
    for title, counter in (("total (the function and below)", totals),
                           ("self (the function as the leaf)", selfs),
                           ("leaf lines", lines)):
        print(f"-- {title}")
        for key, k in counter.most_common(top):
            print(f"{100 * k / max(n, 1):6.1f}%  {key[:150]}")  # C++ templates run long


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=("write", "load"), default="write")
    ap.add_argument("--pages", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--summarize")
    ap.add_argument("--root", default="write")
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.root, args.top)
    else:
        run(args.op, args.pages, args.seconds, args.batch, args.layout, args.device)


if __name__ == "__main__":
    main()
