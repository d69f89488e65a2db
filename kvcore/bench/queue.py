"""Rows through the controller: the path an engine calls, as a queue of back-to-back calls.

A kernel-path row times one submit with indices placed in advance; an engine instead calls
:class:`~kvcore.controller.HiCacheController` from its scheduler thread, many times, with
device indices on the device and host indices on the CPU, and never waits. A queue row does
exactly that: ``calls`` write-backs followed by polling their acks, or ``calls`` per-layer
loads each followed by ``wait_layer`` of every layer on the caller's stream, and reports

- ``ratio``: the end-to-end rate (bytes of all calls over the wall time from the first call
  to the last completion) over one contiguous copy of one call's bytes between the same
  memories, measured in the same run (the bench's ceiling: sampled before and after each
  queue, as around each kernel-path case, and once more after the last queue; each row
  divides by the fastest sample of its size in the run, or by a smaller copy's rate where
  that is faster, see :func:`per_byte_envelope`. One sample per size let a copy timed slow
  lift rows of up to 64 MiB to 1.16-1.30, h100-2026-12-05c);
- ``cpu_us``: the median CPU time of one ``write()`` or ``load()`` call, and ``wait_us``
  that of the ``wait_layer`` calls after one load (all layers together);
- ``caller_share`` (the tables' ``caller busy``): the same CPU times, taken from the fastest
  queue (``busy_us``), over that queue's wall time per call; near 100% the queue is CPU-bound
  (the device waits for the caller). From one queue, not from the median over every repeat,
  so another process that slowed some repeats cannot lift it past 100%;
- ``cpu_idle_us``: the median CPU time of one such call made with the device idle (each call
  after the one before it completed): what a call costs an engine that synchronised just
  before it. It is the larger of the two, mostly for cold caches: without any device, a call
  after 2 ms of other work on the caller's thread costs two to five times a warm one
  (``scripts/probe_cold_calls.py``, h100-2026-12-06d); a deep queue does not slow the
  caller's runtime calls down;
- ``host_call_ns`` (the tables' ``host ns/Python call``): one Python call's time on this host,
  taken just before the row's queues. The CPU columns follow it, and one host's moved 2.7x
  within minutes (h200-2026-12-07), so it is read beside each row, not once per run.

Each queue runs ``repeats`` times after one untimed warm-up queue; the fastest is kept, and
``spread%`` says how far the slowest was from it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from kvcore.bench.ceiling import Ceiling
from kvcore.bench.machine import python_call_ns
from kvcore.bench.sweep import MHA_HEAD_DIM
from kvcore.bench.timing import gib_per_s
from kvcore.controller import HiCacheController
from kvcore.layout import Kind, Layout, layouts_for
from kvcore.plan import dtype_name
from kvcore.pools import DevicePool
from kvcore.registry import Registry, allocate_host_pool
from kvcore.streams import has_streams

MIB = 2**20

#: calls of each row made with the device idle (``cpu_idle_us``)
PACED_CALLS = 32

#: element dims of the queue rows: 8 heads of 128 (MHA), DeepSeek's latent 512 + 64 (MLA)
ELEMENT_DIM = {Kind.MHA: 8 * MHA_HEAD_DIM, Kind.MLA: 576}


@attrs.frozen
class QueueCase:
    """One queue: ``calls`` controller calls of ``pages`` pages each."""

    op: str  # "write" (write + acks) or "load" (per-layer load + wait_layer of every layer)
    kind: Kind
    layout: Layout
    pages: int
    calls: int
    page_size: int = 64
    num_layers: int = 32
    dtype: torch.dtype = torch.bfloat16

    @property
    def element_dim(self) -> int:
        return ELEMENT_DIM[self.kind]

    @property
    def head_num(self) -> int:
        return self.element_dim // MHA_HEAD_DIM if self.kind is Kind.MHA else 1

    @property
    def bytes_per_call(self) -> int:
        kv = 2 if self.kind is Kind.MHA else 1
        return (kv * self.num_layers * self.pages * self.page_size * self.element_dim
                * self.dtype.itemsize)

    @property
    def direction(self) -> str:
        return "d2h" if self.op == "write" else "h2d"

    def facts(self) -> dict[str, Any]:
        return {"op": self.op, "kind": self.kind.value, "layout": self.layout.value,
                "pages": self.pages, "calls": self.calls, "page_size": self.page_size,
                "num_layers": self.num_layers, "element_dim": self.element_dim,
                "dtype": dtype_name(self.dtype), "bytes_per_call": self.bytes_per_call}


@attrs.frozen
class QueueRow:
    """The outcome of one queue case on one backend (``error`` set when it failed)."""

    case: QueueCase
    backend: str
    ms_per_call: float | None = None
    ceiling_ms: float | None = None
    cpu_us: float | None = None
    wait_us: float | None = None
    spread_pct: float | None = None
    error: str | None = None
    cpu_idle_us: float | None = None
    #: the fastest queue's median CPU per call, its waits included (what caller_share divides)
    busy_us: float | None = None
    #: ns of one Python call on this host, timed just before the row's queues (its CPU
    #: times follow it: :func:`kvcore.bench.machine.python_call_ns`)
    host_call_ns: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.ms_per_call is None or self.ceiling_ms is None or self.ms_per_call <= 0:
            return None
        return self.ceiling_ms / self.ms_per_call

    @property
    def gib_s(self) -> float | None:
        if self.ms_per_call is None:
            return None
        return gib_per_s(self.case.bytes_per_call, self.ms_per_call)

    @property
    def caller_share(self) -> float | None:
        """The part of a call's wall time (``ms_per_call``) that the caller spent inside the
        API: ``write()``, or ``load()`` and its ``wait_layer`` calls. Near 1 the queue is
        CPU-bound: the device waits for the caller, and the ratio follows the host's speed."""
        if self.ms_per_call is None or self.cpu_us is None or self.ms_per_call <= 0:
            return None
        busy = (self.busy_us if self.busy_us is not None  # (older records: every repeat's)
                else self.cpu_us + (self.wait_us or 0.0))
        return busy / (1e3 * self.ms_per_call)

    @classmethod
    def from_facts(cls, f: dict[str, Any]) -> QueueRow:
        """The row :meth:`facts` described (``kvio bench --merge`` reads them back)."""
        case = QueueCase(f["op"], Kind(f["kind"]), Layout(f["layout"]), int(f["pages"]),
                         int(f["calls"]), int(f["page_size"]), int(f["num_layers"]),
                         getattr(torch, f["dtype"]))
        return cls(case, f["backend"], f["ms_per_call"], f["ceiling_ms"], f["cpu_us"],
                   f["wait_us"], f.get("spread_pct"), f["error"], f.get("cpu_idle_us"),
                   f.get("busy_us"), f.get("host_call_ns"))

    def facts(self) -> dict[str, Any]:
        return {"backend": self.backend, **self.case.facts(), "ms_per_call": self.ms_per_call,
                "ceiling_ms": self.ceiling_ms, "ratio": self.ratio, "gib_s": self.gib_s,
                "cpu_us": self.cpu_us, "cpu_idle_us": self.cpu_idle_us, "wait_us": self.wait_us,
                "busy_us": self.busy_us, "host_call_ns": self.host_call_ns,
                "spread_pct": self.spread_pct, "error": self.error}


def queue_cases(pages: tuple[int, ...], kinds: tuple[Kind, ...], layouts: tuple[Layout, ...],
                budget_bytes: int, max_calls: int = 128,
                num_layers: int = 32) -> list[QueueCase]:
    """Writes and loads of each page count: as many calls as move ``budget_bytes`` (at least
    4, at most ``max_calls``), for each layout that exists for the kind."""
    out = []
    for kind in kinds:
        for layout in layouts:
            if layout not in layouts_for(kind):
                continue
            for op in ("write", "load"):
                for n in pages:
                    one = QueueCase(op, kind, layout, n, 1, num_layers=num_layers)
                    calls = max(4, min(max_calls, budget_bytes // one.bytes_per_call))
                    out.append(attrs.evolve(one, calls=calls))
    return out


def run_queue(case: QueueCase, backend: str, registry: Registry, device: torch.device,
              ceiling: Ceiling, repeats: int, gen: torch.Generator) -> QueueRow:
    """Measure one queue (see the module docstring); a failure becomes the row's error."""
    try:
        return _run(case, backend, registry, device, ceiling, repeats, gen)
    except Exception as exc:  # noqa: BLE001 (a row that fails says why; the sweep goes on)
        return QueueRow(case, backend, error=f"{type(exc).__name__}: {exc}".splitlines()[0])


def _run(case: QueueCase, backend: str, registry: Registry, device: torch.device,
         ceiling: Ceiling, repeats: int, gen: torch.Generator) -> QueueRow:
    P, kind = case.page_size, case.kind
    head_num = case.head_num
    head_dim = case.element_dim // head_num
    device_pages = 2 * case.pages
    dev = DevicePool.allocate(kind, case.num_layers, device_pages * P, head_num, head_dim,
                              case.dtype, device, P)
    for t in dev.all_buffers():
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16,
                                                generator=gen).view(t.shape))
    host = allocate_host_pool(kind, case.layout, case.num_layers, case.calls * case.pages * P,
                             head_num, head_dim, case.dtype, P, device, backend=backend,
                             registry=registry)
    ctl = HiCacheController(dev, host, backend=backend, registry=registry)
    ramp = torch.arange(P)
    dev_sets = [((torch.randperm(device_pages, generator=gen)[:case.pages, None] * P
                  + ramp).flatten()).to(device) for _ in range(4)]
    sync = _synchronizer(device)

    def one_queue() -> tuple[float, list[float], list[float]]:
        cpu: list[float] = []
        waits: list[float] = []
        if case.op == "write":
            sync()
            t0 = time.perf_counter()
            for i in range(case.calls):
                c0 = time.perf_counter()
                ctl.write(dev_sets[i % len(dev_sets)])
                cpu.append(time.perf_counter() - c0)
            acks: list[Any] = []
            while len(acks) < case.calls:
                acks += ctl.poll_acks()
            elapsed = time.perf_counter() - t0
            for ack in acks:
                ctl.free_host(ack.host_indices)
            return elapsed, cpu, waits
        hosts = [ctl.write(dev_sets[i % len(dev_sets)]).host_indices for i in range(case.calls)]
        ctl.wait_acks()
        sync()
        t0 = time.perf_counter()
        for i in range(case.calls):
            c0 = time.perf_counter()
            handle = ctl.load(hosts[i], dev_sets[(i + 1) % len(dev_sets)])
            c1 = time.perf_counter()
            for layer in range(case.num_layers):
                handle.wait_layer(layer)
            waits.append(time.perf_counter() - c1)
            cpu.append(c1 - c0)
        sync()
        elapsed = time.perf_counter() - t0
        handle.check()
        for h in hosts:
            ctl.free_host(h)
        return elapsed, cpu, waits

    def paced(n: int) -> list[float]:
        """``n`` calls, each with the device idle (the last call's work completed)."""
        cpu: list[float] = []
        if case.op == "write":
            for i in range(n):
                # (a write a library thread issues is done once acknowledged, not once the
                # device is idle: the thread may not have issued it yet)
                for ack in ctl.wait_acks():
                    ctl.free_host(ack.host_indices)
                sync()
                c0 = time.perf_counter()
                ctl.write(dev_sets[i % len(dev_sets)])
                cpu.append(time.perf_counter() - c0)
            for ack in ctl.wait_acks():
                ctl.free_host(ack.host_indices)
            return cpu
        hosts = [ctl.write(dev_sets[i % len(dev_sets)]).host_indices for i in range(n)]
        ctl.wait_acks()
        for i in range(n):
            sync()
            c0 = time.perf_counter()
            handle = ctl.load(hosts[i], dev_sets[(i + 1) % len(dev_sets)])
            cpu.append(time.perf_counter() - c0)
            for layer in range(case.num_layers):
                handle.wait_layer(layer)
        sync()
        handle.check()
        for h in hosts:
            ctl.free_host(h)
        return cpu

    one_queue()  # warm-up: first-use allocations, lazy library loads
    host_call_ns = python_call_ns()
    ceiling.sample(case.direction, case.bytes_per_call)
    runs = [one_queue() for _ in range(repeats)]
    idle = paced(min(case.calls, PACED_CALLS))
    ceiling.sample(case.direction, case.bytes_per_call)
    best = min(runs, key=lambda r: r[0])
    slowest = max(r[0] for r in runs)
    ceil = ceiling.measure(case.direction, case.bytes_per_call)  # the fastest sample so far
    return QueueRow(
        case, backend, ms_per_call=1e3 * best[0] / case.calls, ceiling_ms=ceil.median_ms,
        cpu_us=1e6 * statistics.median(c for r in runs for c in r[1]),
        wait_us=1e6 * statistics.median(w for r in runs for w in r[2]) if best[2] else None,
        spread_pct=100.0 * (slowest - best[0]) / best[0] if best[0] > 0 else 0.0,
        cpu_idle_us=1e6 * statistics.median(idle),
        busy_us=1e6 * (statistics.median(best[1])
                       + (statistics.median(best[2]) if best[2] else 0.0)),
        host_call_ns=host_call_ns)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if not has_streams(device):
        return lambda: None
    module = torch.get_device_module(device)
    return lambda: module.synchronize(device)


def markdown_rows(rows: list[QueueRow]) -> list[str]:
    """A markdown table of queue rows."""
    lines = ["| backend | op | kind | layout | pages | MiB/call | calls | ms/call | GiB/s | "
             "ceil GiB/s | ratio | CPU us/call | CPU us/call, device idle | wait_layer us | "
             "caller busy | host ns/Python call | spread% |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.case
        head = (f"| {r.backend} | {c.op} | {c.kind.value} | {c.layout.value} | {c.pages} | "
                f"{c.bytes_per_call / MIB:.0f} | {c.calls} | ")
        if r.error is not None:
            lines.append(head + f"failed: {r.error} ||||||||||")
            continue
        ceil_gib = gib_per_s(c.bytes_per_call, r.ceiling_ms or 0.0)
        wait = f"{r.wait_us:.0f}" if r.wait_us is not None else "-"
        idle = f"{r.cpu_idle_us:.0f}" if r.cpu_idle_us is not None else "-"
        busy = f"{r.caller_share:.0%}" if r.caller_share is not None else "-"
        host = f"{r.host_call_ns:.0f}" if r.host_call_ns is not None else "-"
        lines.append(head + f"{r.ms_per_call:.3f} | {r.gib_s:.1f} | {ceil_gib:.1f} | "
                     f"{r.ratio:.3f} | {r.cpu_us:.0f} | {idle} | {wait} | {busy} | {host} | "
                     f"{r.spread_pct:.1f} |")
    return lines


def run_all(registry: Registry, device: torch.device, backends: list[str],
            cases: list[QueueCase], warmup: int, repeats: int, seed: int,
            advance: Callable[[str], None] | None = None,
            rows: list[QueueRow] | None = None,
            out_of_time: Callable[[], bool] | None = None) -> list[QueueRow]:
    """Every case on every backend, with one ceiling cache for the run, into ``rows`` (so
    the queues measured before an interrupt stay there); stops before a queue once
    ``out_of_time()`` says so."""
    from kvcore.bench.timing import Clock
    from kvcore.registry import REFERENCE

    rows = [] if rows is None else rows
    clock = Clock(device, warmup, repeats)
    ceiling = Ceiling(clock, registry.instance(REFERENCE, device).allocate_host)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(seed)
    for case in cases:
        for backend in backends:
            if out_of_time is not None and out_of_time():
                return rows
            rows.append(run_queue(case, backend, registry, device, ceiling, repeats, gen))
            if advance is not None:
                advance(f"controller {backend} {case.op} {case.kind.value} "
                        f"{case.layout.value} {case.pages}p")
    _sample_ceilings_again(rows, ceiling)
    return rows


def _sample_ceilings_again(rows: list[QueueRow], ceiling: Ceiling) -> None:
    """Every row's size sampled once more after the last queue, and each row given the
    fastest copy of its size in the run: a host-to-device copy can run 5-25% slow for several
    samples in a row (h100-2026-12-05c), so the two samples around a queue may both fall in
    such a phase."""
    fastest: dict[tuple[str, int], float] = {}
    for row in rows:
        if row.ceiling_ms is None:
            continue
        direction, nbytes = row.case.direction, row.case.bytes_per_call
        key = (ceiling.label(direction), nbytes)  # (on a CPU both directions are a memcpy)
        if key not in fastest:
            fastest[key] = ceiling.measure(direction, nbytes, again=True).median_ms
    envelope = per_byte_envelope(fastest)
    for i, row in enumerate(rows):
        if row.ceiling_ms is None:
            continue
        best = envelope[(ceiling.label(row.case.direction), row.case.bytes_per_call)]
        if best < row.ceiling_ms:
            rows[i] = attrs.evolve(row, ceiling_ms=best)


def per_byte_envelope(times: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """Each (copy, size)'s time, or that of a smaller size of the same copy scaled up to this
    size where that is shorter. A larger copy between the same memories is never slower per
    byte than a smaller one (it spreads the same fixed cost over more bytes), so a size that
    read slower per byte in every sample was disturbed throughout: on one H100 host the
    32- and 36-MiB host-to-device copies read 22-27 GiB/s in every sample of a run whose 9-
    and 128-MiB copies read 46-51 (h100-2026-12-05d), and their load rows 1.13 and 1.41."""
    out: dict[tuple[str, int], float] = {}
    best_rate: dict[str, float] = {}  # per copy: the most bytes per ms of the sizes so far
    for label, nbytes in sorted(times, key=lambda k: k[1]):
        ms = times[(label, nbytes)]
        rate = best_rate.get(label, 0.0)
        if rate > 0:
            ms = min(ms, nbytes / rate)
        out[(label, nbytes)] = ms
        if ms > 0:
            best_rate[label] = max(rate, nbytes / ms)
    return out
