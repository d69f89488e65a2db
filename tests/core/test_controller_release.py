"""A controller dropped with transfers in flight waits for them before its pools' memory can
be handed out again (tests/gpu/test_controller_release.py shows why, on a GPU)."""

from __future__ import annotations

import collections
import gc
import weakref

import torch

from kvcore.controller import HiCacheController
from kvcore.handles import PendingWrite, WriteAck
from kvcore.layout import Kind, Layout
from kvcore.testing.stand_in_streams import stand_in_streams

from .helpers import make_pools, reference_only


class Transfer:
    """A queued transfer's completion: done once waited for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
        self.log.append(self.name)

    def check(self) -> None:
        pass


def _controller() -> HiCacheController:
    registry = reference_only()
    dev, host = make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=2, host_pages=4,
                           device_size=32, head_num=2, head_dim=8, page_size=4,
                           dtype=torch.bfloat16, registry=registry)
    return HiCacheController(dev, host, registry=registry)


def _queue(ctl: HiCacheController, log: list[str], name: str) -> None:
    """A write-back in flight, as a backend that completes elsewhere leaves it queued."""
    h = ctl.allocator.alloc(4)
    ack = WriteAck(99, h, torch.arange(4))
    ctl._writes._pending.append(PendingWrite(ack, None, [Transfer(log, name)], True))


def test_a_dropped_controller_waits_for_its_queued_write_backs_and_is_freed() -> None:
    ctl = _controller()
    log: list[str] = []
    _queue(ctl, log, "first")
    _queue(ctl, log, "second")
    pools = weakref.ref(ctl.members[0].host)
    gone = weakref.ref(ctl)
    del ctl
    gc.collect()
    assert gone() is None, "the release must not keep the controller alive"
    assert log == ["first", "second"]
    assert pools() is None


def test_a_dropped_controller_with_nothing_queued_waits_for_nothing() -> None:
    ctl = _controller()
    ctl.write(torch.arange(8))
    assert len(ctl.wait_acks()) == 1
    release = ctl._release
    del ctl
    gc.collect()
    assert not release.alive  # ran once; a second call does nothing
    assert release() is None


def test_a_waiting_fault_stays_inside_the_release() -> None:
    """A transfer that fails while the release waits for it raises nothing at the drop (the
    controller is gone; the next call on the device reports a fault)."""

    class Faulting(Transfer):
        def synchronize(self) -> None:
            self.log.append(self.name)
            raise RuntimeError("an illegal memory access was encountered")

    ctl = _controller()
    log: list[str] = []
    h = ctl.allocator.alloc(4)
    ctl._writes._pending.append(PendingWrite(WriteAck(7, h, torch.arange(4)), None,
                                             [Faulting(log, "faulting")], True))
    _queue(ctl, log, "after it")
    del ctl
    gc.collect()
    assert log == ["faulting", "after it"]


def test_a_dropped_controller_drains_its_write_and_load_streams() -> None:
    """On the GPU's path (stand-in streams): the queued write-back's completion is waited for,
    then both of the controller's streams, and nothing else is asked of the runtime."""
    calls: collections.Counter[str] = collections.Counter()
    with stand_in_streams("cpu", calls):
        ctl = _controller()
        ctl.write(torch.arange(8))  # queued, not acknowledged
        calls.clear()
        del ctl
        gc.collect()
    assert calls["stream.synchronize"] == 2
    assert calls["event.synchronize"] >= 1
    assert set(calls) == {"stream.synchronize", "event.synchronize"}
