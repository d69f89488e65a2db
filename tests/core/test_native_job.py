"""Staged write-backs a native library issues on its own thread: the job as the submission's
completion, the runner that hands it over, and what the write queue makes of a failed one
(no GPU needed: the library is a fake that plays the thread)."""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import pytest
import torch

from kvcore.errors import (
    ControllerUnusable,
    DeviceFault,
    InvalidArgument,
    InvalidIndices,
    KernelError,
    TransferFailed,
)
from kvcore.layout import Op
from kvcore.native import NativeBackend
from kvcore.native_abi import JOB_PENDING, KvioBounds
from kvcore.native_job import NativeJob
from kvcore.pools import DevicePool, HostPool, SlotAllocator
from kvcore.write_queue import Health, WriteQueue


class JobLibrary:
    """The job functions of NativeLibrary over jobs whose status the test sets; records
    every call, and the staged write-backs handed over through ``unchecked``."""

    optional = ("kvio_write_back_staged_async",)

    def __init__(self) -> None:
        self.status: dict[int, int] = {}
        self.calls: list[tuple[str, Any]] = []
        self.handed: list[tuple[Any, ...]] = []
        self.next_job = 0x100

    def has_async_write_back(self) -> bool:
        return True

    def has_layer_signals(self) -> bool:
        return False

    def wait_layer_signal(self, *args: Any) -> None:
        raise AssertionError("no signaled load here")

    def unchecked(self, function: str, last: Any = None) -> Any:
        if function == "kvio_write_back_staged":
            return lambda *args: self.handed.append(("synchronous", *args))  # type: ignore
        assert function in self.optional
        both = len(self.optional) > 1  # then each record names its function

        def call(*args: Any) -> None:
            self.handed.append((function, *args) if both else args)
            job = self.next_job
            self.next_job += 0x10
            self.status[job] = JOB_PENDING
            ctypes.cast(args[-1], ctypes.POINTER(ctypes.c_void_p))[0] = job  # *job = handle

        return call

    def job_status(self, job: int) -> int:
        self.calls.append(("status", job))
        return self.status[job]

    def job_wait(self, job: int) -> int:
        self.calls.append(("wait", job))
        if self.status[job] == JOB_PENDING:
            self.status[job] = 0  # the thread issued it and it completed
        return self.status[job]

    def job_release(self, job: int) -> None:
        self.calls.append(("release", job))

    def jobs_flush(self) -> None:
        self.calls.append(("flush", None))

    def check(self, function: str, status: int) -> None:
        raise KernelError(f"{function}: failed (cuda error {status})", code=status)


class Report:
    """A BoundsCompletion stand-in: raises what the kernels reported, if anything."""

    def __init__(self, bad: int | None = None) -> None:
        self.bad = bad

    def check(self) -> None:
        if self.bad is not None:
            raise InvalidIndices("device_indices", "values in [0, 64)", str(self.bad))


def _job(lib: JobLibrary, report: Report | None = None) -> tuple[NativeJob, int]:
    handle = lib.next_job
    lib.next_job += 0x10
    lib.status[handle] = JOB_PENDING
    return NativeJob(lib, handle, report or Report(), (torch.arange(4),)), handle


def test_a_job_is_unfinished_until_its_library_says_so_and_is_given_back_once() -> None:
    lib = JobLibrary()
    job, handle = _job(lib)
    assert job.query() is False
    lib.status[handle] = 0
    assert job.query() is True and job.query() is True
    job.check()
    assert lib.calls == [("status", handle), ("status", handle), ("release", handle)]


def test_synchronize_waits_through_the_library_and_releases() -> None:
    lib = JobLibrary()
    job, handle = _job(lib)
    job.synchronize()
    assert lib.calls == [("wait", handle), ("release", handle)]
    assert job.query() is True
    job.check()


def test_a_job_the_library_failed_raises_its_error_at_the_check() -> None:
    lib = JobLibrary()
    job, handle = _job(lib)
    lib.status[handle] = 700
    assert job.query() is True  # finished: failed
    with pytest.raises(KernelError, match="cuda error 700"):
        job.check()
    assert lib.calls.count(("release", handle)) == 1


def test_an_index_the_kernels_refused_raises_at_the_check() -> None:
    lib = JobLibrary()
    job, handle = _job(lib, Report(bad=99))
    lib.status[handle] = 0
    with pytest.raises(InvalidIndices, match="99"):
        job.check()


def test_a_job_dropped_unfinished_is_waited_for_before_it_is_given_back() -> None:
    lib = JobLibrary()
    job, handle = _job(lib)
    del job
    gc.collect()
    assert lib.calls == [("wait", handle), ("release", handle)]


# -- the runner -------------------------------------------------------------------------------


class StreamsNative(NativeBackend):
    """Raw handles: None (the current stream) is 5, "caller" is 9."""

    def raw_stream(self, stream: Any) -> int:
        return {None: 5, "caller": 9, "legacy": 0}[stream]


@pytest.fixture(autouse=True)
def hand_over_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write-back is large enough to go to the thread, unless a test says otherwise."""
    monkeypatch.setattr("kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES", 1)


def _runner(lib: JobLibrary, backend_type: type[NativeBackend] = StreamsNative,
            device: str = "cpu", layout: str = "page_first", variant: str = "staged",
            ) -> tuple[Any, DevicePool, HostPool, NativeBackend]:
    """``variant``'s write-back runner for an MHA pool (3 layers, 2 heads x 64, pages of 16)
    on ``device`` and a ``layout`` host pool, prepared by a ``backend_type`` over ``lib``."""
    from kvcore.backend import TransferJob
    from kvcore.layout import Geometry, Kind, Layout, host_shape
    from kvcore.native import native_ops

    backend = backend_type(torch.device(device), lib, staging_bytes=1 << 20)  # type: ignore[arg-type]
    dev = DevicePool.allocate("mha", 3, 64, 2, 64, torch.bfloat16, device, 16)
    g = Geometry(Kind.MHA, Layout(layout), 3, 64, 2, 64, 16)
    host = HostPool.wrap(torch.empty(host_shape(g), dtype=torch.bfloat16), "mha", layout,
                         3, 2, 64, 16)
    support = next(s for s in native_ops() if s.op is Op.WRITE_BACK and s.variant == variant)
    none = torch.empty(0, dtype=torch.int64)
    job = TransferJob(op=Op.WRITE_BACK, support=support, device_pool=dev,
                      host_buffer=host.buffer, host_geometry=host.geometry,
                      host_strides=host.strides, host_indices=none, device_indices=none)
    return backend.prepare(job), dev, host, backend


def test_the_staged_write_back_runner_hands_the_transfer_over_with_the_callers_stream() -> None:
    lib = JobLibrary()
    run, dev, host, backend = _runner(lib)
    assert run.follows is True
    h, d = torch.arange(16, 32), torch.arange(16, dtype=torch.int32)
    job = run(h, d, None, None, False, "caller")
    assert isinstance(job, NativeJob)
    (args,) = lib.handed
    k, v, layers, base, _layout, hp, dp, d64, n, staging, staging_bytes, batched = args[:12]
    assert (k, v, layers, base) == (dev.k_ptrs.data_ptr(), dev.v_ptrs.data_ptr(), 3,
                                    host.buffer.data_ptr())
    assert (hp, dp, d64, n, staging_bytes, batched) == (h.data_ptr(), d.data_ptr(), 0, 16,
                                                        1 << 20, 1)
    assert staging == backend.staging(5).data_ptr()
    stream, after, bounds = args[12:15]
    assert (stream, after) == (5, 9)
    assert isinstance(bounds, KvioBounds) and bounds.host_tokens == 64
    assert job.query() is False
    lib.status[0x100] = 0
    assert job.query() is True


def test_without_a_stream_to_follow_the_transfer_is_enqueued_before_the_call_returns() -> None:
    lib = JobLibrary()
    run, *_ = _runner(lib)
    done = run(torch.arange(16), torch.arange(16), None, None, False)
    assert not isinstance(done, NativeJob)  # the plan API: on the stream when submit returns
    assert lib.handed[0][0] == "synchronous"
    assert lib.handed[0][13] == 5  # its stream


def test_a_write_back_below_the_size_worth_a_handover_is_enqueued_by_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    token_bytes = 2 * 3 * 2 * 64 * 2  # K and V, 3 layers, 2 heads x 64 bf16
    monkeypatch.setattr("kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES", 16 * token_bytes)
    lib = JobLibrary()
    run, *_ = _runner(lib)
    assert not isinstance(run(torch.arange(15), torch.arange(15), None, None, False, "caller"),
                          NativeJob)
    assert isinstance(run(torch.arange(16), torch.arange(16), None, None, False, "caller"),
                      NativeJob)
    assert [args[0] == "synchronous" for args in lib.handed] == [True, False]


def test_a_small_write_back_goes_through_the_overlapped_call_where_the_library_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the handover size a library with kvio_write_back_staged_after gets the transfer
    with the caller's stream to follow, and its job is the completion (no fence, no event of
    kvcore's); without ``after`` (the plan API) it stays in stream order."""
    token_bytes = 2 * 3 * 2 * 64 * 2
    monkeypatch.setattr("kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES", 16 * token_bytes)
    lib = JobLibrary()
    lib.optional = ("kvio_write_back_staged_async", "kvio_write_back_staged_after")
    run, *_ = _runner(lib)
    small = run(torch.arange(15), torch.arange(15), None, None, False, "caller")
    large = run(torch.arange(16), torch.arange(16), None, None, False, "caller")
    plan_api = run(torch.arange(15), torch.arange(15), None, None, False)
    assert isinstance(small, NativeJob) and isinstance(large, NativeJob)
    assert not isinstance(plan_api, NativeJob)
    assert [args[0] for args in lib.handed] == [
        "kvio_write_back_staged_after", "kvio_write_back_staged_async", "synchronous"]
    assert lib.handed[0][13:15] == (5, 9)  # its stream, the caller's stream to follow
    lib.status[0x100] = 700
    with pytest.raises(KernelError, match="kvio_write_back_staged_after"):
        small.check()


class DirectLibrary(JobLibrary):
    """JobLibrary with the staged write-back's overlapped form and the direct kernel's inline
    form; the direct calls are recorded with their function's name."""

    optional = ("kvio_write_back_staged_async", "kvio_write_back_staged_after",
                "kvio_transfer_direct_inline")

    def unchecked(self, function: str, last: Any = None) -> Any:
        if function in ("kvio_transfer_direct", "kvio_transfer_direct_inline"):
            return lambda *args: self.handed.append((function, *args))
        return super().unchecked(function, last)


class NullStreamsNative(NativeBackend):
    def raw_stream(self, stream: Any) -> int:
        return int(stream.native_handle)


def _meta_runner(lib: JobLibrary, layout: str, variant: str) -> tuple[Any, HostPool]:
    """:func:`_runner` on the meta device under stand-in streams (its stream handles are the
    streams' own): the runner and the host pool."""
    run, _, host, _ = _runner(lib, NullStreamsNative, "meta", layout, variant)
    return run, host


@pytest.fixture
def direct_up_to_15_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The write-back sizes of :func:`_meta_runner`'s pools: up to 15 tokens through the
    direct kernel, from 64 to the library's thread."""
    token_bytes = 2 * 3 * 2 * 64 * 2  # K and V, 3 layers, 2 heads x 64 bf16
    monkeypatch.setattr("kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES", 64 * token_bytes)
    monkeypatch.setattr("kvcore.native.DIRECT_WRITE_BACK_MAX_BYTES", 15 * token_bytes)


def test_a_write_back_under_the_direct_size_goes_through_the_direct_kernel_after_a_fence(
        direct_up_to_15_tokens: None) -> None:
    """Up to DIRECT_WRITE_BACK_MAX_BYTES, where the library launches the direct kernel with
    CPU host indices (but has no kvio_transfer_direct_after), a controller write-back
    (``after`` given) is ordered after the caller's stream by a fence and goes through
    kvio_transfer_direct_inline with its host indices; above that size, the staged path as
    before, and the plan API (no ``after``) keeps the staged write-back whatever the size."""
    import collections

    from kvcore.native import BoundsCompletion
    from kvcore.testing.stand_in_streams import NullStream, stand_in_streams

    calls: collections.Counter[str] = collections.Counter()
    meta = torch.device("meta")
    with stand_in_streams(meta.type, calls):
        lib = DirectLibrary()
        run, host = _meta_runner(lib, "page_first", "staged")
        stream, caller = NullStream(meta, calls), NullStream(meta, calls)
        h = torch.arange(16, 31)
        small = run(h, torch.arange(15, device=meta), None, stream, False, caller)
        assert (calls["event.record"], calls["stream.wait_event"]) == (1, 1)  # the fence
        assert isinstance(small, BoundsCompletion)
        (name, direction, _k, _v, first, count, base, _layout, hp, h64, _dp, d64, n, s,
         bounds) = lib.handed[0]
        assert (name, direction, first, count, n, s) == (
            "kvio_transfer_direct_inline", 0, 0, 3, 15, stream.native_handle)
        assert (hp, h64, d64, base) == (h.data_ptr(), 1, 1, host.buffer.data_ptr() or None)
        assert isinstance(bounds, KvioBounds) and bounds.host_tokens == 64
        at_size = run(torch.arange(16), torch.arange(16, device=meta), None, stream, False,
                      caller)
        plan_api = run(h, torch.arange(15, device=meta), None, stream, False)
    assert isinstance(at_size, NativeJob) and not isinstance(plan_api, NativeJob)
    assert [args[0] for args in lib.handed] == [
        "kvio_transfer_direct_inline", "kvio_write_back_staged_after", "synchronous"]
    assert calls["stream.wait_event"] == 1  # the staged forms order themselves


class AfterLibrary(DirectLibrary):
    """DirectLibrary with kvio_transfer_direct_after and the job functions it reports on."""

    optional = (*DirectLibrary.optional, "kvio_transfer_direct_after", "kvio_job_status",
                "kvio_job_wait", "kvio_job_release")

    def has_direct_after(self) -> bool:
        return True


@pytest.mark.parametrize(("layout", "variant"), [("page_first", "staged"),
                                                 ("layer_first", "direct")])
def test_a_direct_write_back_after_the_callers_stream_is_ordered_by_the_library(
        direct_up_to_15_tokens: None, layout: str, variant: str) -> None:
    """Where the library has kvio_transfer_direct_after, a controller write-back through the
    direct kernel (page_first up to DIRECT_WRITE_BACK_MAX_BYTES; every layer_first one) hands
    the library the caller's stream to follow: no fence and no event of kvcore's, its host
    indices in the launch, and the library's job is its completion. The plan API (no
    ``after``) keeps the synchronous runner."""
    import collections

    from kvcore.native import BoundsCompletion
    from kvcore.testing.stand_in_streams import NullStream, stand_in_streams

    calls: collections.Counter[str] = collections.Counter()
    meta = torch.device("meta")
    with stand_in_streams(meta.type, calls):
        lib = AfterLibrary()
        run, host = _meta_runner(lib, layout, variant)
        assert run.follows is True
        stream, caller = NullStream(meta, calls), NullStream(meta, calls)
        h = torch.arange(16, 31)
        job = run(h, torch.arange(15, device=meta), None, stream, False, caller)
        plan_api = run(h, torch.arange(15, device=meta), None, stream, False)
    assert (calls["event.record"], calls["stream.wait_event"]) == (0, 0)
    assert isinstance(job, NativeJob) and not isinstance(plan_api, NativeJob)
    (name, direction, _k, _v, first, count, base, _layout, hp, h64, _dp, d64, n, inline, s,
     after, bounds, _out) = lib.handed[0]
    assert (name, direction, first, count, n, inline) == (
        "kvio_transfer_direct_after", 0, 0, 3, 15, 1)
    assert (s, after) == (stream.native_handle, caller.native_handle)
    assert (hp, h64, d64, base) == (h.data_ptr(), 1, 1, host.buffer.data_ptr() or None)
    assert isinstance(bounds, KvioBounds) and bounds.host_tokens == 64
    assert lib.handed[1][0] == ("synchronous" if variant == "staged"
                                else "kvio_transfer_direct_inline")
    assert isinstance(plan_api, BoundsCompletion) or plan_api is None
    assert job.query() is False
    lib.status[0x100] = 700
    with pytest.raises(KernelError, match="kvio_transfer_direct_after"):
        job.check()


def test_a_direct_write_back_after_refuses_cpu_host_indices_beyond_the_launchs_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More CPU host indices than the launch carries are refused before any call (a bound
    plan places them on the device first; this is the runner's own guard)."""
    from kvcore.testing.stand_in_streams import NullStream, stand_in_streams

    monkeypatch.setattr("kvcore.native_abi.INLINE_INDEX_TOKENS", 4)
    monkeypatch.setattr("kvcore.native_abi.INLINE_INDEX_PAGES", 0)
    meta = torch.device("meta")
    calls: dict[str, int] = {}
    with stand_in_streams(meta.type, calls):
        lib = AfterLibrary()
        run, _ = _meta_runner(lib, "layer_first", "direct")
        stream, caller = NullStream(meta, calls), NullStream(meta, calls)
        with pytest.raises(InvalidArgument, match="host_indices"):
            run(torch.arange(16), torch.arange(16, device=meta), None, stream, False, caller)
    assert lib.handed == []


@pytest.mark.parametrize("value", ["2", "yes", "inline", "off"])
def test_an_unknown_write_back_mode_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from kvcore.errors import InvalidArgument

    monkeypatch.setenv("KVCORE_ASYNC_WRITE_BACK", value)
    expected = rf"KVCORE_ASYNC_WRITE_BACK.*one of 0 \(.*1 \(.*'{value}'"
    with pytest.raises(InvalidArgument, match=expected):
        _runner(JobLibrary())


def test_the_environment_can_keep_write_backs_on_the_callers_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCORE_ASYNC_WRITE_BACK", "0")
    lib = JobLibrary()
    run, *_ = _runner(lib)
    assert not getattr(run, "follows", False)
    assert not isinstance(run(torch.arange(16), torch.arange(16), None, None, False), NativeJob)
    assert lib.handed[0][0] == "synchronous"


# -- the write queue --------------------------------------------------------------------------


def test_a_write_whose_job_failed_is_never_acknowledged_and_its_slots_are_released() -> None:
    alloc = SlotAllocator(16 * 4, 4)
    q = WriteQueue(alloc, None, Health())
    lib = JobLibrary()
    free = alloc.available_size()
    ok, ok_handle = _job(lib)
    bad, bad_handle = _job(lib)
    q.add(alloc.alloc(4), torch.arange(4), ok, [ok], True)
    q.add(alloc.alloc(4), torch.arange(4), bad, [bad], True)
    assert q.drain(block=False) == []  # neither issued yet
    lib.status[ok_handle], lib.status[bad_handle] = 0, 1
    with pytest.raises(TransferFailed, match=r"write-back 1 failed at completion; its 4 host "
                                             r"slots were released"):
        q.drain(block=False)
    assert [a.id for a in q.drain(block=False)] == [0]
    assert alloc.available_size() == free - 4


def test_a_sticky_fault_of_a_job_marks_the_controller_lost_and_fails_the_later_writes() -> None:
    alloc, health, q, lib = _queue_with_real_checks()
    free = alloc.available_size()
    first, first_handle = _job(lib)
    second, second_handle = _job(lib)
    q.add(alloc.alloc(4), torch.arange(4), first, [first], True)
    q.add(alloc.alloc(4), torch.arange(4), second, [second], True)
    lib.status[first_handle] = lib.status[second_handle] = 700
    with pytest.raises(TransferFailed, match=r"cuda error 700.*sticky") as err:
        q.drain(block=False)
    assert isinstance(err.value.cause, DeviceFault)
    assert health.lost is err.value.cause
    with pytest.raises(ControllerUnusable, match="device fault"):
        health.check()
    with pytest.raises(ControllerUnusable, match="1 queued write-backs were dropped"):
        q.drain(block=True)  # the second is abandoned, never acknowledged
    assert len(q) == 0 and alloc.available_size() == free


def test_a_job_failing_with_an_ordinary_error_leaves_the_controller_usable() -> None:
    alloc, health, q, lib = _queue_with_real_checks()
    job, handle = _job(lib)
    q.add(alloc.alloc(4), torch.arange(4), job, [job], True)
    lib.status[handle] = 2  # out of memory: this transfer failed, the device did not
    with pytest.raises(TransferFailed) as err:
        q.drain(block=False)
    assert type(err.value.cause) is KernelError
    assert health.lost is None
    health.check()


def _queue_with_real_checks() -> tuple[SlotAllocator, Health, WriteQueue, JobLibrary]:
    """A write queue and a job library whose status codes go through NativeLibrary.check
    (700 sticky), as a real binding's do."""
    from kvcore.native_abi import NativeLibrary

    alloc = SlotAllocator(16 * 4, 4)
    health = Health()
    lib = JobLibrary()
    binding = NativeLibrary(runtime="cuda", name="kvio_cuda", lib=_abi_stand_in(),
                            sticky_codes={700})
    lib.check = binding.check  # type: ignore[method-assign]
    return alloc, health, WriteQueue(alloc, None, health), lib


def _abi_stand_in() -> Any:
    """The ABI's required functions, enough to bind a NativeLibrary for its checks."""
    import types

    from kvcore.native_abi import ABI_VERSION

    return types.SimpleNamespace(
        kvio_abi_version=lambda: ABI_VERSION, kvio_has_batched_memcpy=lambda: 0,
        kvio_error_string=lambda code: b"an illegal memory access was encountered"
        if code.value == 700 else b"out of memory",
        kvio_transfer_direct=lambda *a: 0, kvio_write_back_staged=lambda *a: 0)


# -- the bound plan -----------------------------------------------------------------------


class HandingOver:
    """A backend (the reference's behaviour) whose write-back runner takes ``after`` itself
    and returns a job another thread would finish; every other op runs as the reference's."""

    def __init__(self, device: torch.device) -> None:
        from kvio_reference.backend import ReferenceBackend

        self.inner = ReferenceBackend(device)
        self.after: list[Any] = []
        self.lib = JobLibrary()

    def run(self, job: Any) -> Any:
        return self.inner.run(job)

    def prepare(self, job: Any) -> Any:
        from kvcore.backend import job_runner

        plain = job_runner(self.inner.run, job)
        if job.op is not Op.WRITE_BACK:
            runner = plain
            runner.follows = True  # type: ignore[attr-defined]  # ignored off write-back
            return runner

        def run(h: torch.Tensor, d: torch.Tensor, layer: int | None, stream: Any,
                chained: bool, after: Any = None) -> Any:
            plain(h, d, layer, stream, chained)  # the copy, done here; the job reports it
            self.after.append(after)
            if after is None:
                return None
            return _job(self.lib)[0]

        run.follows = True  # type: ignore[attr-defined]
        return run


def test_a_plan_hands_its_callers_stream_to_a_runner_that_follows_it_and_waits_on_its_job(
) -> None:
    from kvcore.capabilities import Residency, op_support
    from kvcore.layout import Kind, Layout
    from kvcore.registry import Registry, allocate_host_pool, make_request

    from .helpers import fake_spec

    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    with reg.isolated():
        # both index sets on the host: they fit a CPU pool as they come, so nothing is placed
        # on the stream first (which would fence there and then)
        ops = tuple(op_support(op, tuple(Kind), tuple(Layout), Residency.HOST, Residency.HOST)
                    for op in Op)
        spec = fake_spec("handing", ops=ops)
        reg.register(type(spec)(capabilities=spec.capabilities, factory=HandingOver))
        plan = reg.resolve(make_request(Op.WRITE_BACK, "mha", "page_first", torch.bfloat16,
                                        256, "cpu"), "handing")
        dev = DevicePool.allocate("mha", 3, 64, 2, 64, torch.bfloat16, "cpu", 16)
        host = allocate_host_pool("mha", "page_first", 3, 64, 2, 64, torch.bfloat16, 16, "cpu",
                                  backend="reference", registry=reg)
        bound = plan.bind(dev, host)
        h, d = torch.arange(16, 32), torch.arange(16)
        from kvcore.testing.stand_in_streams import NullStream

        caller = NullStream(torch.device("cpu"))  # a stream of the plan's device
        sub = bound.submit(h, d, after=caller)
        assert isinstance(sub.event, NativeJob) and sub.completions == [sub.event]
        assert sub.query() is False  # the thread has not finished it
        bound.backend.lib.status[0x100] = 0
        assert sub.query() is True
        sub.check()
        plain = bound.submit(h, d)  # the plan API: enqueued (here: done) before it returns
        assert not isinstance(plain.event, NativeJob)
        assert bound.backend.after == [caller, None]
