"""The signaled per-layer load as one library call (``KVCORE_SIGNALED_LOAD_JOB=1``): the
caller's order point, the launch and the completion event in ``kvio_load_layers_signaled_job``,
the completion a job that is the submission's event. No GPU needed: the library is a fake
that records its calls and whose jobs finish when the test says so."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from kvcore.backend import TransferJob
from kvcore.capabilities import HostMemory
from kvcore.errors import InvalidArgument, KernelError
from kvcore.layout import Geometry, Kind, Layout, Op, host_shape
from kvcore.native import BoundsCompletion, NativeBackend, NativeLayerSignals, native_ops
from kvcore.native_abi import JOB_PENDING, KvioBounds
from kvcore.native_job import NativeJob
from kvcore.plan import TransferPlan
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import make_request
from kvcore.testing.stand_in_streams import NullStream, stand_in_streams

LAYERS = 3


class SignalingLibrary:
    """What kvcore.native asks of a library with the signaled load, its job form and the job
    functions; ``job_form`` False: a library without the job form."""

    def __init__(self, job_form: bool = True) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.status: dict[int, int] = {}
        self.next_job = 0x100
        self.optional = {"kvio_load_layers_signaled", "kvio_transfer_direct_chained",
                         "kvio_copy_to_device"} | (
            {"kvio_load_layers_signaled_job"} if job_form else set())
        self.job_form = job_form

    def has_layer_signals(self) -> bool:
        return True

    def has_signaled_load_job(self) -> bool:
        return self.job_form

    def wait_layer_signal(self, *args: Any) -> None:
        self.calls.append(("wait", args))

    def unchecked(self, function: str, last: Any = None) -> Any:
        def call(*args: Any) -> None:
            self.calls.append((function, args))
            if function == "kvio_load_layers_signaled_job":
                job = self.next_job
                self.next_job += 0x10
                self.status[job] = JOB_PENDING
                ctypes.cast(args[-1], ctypes.POINTER(ctypes.c_void_p))[0] = job

        return call

    def transfer_direct(self, *args: Any, chained: bool = False, bounds: Any = None) -> None:
        self.calls.append(("kvio_transfer_direct", args))

    def job_status(self, job: int) -> int:
        return self.status[job]

    def job_wait(self, job: int) -> int:
        if self.status[job] == JOB_PENDING:
            self.status[job] = 0
        return self.status[job]

    def job_release(self, job: int) -> None:
        self.calls.append(("release", (job,)))

    def jobs_flush(self) -> None:
        pass

    def check(self, function: str, status: int) -> None:
        raise KernelError(f"{function}: failed (cuda error {status})", code=status)


class StreamsNative(NativeBackend):
    """Raw handles: None (the current stream) is 5, "caller" is 9, a stand-in stream its own."""

    def raw_stream(self, stream: Any) -> int:
        if isinstance(stream, NullStream):
            return stream.native_handle
        return {None: 5, "caller": 9}[stream]


def _pools() -> tuple[DevicePool, HostPool]:
    dev = DevicePool.allocate("mha", LAYERS, 64, 2, 64, torch.bfloat16, "cpu", 16)
    g = Geometry(Kind.MHA, Layout.PAGE_FIRST, LAYERS, 64, 2, 64, 16)
    host = HostPool.wrap(torch.empty(host_shape(g), dtype=torch.bfloat16), "mha", "page_first",
                         LAYERS, 2, 64, 16)
    return dev, host


def _runner(lib: SignalingLibrary) -> Any:
    dev, host = _pools()
    backend = StreamsNative(torch.device("cpu"), lib)  # type: ignore[arg-type]
    support = next(s for s in native_ops(signaled_load=True)
                   if s.op is Op.LOAD_LAYER and s.variant == "signaled")
    none = torch.empty(0, dtype=torch.int64)
    return backend.prepare(TransferJob(
        op=Op.LOAD_LAYER, support=support, device_pool=dev, host_buffer=host.buffer,
        host_geometry=host.geometry, host_strides=host.strides, host_indices=none,
        device_indices=none))


@pytest.fixture
def job_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCORE_SIGNALED_LOAD_JOB", "1")


def test_with_a_stream_to_follow_the_whole_load_is_one_call_whose_job_is_its_completion(
        job_mode: None) -> None:
    lib = SignalingLibrary()
    run = _runner(lib)
    assert run.follows is True
    h, d = torch.arange(16, 32), torch.arange(16, dtype=torch.int32)
    signals = run(h, d, None, None, False, "caller")
    assert isinstance(signals, NativeLayerSignals)
    assert isinstance(signals.completion, NativeJob)
    ((function, args),) = lib.calls
    assert function == "kvio_load_layers_signaled_job"
    assert args[2] == LAYERS and args[5:10] == (h.data_ptr(), 1, d.data_ptr(), 0, 16)
    epoch, stream, after, bounds = args[12:16]
    assert (epoch, stream, after) == (signals.epoch, 5, 9)
    assert isinstance(bounds, KvioBounds) and bounds.host_tokens == 64
    assert signals.completion.query() is False
    lib.status[0x100] = 0
    assert signals.completion.query() is True
    signals.check()
    assert ("release", (0x100,)) in lib.calls


def test_a_failed_job_fails_the_loads_check_naming_the_call(job_mode: None) -> None:
    lib = SignalingLibrary()
    signals = _runner(lib)(torch.arange(16), torch.arange(16), None, None, False, "caller")
    lib.status[0x100] = 719
    with pytest.raises(KernelError, match="kvio_load_layers_signaled_job"):
        signals.check()


@pytest.mark.parametrize("setting", ["default", "no job form"])
def test_otherwise_the_load_is_launched_alone_and_the_plan_fences(
        monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    if setting == "no job form":
        monkeypatch.setenv("KVCORE_SIGNALED_LOAD_JOB", "1")
    lib = SignalingLibrary(job_form=setting == "default")
    run = _runner(lib)
    assert run.follows is False  # the plan orders the load after its caller
    signals = run(torch.arange(16), torch.arange(16), None, None, False)
    assert signals.completion is None
    assert [f for f, _ in lib.calls] == ["kvio_load_layers_signaled"]


def test_one_layer_of_a_following_runner_goes_alone_after_a_fence(job_mode: None) -> None:
    lib = SignalingLibrary()
    done = _runner(lib)(torch.arange(16), torch.arange(16), 1, None, True, "caller")
    assert isinstance(done, BoundsCompletion)
    assert [f for f, _ in lib.calls] == ["kvio_transfer_direct_chained"]


def test_an_unknown_mode_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                       ) -> None:
    monkeypatch.setenv("KVCORE_SIGNALED_LOAD_JOB", "yes")
    with pytest.raises(InvalidArgument, match=r"KVCORE_SIGNALED_LOAD_JOB.*one of 0 \("):
        _runner(SignalingLibrary())


def test_a_plan_hands_its_callers_stream_over_and_the_job_is_the_submissions_event(
        job_mode: None) -> None:
    """Through BoundPlan.submit on the GPU's path (stand-in streams: the CPU indices go
    through the index ring first, and the caller's stream is then the job's to follow)."""
    lib = SignalingLibrary()
    req = make_request(Op.LOAD_LAYER, "mha", "page_first", torch.bfloat16, 256, "cpu")
    with stand_in_streams("cpu") as current:
        backend = StreamsNative(torch.device("cpu"), lib)  # type: ignore[arg-type]
        plan = TransferPlan(request=req, backend_name="native", backend_version="0",
                            host_memory=HostMemory.PLAIN,
                            variants=tuple(s for s in native_ops(signaled_load=True)
                                           if s.op is Op.LOAD_LAYER and s.variant == "signaled"),
                            instance=lambda: backend)
        bound = plan.bind(*_pools())
        caller = NullStream(torch.device("cpu"))
        h, d = torch.arange(16, 32), torch.arange(16)
        sub = bound.submit(h, d, after=caller)
        assert isinstance(sub.event, NativeJob) and sub.layers == tuple(range(LAYERS))
        assert sub.query() is False
        lib.status[0x100] = 0
        assert sub.query() is True
        sub.check()
        plain = bound.submit(h, d)  # the plan API, no stream to follow: launched alone
        assert not isinstance(plain.event, NativeJob)
    launches = [(f, a) for f, a in lib.calls if f.startswith("kvio_load")]
    assert [f for f, _ in launches] == ["kvio_load_layers_signaled_job",
                                        "kvio_load_layers_signaled"]
    assert launches[0][1][13:15] == (current.native_handle, caller.native_handle)


def test_a_load_dropped_before_it_finished_is_given_back_without_waiting(job_mode: None,
                                                                         ) -> None:
    """A consumer drops its load handle once every layer's wait is enqueued, while the load
    still runs: waiting for the job then would stall the caller (a write-back's job does wait:
    its memory must outlive it)."""
    import gc

    lib = SignalingLibrary()
    signals = _runner(lib)(torch.arange(16), torch.arange(16), None, None, False, "caller")
    assert lib.status[0x100] == JOB_PENDING
    del signals
    gc.collect()
    assert lib.calls[-1] == ("release", (0x100,))
    assert lib.status[0x100] == JOB_PENDING  # never waited for (job_wait would finish it)
