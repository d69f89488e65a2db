"""Runs a sweep: for each case, check every backend against the reference, then time it.

Only the public API is used (pools, ``Registry.resolve``, ``TransferPlan``), so any
registered backend can be measured. Per case:

1. build one random initial state (device and host pools) and the reference's result from it;
2. for each other backend: allocate its own pools (its host allocator), copy the initial state
   in, run the timed call on the first index set and compare every buffer with the
   reference's result byte for byte; a mismatch or an error marks the row failed and it is
   not timed;
3. time the backend, rotating through disjoint index sets; after the first backend and after
   the last, measure the contiguous-copy ceiling for the case's direction and byte count
   (the fastest measurement of that size in the run is the ceiling, see ``ceiling.py``).

On an accelerator, a case whose own ceiling copy ran slow or whose rows' samples spread wide
(a disturbed host, not a slow backend) is run again at the end of the sweep: see
``slowdown.py``.

The reference's own row is its oracle run of step 1, on the pools of its result: it needs no
pools of its own and no check against itself (on an H200 the seed table with the reference
took 546 s instead of an estimated 808 s). It is timed after every comparison, because its
timed calls on the other index sets change that result. With ``reference_repeat`` the oracle
call itself is the row's first timed call, and only the rest run after the comparisons.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from kvcore.bench.ceiling import Ceiling
from kvcore.bench.machine import machine_facts, measured_environment
from kvcore.bench.row import FAILED, OK, UNSUPPORTED, Row
from kvcore.bench.slowdown import CaseRun, Tolerances, slowdown
from kvcore.bench.sweep import Case
from kvcore.bench.timing import Clock, Timing
from kvcore.capabilities import Unavailable
from kvcore.errors import BuildError, InvalidArgument, KVCoreError
from kvcore.plan import Submission, TransferPlan
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import REFERENCE, Registry, allocate_host_pool, make_request
from kvcore.streams import current_stream, has_streams, new_stream, on_stream
from kvcore.verify import random_fill

SCHEMA_ID = "kvcore.bench/1"


@attrs.define
class BenchResult:
    """Everything a report needs."""

    rows: list[Row]
    machine: dict[str, Any]
    backends: list[dict[str, Any]]
    settings: dict[str, Any]
    started: str
    elapsed_s: float = 0.0
    #: the cases the run never reached because it was interrupted (none for a complete run)
    not_run_cases: list[Case] = attrs.field(factory=list)
    #: cases not run that ``not_run_cases`` cannot name (read from a file that did not list
    #: them)
    not_run_unnamed: int = 0
    #: rows through the controller (:mod:`kvcore.bench.queue`): what an engine calls
    controller_rows: list[Any] = attrs.field(factory=list)
    #: controller queues the run never reached (interrupted, or out of its time limit)
    controller_not_run: int = 0

    @property
    def not_run(self) -> int:
        """How many cases were not run (0 for a complete run)."""
        return len(self.not_run_cases) + self.not_run_unnamed

    def facts(self) -> dict[str, Any]:
        return {"schema": SCHEMA_ID, "started": self.started, "elapsed_s": self.elapsed_s,
                "not_run": self.not_run,
                "not_run_cases": [c.facts() for c in self.not_run_cases],
                "controller_not_run": self.controller_not_run,
                "machine": self.machine, "settings": self.settings,
                "backends": self.backends, "rows": [r.facts() for r in self.rows],
                "controller_rows": [r.facts() for r in self.controller_rows]}


@attrs.define
class Bench:
    """A configured benchmark; :meth:`run` returns a :class:`BenchResult`."""

    registry: Registry
    device: torch.device
    cases: Sequence[Case]
    backends: Sequence[str] | None = None  # None: every backend available on ``device``
    warmup: int = 2
    repeat: int = 5
    seed: int = 0
    settings: dict[str, Any] = attrs.field(factory=dict)
    #: start no new case after this many seconds (None: no limit); see ``BenchResult.not_run``
    time_limit_s: float | None = None
    #: timed calls of the reference's own rows, the first of them its oracle call, with no
    #: warm-up (None: warm-up and ``repeat`` like every backend). The reference is slow on an
    #: accelerator (most of a GPU sweep's time) and its rows are only for comparison.
    reference_repeat: int | None = None
    #: rounds of re-running the cases the host disturbed (see ``slowdown.py``)
    retime: int = 2
    tolerances: Tolerances = attrs.field(factory=Tolerances)
    #: judge the host by the ceiling copy (None: where the timer is device events; on the
    #: CPU the copy and the rows share the cores, so the copy says nothing apart)
    check_host: bool | None = None
    _pool_cache: dict[tuple[str, str], tuple[DevicePool, HostPool]] = attrs.field(
        factory=dict, init=False)
    _pool_key: tuple[object, ...] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if self.reference_repeat is not None and self.reference_repeat < 1:
            raise InvalidArgument("reference_repeat", "a positive int or None",
                                  str(self.reference_repeat))
        if self.retime < 0:
            raise InvalidArgument("retime", "a non-negative int", str(self.retime))

    def backend_names(self) -> list[str]:
        """The backends to measure, the reference first when it is among them."""
        if self.backends:
            names = list(dict.fromkeys(self.backends))
            for name in names:
                self.registry.get(name)  # an unknown or broken name raises with the cause
        else:
            names = self.registry.runnable(self.device)
        return sorted(names, key=lambda n: n != REFERENCE)

    def run(self, advance: Callable[[str], None] | None = None) -> BenchResult:
        """Measure every case with every backend; ``advance(label)`` after each row.

        A ``KeyboardInterrupt`` (which ``kvio bench`` also raises on SIGTERM) stops the run
        between rows; the rows finished so far are returned, with ``not_run`` counting the
        cases left, so a run cut short by a time limit still reports what it measured.

        On an accelerator everything (fills, checks, the timed calls and the ceiling) runs on
        one dedicated stream, as the controller's transfers run on streams of their own: the
        legacy default stream would time paths the controller never takes (it disables
        programmatic dependent launch and refuses batched copies).
        """
        with on_stream(new_stream(self.device)):
            return self._run(advance)

    def _run(self, advance: Callable[[str], None] | None) -> BenchResult:
        t0 = time.perf_counter()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        names = self.backend_names()
        clock = Clock(self.device, self.warmup, self.repeat)
        ref_instance = self.registry.instance(REFERENCE, self.device)
        ceiling = Ceiling(clock, ref_instance.allocate_host)  # type: ignore[attr-defined]
        runs: list[CaseRun] = []
        host_memory: str | None = None

        def out_of_time() -> bool:
            return (self.time_limit_s is not None
                    and time.perf_counter() - t0 > self.time_limit_s)

        def run(case: Case, label: str = "") -> CaseRun:
            nonlocal host_memory
            step = None if advance is None else functools.partial(_prefixed, advance, label)
            case_run, memory = self._run_case(case, names, clock, ceiling, step)
            host_memory = host_memory or memory
            return case_run

        check = self.check_host if self.check_host is not None else has_streams(self.device)
        try:
            for case in self.cases:
                if out_of_time():
                    break
                runs.append(run(case))
            for _ in range(self.retime if check else 0):
                disturbed = [i for i, r in enumerate(runs)
                             if self.tolerances.disturbed(r, self._fastest(r, ceiling))]
                for i in disturbed:
                    if out_of_time():
                        break
                    again = run(runs[i].case, "re-timed: ")
                    runs[i] = self.tolerances.keep(runs[i], again, self._fastest(again, ceiling))
        except KeyboardInterrupt:
            pass
        finally:
            self._release_pools(clock)
        rows = []
        for case_run in runs:
            host_slowdown = self._slowdown(case_run, ceiling)
            for row in case_run.rows:
                row.host_slowdown, row.attempts = host_slowdown, case_run.attempts
                rows.append(row)
        for row in rows:  # every row of a size divides by the fastest copy of that size
            if row.timing is not None:
                row.ceiling = ceiling.measure(row.case.direction, row.case.bytes_moved)
                row.ceiling_kind = ceiling.label(row.case.direction)
        add_speedups(rows)
        done = len(runs)
        settings = {"device": str(self.device), "warmup": self.warmup,
                    "warmup_per": "index set", "repeat": self.repeat,
                    "seed": self.seed, "timer": clock.kind,
                    "stream": "dedicated" if has_streams(self.device) else "none",
                    **self.settings}
        if self.reference_repeat is not None:
            settings["reference_repeat"] = self.reference_repeat
        settings["check_host"] = check
        settings["retime"] = self.retime
        settings["slowdown_tolerance"] = self.tolerances.slowdown
        settings["spread_tolerance"] = self.tolerances.spread
        settings["environment"] = measured_environment()
        return BenchResult(rows=rows, machine=machine_facts(self.device, host_memory),
                           backends=[self._backend_facts(n) for n in names],
                           settings=settings, started=started,
                           elapsed_s=time.perf_counter() - t0,
                           not_run_cases=list(self.cases[done:]))

    def _backend_facts(self, name: str) -> dict[str, Any]:
        caps = self.registry.get(name).spec.capabilities
        avail = self.registry.availability(name)
        return {"name": name, "version": caps.version, "platform": caps.platform,
                "available": bool(avail), "host_memory": caps.host_memory.value,
                "reason": avail.reason if isinstance(avail, Unavailable) else avail.detail}

    # -- one case --------------------------------------------------------------------------

    def _run_case(self, case: Case, names: Sequence[str], clock: Clock, ceiling: Ceiling,
                  advance: Callable[[str], None] | None) -> tuple[CaseRun, str | None]:
        gen = torch.Generator().manual_seed(self.seed)
        sets = index_sets(case, gen, self.device)
        initial = self._pools(case, "initial", REFERENCE, clock)
        for t in (*initial[0].all_buffers(), initial[1].buffer):
            random_fill(t, gen, on=self.device)  # made on the accelerator: GBs in ms
        expected = self._pools(case, "expected", REFERENCE, clock)
        copy_state(initial, expected)
        ref_plan = self._plan(case, REFERENCE)
        oracle = Call(ref_plan, expected, sets, case)
        oracle_variant = oracle.prepare()
        oracle_timing = self._run_oracle(oracle, clock)
        rows = {name: Row(case, name) for name in names}
        memory = None
        timed = [n for n in names if n != REFERENCE] + [n for n in names if n == REFERENCE]
        copies = []
        for i, name in enumerate(timed):
            if i == 1:  # between the first backend's run and the second's
                copies.append(ceiling.sample(case.direction, case.bytes_moved, case.index_sets))
            row = rows[name]
            if name == REFERENCE:
                row.backend_version, row.variant = ref_plan.backend_version, oracle_variant
                memory = memory or expected[1].memory.value
                self._time_reference(row, oracle, oracle_timing, clock)
            else:
                memory = self._check_and_time(row, initial, expected, sets, clock) or memory
            if advance is not None:
                advance(f"{name} {case.op.value} {case.kind.value}/{case.layout.value} "
                        f"L{case.num_layers} e{case.element_dim}")
        copies.append(ceiling.sample(case.direction, case.bytes_moved, case.index_sets))
        slowest = max(copies, key=lambda t: t.median_ms)
        return CaseRun(case, [rows[n] for n in names], slowest), memory

    @staticmethod
    def _fastest(case_run: CaseRun, ceiling: Ceiling) -> Timing:
        """The run's fastest ceiling copy of the case's size so far."""
        return ceiling.measure(case_run.case.direction, case_run.case.bytes_moved)

    def _slowdown(self, case_run: CaseRun, ceiling: Ceiling) -> float:
        return slowdown(case_run, self._fastest(case_run, ceiling))

    def _check_and_time(self, row: Row, initial: tuple[DevicePool, HostPool],
                        expected: tuple[DevicePool, HostPool],
                        sets: list[tuple[torch.Tensor, torch.Tensor]],
                        clock: Clock) -> str | None:
        """Resolve ``row``'s backend, give it pools in the initial state, compare its first
        call with ``expected`` and time it; returns its host memory kind (None where it does
        not support the case)."""
        try:
            plan = self._plan(row.case, row.backend)
            pools = self._pools(row.case, "measured", row.backend, clock)
        except BuildError as exc:  # it claims the case but cannot be made: a failure
            row.status, row.reason = FAILED, _first_line(exc)
            return None
        except KVCoreError as exc:
            row.status, row.reason = UNSUPPORTED, _first_line(exc)
            return None
        row.backend_version = plan.backend_version
        call = Call(plan, pools, sets, row.case)
        try:
            copy_state(initial, pools)
            row.variant = call.check_and_run(0)
            clock.synchronize()
            call.check_completions()
            diff = differences(pools, expected)
        except Exception as exc:  # noqa: BLE001 - any failure of the backend fails the row
            row.status, row.reason = FAILED, f"{type(exc).__name__}: {_first_line(exc)}"
        else:
            if diff:
                row.status, row.reason = FAILED, f"differs from the reference: {diff}"
            else:
                self._time(row, call, clock)
        return pools[1].memory.value

    def _run_oracle(self, oracle: Call, clock: Clock) -> Timing | None:
        """The reference's call on the first index set, whose result every backend is
        compared with; timed where it is the reference row's first timed call."""
        if self.reference_repeat is None:
            oracle(0)
            clock.synchronize()
            timing = None
        else:
            timing = Clock(self.device, 0, 1).measure(oracle)
        oracle.check_completions()
        return timing

    def _time_reference(self, row: Row, oracle: Call, first: Timing | None,
                        clock: Clock) -> None:
        """The reference's row: timed like any backend's, or its oracle call and
        ``reference_repeat - 1`` calls on the following index sets, without warm-up."""
        if first is None:
            self._time(row, oracle, clock)
            return
        more = (self.reference_repeat or 1) - 1
        if more:
            self._time(row, oracle, Clock(self.device, 0, more), first_set=1)
        if row.status == OK:
            rest = row.timing.samples_ms if row.timing is not None else ()
            row.timing = Timing(first.samples_ms + rest)

    @staticmethod
    def _time(row: Row, call: Call, clock: Clock, first_set: int = 0) -> None:
        try:
            row.timing = clock.measure(lambda i: call(first_set + i), len(call.placed))
            call.check_completions()
        except Exception as exc:  # noqa: BLE001 - any failure of the backend fails the row
            row.status, row.reason = FAILED, f"{type(exc).__name__}: {_first_line(exc)}"

    def _plan(self, case: Case, backend: str) -> TransferPlan:
        req = make_request(case.op, case.kind, case.layout, case.dtype, case.element_bytes,
                           self.device)
        return self.registry.resolve(req, backend)

    def _pools(self, case: Case, role: str, backend: str,
               clock: Clock) -> tuple[DevicePool, HostPool]:
        """The pools of ``role`` for ``case``, shared by the consecutive cases (ops) of one
        geometry; a new geometry releases the previous one's memory first. Every user copies
        the state it needs into them, so sharing changes no result."""
        if case.pool_key() != self._pool_key:
            self._release_pools(clock)
            self._pool_key = case.pool_key()
        if (role, backend) not in self._pool_cache:
            self._pool_cache[(role, backend)] = self._allocate(case, backend)
        return self._pool_cache[(role, backend)]

    def _release_pools(self, clock: Clock) -> None:
        """Drop the cached pools and hand their memory back, pinned host memory included
        (torch's host caching allocator keeps freed pinned blocks otherwise)."""
        self._pool_cache.clear()
        self._pool_key = None
        if not has_streams(self.device):
            return
        clock.synchronize()
        memory = getattr(torch.accelerator, "memory", None)
        for release in ("empty_cache", "empty_host_cache"):
            fn = getattr(memory, release, None)
            if fn is not None:
                fn()

    def _allocate(self, case: Case, backend: str) -> tuple[DevicePool, HostPool]:
        dev = DevicePool.allocate(case.kind, case.num_layers, case.pool_tokens, case.head_num,
                                  case.head_dim, case.dtype, self.device, case.page_size)
        host = allocate_host_pool(case.kind, case.layout, case.num_layers, case.pool_tokens,
                                 case.head_num, case.head_dim, case.dtype, case.page_size,
                                 self.device, backend=backend, registry=self.registry,
                                 head_group_num=case.head_group_num)
        return dev, host


class Call:
    """The measured call of one row: one submit of the whole op on index set ``i % n``, with
    the indices placed in advance where the variant wants them (the kernel path; the
    controller rows time what an engine calls)."""

    def __init__(self, plan: TransferPlan, pools: tuple[DevicePool, HostPool],
                 sets: list[tuple[torch.Tensor, torch.Tensor]], case: Case) -> None:
        self.plan = plan
        self.device_pool, self.host_pool = pools
        self.bound = plan.bind(*pools)
        self.case = case
        self.raw_sets = sets
        self.placed: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.submissions: list[Submission] = []
        self.stream = current_stream(self.device_pool.device)

    def prepare(self) -> str:
        """Check and place every index set; returns the variant the first one uses."""
        for h, d in self.raw_sets:
            self.bound.check(h, d)
            # where the plan's own variant wants them (copy-engine loads take CPU indices)
            self.placed.append(self.bound.place(h, d, self.bound.support))
        return self.bound.variant_for(*self.placed[0]).variant

    def check_and_run(self, i: int) -> str:
        """Check and place every index set, run set ``i``; returns the variant used."""
        variant = self.prepare()
        self(i)
        return variant

    def __call__(self, i: int) -> None:
        """One timed submit on index set ``i % n``."""
        h, d = self.placed[i % len(self.placed)]
        self.submissions.append(self.bound.submit(h, d, stream=self.stream))

    def check_completions(self) -> None:
        """Raise what an asynchronous failure reported (call after synchronising)."""
        pending, self.submissions = self.submissions, []
        for sub in pending:
            sub.check()


def index_sets(case: Case, gen: torch.Generator,
               device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Disjoint batches of scattered whole pages: (host token indices, device token indices).

    Device pages are a random permutation of the device pool's pages split into batches;
    host pages are distinct random pages of the host pool.
    """
    n, b, p = case.index_sets, case.batch_pages, case.page_size
    dev_pages = torch.randperm(case.total_pages, generator=gen)
    host_pages = torch.randperm(case.total_pages, generator=gen)
    ramp = torch.arange(p, dtype=torch.int64)
    out = []
    for i in range(n):
        h = (host_pages[i * b:(i + 1) * b, None] * p + ramp).flatten()
        d = (dev_pages[i * b:(i + 1) * b, None] * p + ramp).flatten()
        out.append((h, d.to(device)))
    return out


def copy_state(src: tuple[DevicePool, HostPool], dst: tuple[DevicePool, HostPool]) -> None:
    """Copy every buffer of ``src`` pools into ``dst`` pools of the same geometry."""
    for s, d in zip(src[0].all_buffers(), dst[0].all_buffers(), strict=True):
        d.copy_(s)
    dst[1].buffer.copy_(src[1].buffer)


def differences(got: tuple[DevicePool, HostPool],
                expected: tuple[DevicePool, HostPool]) -> str | None:
    """None when every byte of both pools equals the expected pools', else where it differs."""
    wrong = []
    for name, a, b in _buffers(got, expected):
        ab, bb = a.view(torch.uint8), b.view(torch.uint8)
        if not torch.equal(ab, bb):
            count = int((ab.cpu() != bb.cpu()).sum())
            wrong.append(f"{name} ({count} of {ab.numel()} bytes)")
    if not wrong:
        return None
    return ", ".join(wrong[:4]) + (f" and {len(wrong) - 4} more buffers" if len(wrong) > 4
                                   else "")


def _buffers(got: tuple[DevicePool, HostPool], expected: tuple[DevicePool, HostPool],
             ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    out = [("host buffer", got[1].buffer, expected[1].buffer)]
    for kv, label in ((0, "k"), (1, "v")):
        if kv == 1 and got[0].v_buffers is None:
            break
        for i, (a, b) in enumerate(zip(got[0].layers(kv), expected[0].layers(kv), strict=True)):
            out.append((f"device {label}[{i}]", a, b))
    return out


def add_speedups(rows: list[Row]) -> None:
    """Set each timed row's speedup: the reference's median time over its own, same case."""
    ref = {r.case.key(): r.timing for r in rows if r.backend == REFERENCE and r.timing}
    for r in rows:
        base = ref.get(r.case.key())
        if r.timing is not None and base is not None and r.timing.median_ms > 0:
            r.speedup = base.median_ms / r.timing.median_ms


def _prefixed(advance: Callable[[str], None], prefix: str, label: str) -> None:
    advance(prefix + label)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
