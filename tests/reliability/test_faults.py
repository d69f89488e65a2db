"""Fault injection through a backend that really transfers (the reference) and fails on
command: synchronous raises, failures known only at completion, sticky device faults and
backends that fail to build. After each failure the pools and the allocator are checked."""

from __future__ import annotations

import pytest

from kvcore.controller import HiCacheController
from kvcore.errors import (
    BuildError,
    ControllerUnusable,
    DeviceFault,
    KernelError,
    KVCoreError,
    TransferFailed,
)
from kvcore.layout import Op
from kvcore.testing.faults import Fault, FaultInjector, FaultMode

from .helpers import Snapshot, bytes_equal, oracle_load, oracle_write, page_tokens, small_pools


def controller(faults: FaultInjector, **kw: object) -> HiCacheController:
    dev, host = small_pools(**kw)  # type: ignore[arg-type]
    return HiCacheController(dev, host, backend=faults.name)


def assert_round_trip_works(ctl: HiCacheController, device_pages: list[int]) -> None:
    """The controller still serves: a write-back and a load both match the oracle."""
    m = ctl.members[0]
    d = page_tokens(device_pages)
    before = Snapshot.of(ctl)
    ack = ctl.write(d)
    expected = oracle_write(m.device, m.host, ack.host_indices, d)
    assert ctl.wait_acks() == [ack]
    assert bytes_equal(m.host.buffer, expected)
    assert ctl.allocator.is_allocated(ack.host_indices)
    target = page_tokens([5])[: d.numel()] if len(device_pages) == 1 else d.flip(0)
    expected_dev = oracle_load(m.device, m.host, ack.host_indices, target)
    ctl.load(ack.host_indices, target).wait()
    for got, want in zip(m.device.all_buffers(), expected_dev, strict=True):
        assert bytes_equal(got, want)
    ctl.free_host(ack.host_indices)
    assert ctl.allocator.state() == before.allocator


@pytest.mark.parametrize("nth", [1, 2])
def test_write_raising_frees_its_host_pages_and_moves_nothing(faults: FaultInjector,
                                                               nth: int) -> None:
    ctl = controller(faults)
    faults.arm(Fault(Op.WRITE_BACK, nth=nth, mode=FaultMode.RAISE))
    if nth == 2:
        first = ctl.write(page_tokens([0]))
        assert ctl.wait_acks() == [first]
    before = Snapshot.of(ctl)
    with pytest.raises(TransferFailed) as info:
        ctl.write(page_tokens([1, 2]))
    assert isinstance(info.value.cause, KernelError)
    before.assert_unchanged(ctl)  # host slots released, no byte moved
    assert ctl.pending_writes == 0 and ctl.wait_acks() == []
    assert ctl.usable
    assert_round_trip_works(ctl, [1, 2])


def test_write_failing_at_completion_is_never_acknowledged(faults: FaultInjector) -> None:
    ctl = controller(faults)
    faults.arm(Fault(Op.WRITE_BACK, nth=2, mode=FaultMode.ASYNC))
    state0 = ctl.allocator.state()
    a = ctl.write(page_tokens([0]))
    b = ctl.write(page_tokens([1, 2]))  # runs, but reports failure at completion
    c = ctl.write(page_tokens([3]))
    for ack in (a, b, c):
        assert ctl.allocator.is_allocated(ack.host_indices)
    with pytest.raises(TransferFailed, match="released"):
        ctl.wait_acks()
    # b's slots are free again; a (completed before b) and c are still owned and reported
    assert not ctl.allocator.is_allocated(b.host_indices[:4])
    assert not ctl.allocator.is_allocated(b.host_indices[4:])
    assert ctl.wait_acks() == [a, c]
    assert ctl.completed_writes == 2
    ctl.free_host(a.host_indices)
    ctl.free_host(c.host_indices)
    assert sorted(ctl.allocator.state().free_pages) == sorted(state0.free_pages)
    assert ctl.usable
    assert_round_trip_works(ctl, [4])


def test_poll_reports_acks_completed_before_a_failure(faults: FaultInjector) -> None:
    ctl = controller(faults)
    faults.arm(Fault(Op.WRITE_BACK, nth=2, mode=FaultMode.ASYNC))
    a = ctl.write(page_tokens([0]))
    b = ctl.write(page_tokens([1]))
    with pytest.raises(TransferFailed):
        ctl.poll_acks()
    assert ctl.poll_acks() == [a]
    assert not ctl.allocator.is_allocated(b.host_indices)


@pytest.mark.parametrize("all_layers", [False, True])
def test_load_raising_leaves_pools_and_allocator_alone(faults: FaultInjector,
                                                       all_layers: bool) -> None:
    ctl = controller(faults)
    h = ctl.write(page_tokens([0, 1])).host_indices
    ctl.wait_acks()
    op = Op.LOAD_ALL if all_layers else Op.LOAD_LAYER
    faults.arm(Fault(op, nth=1, mode=FaultMode.RAISE))
    before = Snapshot.of(ctl)
    with pytest.raises(TransferFailed):
        ctl.load(h, page_tokens([3, 4]), all_layers=all_layers)
    before.assert_unchanged(ctl)
    assert ctl.usable
    ctl.free_host(h)
    assert_round_trip_works(ctl, [2, 3])


def test_load_failing_at_completion_raises_at_that_layer_and_after(
        faults: FaultInjector) -> None:
    ctl = controller(faults)
    m = ctl.members[0]
    h = ctl.write(page_tokens([0])).host_indices
    ctl.wait_acks()
    faults.arm(Fault(Op.LOAD_LAYER, nth=2, mode=FaultMode.ASYNC))  # layer 1 of this load
    before = Snapshot.of(ctl)
    handle = ctl.load(h, page_tokens([4]))
    handle.wait_layer(0)  # layer 0 landed and is reported as such
    with pytest.raises(TransferFailed, match="layer 1"):
        handle.wait_layer(1)
    for again in (handle.wait, handle.done, lambda: handle.wait_layer(0)):
        with pytest.raises(TransferFailed):
            again()
    assert ctl.allocator.state() == before.allocator
    assert bytes_equal(m.host.buffer, before.host.view(m.host.buffer.dtype)
                       .view(m.host.buffer.shape))
    assert ctl.usable
    ctl.free_host(h)
    assert_round_trip_works(ctl, [1])


def test_load_all_failing_at_completion(faults: FaultInjector) -> None:
    ctl = controller(faults)
    h = ctl.write(page_tokens([0])).host_indices
    ctl.wait_acks()
    faults.arm(Fault(Op.LOAD_ALL, nth=1, mode=FaultMode.ASYNC))
    handle = ctl.load(h, page_tokens([4]), all_layers=True)
    with pytest.raises(TransferFailed):
        handle.done()
    with pytest.raises(TransferFailed):
        handle.wait_layer(1)
    assert ctl.usable


def test_device_fault_on_submit_makes_the_controller_unusable(faults: FaultInjector) -> None:
    ctl = controller(faults)
    state0 = ctl.allocator.state()
    queued = ctl.write(page_tokens([0]))
    faults.arm(Fault(Op.WRITE_BACK, nth=2, mode=FaultMode.RAISE, error=DeviceFault))
    with pytest.raises(TransferFailed) as info:
        ctl.write(page_tokens([1]))
    assert isinstance(info.value.cause, DeviceFault)
    assert not ctl.usable
    calls = dict(faults.calls)
    for call in (lambda: ctl.write(page_tokens([2])),
                 lambda: ctl.load(queued.host_indices, page_tokens([3])),
                 ctl.wait_acks, ctl.poll_acks):
        with pytest.raises(ControllerUnusable, match="device fault"):
            call()
    assert dict(faults.calls) == calls  # refused without reaching the backend
    # the write queued before the fault is dropped, never acknowledged, its slots released
    assert ctl.pending_writes == 0
    assert ctl.allocator.state() == state0


def test_device_fault_at_completion_makes_the_controller_unusable(
        faults: FaultInjector) -> None:
    ctl = controller(faults)
    state0 = ctl.allocator.state()
    faults.arm(Fault(Op.WRITE_BACK, nth=1, mode=FaultMode.ASYNC, error=DeviceFault))
    ctl.write(page_tokens([0]))
    ctl.write(page_tokens([1]))
    with pytest.raises(TransferFailed):
        ctl.wait_acks()
    assert not ctl.usable
    with pytest.raises(ControllerUnusable, match="1 queued write-backs were dropped"):
        ctl.wait_acks()
    assert ctl.allocator.state().allocated == state0.allocated == ()
    with pytest.raises(ControllerUnusable):
        ctl.load(page_tokens([0]), page_tokens([2]))


def test_device_fault_in_a_load_makes_the_controller_unusable(faults: FaultInjector) -> None:
    ctl = controller(faults)
    h = ctl.write(page_tokens([0])).host_indices
    ctl.wait_acks()
    faults.arm(Fault(Op.LOAD_LAYER, nth=1, mode=FaultMode.ASYNC, error=DeviceFault))
    handle = ctl.load(h, page_tokens([1]))
    with pytest.raises(TransferFailed):
        handle.wait()
    assert not ctl.usable
    with pytest.raises(ControllerUnusable):
        ctl.write(page_tokens([2]))


def test_repeated_failures_never_leak_host_slots(faults: FaultInjector) -> None:
    ctl = controller(faults, host_pages=2)
    state0 = ctl.allocator.state()
    faults.arm(Fault(Op.WRITE_BACK, nth=1, mode=FaultMode.RAISE, repeat=True))
    for _ in range(5):  # would exhaust the 2-page host pool if a failure leaked a page
        with pytest.raises(TransferFailed):
            ctl.write(page_tokens([0, 1]))
    assert ctl.allocator.state() == state0
    faults.disarm()
    assert_round_trip_works(ctl, [0, 1])


@pytest.mark.parametrize("error", [BuildError("nvcc: unsupported gpu architecture"),
                                   OSError("libkvio.so: cannot open shared object file")])
def test_a_backend_that_fails_to_build_fails_construction(faults: FaultInjector,
                                                          error: Exception) -> None:
    faults.fail_build = error
    dev, host = small_pools()
    before = [t.clone() for t in dev.all_buffers()]
    with pytest.raises(BuildError) as info:
        HiCacheController(dev, host, backend=faults.name)
    assert faults.builds == 1
    assert str(error) in str(info.value)
    if not isinstance(error, KVCoreError):
        assert faults.name in str(info.value) and info.value.__cause__ is error
    assert host.allocator.state().allocated == ()
    assert all(bytes_equal(a, b) for a, b in zip(before, dev.all_buffers(), strict=True))
    # nothing half-made was cached: once the build works, construction builds and serves
    faults.fail_build = None
    ctl = HiCacheController(dev, host, backend=faults.name)
    assert faults.builds == 2
    assert_round_trip_works(ctl, [0])


def test_construction_builds_the_backend(faults: FaultInjector) -> None:
    assert faults.builds == 0
    controller(faults)
    assert faults.builds == 1  # at start-up, not at the first transfer


def test_writes_completed_before_a_device_fault_are_acknowledged_not_leaked(
        faults: FaultInjector) -> None:
    """Issue 25, item 5: a write that completed before a later one hit a device fault is
    acknowledged by the next poll (its pages are backed up), and nothing leaks."""
    ctl = controller(faults)
    state0 = ctl.allocator.state()
    faults.arm(Fault(Op.WRITE_BACK, nth=2, mode=FaultMode.ASYNC, error=DeviceFault))
    first = ctl.write(page_tokens([0]))
    ctl.write(page_tokens([1]))
    with pytest.raises(TransferFailed):
        ctl.wait_acks()  # the second write failed; the first had completed before it
    assert not ctl.usable
    assert [a.id for a in ctl.poll_acks()] == [first.id]
    assert ctl.allocator.is_allocated(first.host_indices)  # backed up: the caller frees it
    with pytest.raises(ControllerUnusable):
        ctl.poll_acks()
    ctl.free_host(first.host_indices)
    assert ctl.allocator.state() == state0
