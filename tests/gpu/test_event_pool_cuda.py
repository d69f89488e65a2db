"""What kvcore.streams.EventPool relies on, on a real GPU: an event recorded again leaves a
wait already enqueued on its earlier record bound to that record (GPU machines only)."""

from __future__ import annotations

import pytest
import torch

from kvcore.streams import recorded_event

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_wait_enqueued_before_an_event_is_recorded_again_keeps_its_record() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    busy, waiter, idle = (torch.cuda.Stream(device) for _ in range(3))
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # about 100 ms
        event = recorded_event(device, busy)
    waiter.wait_event(event)  # bound to the record behind the sleep
    after_wait = torch.cuda.Event()
    after_wait.record(waiter)
    first = id(event)
    del event  # nothing holds it now: the pool records it again (after any older free ones)
    others = []
    for _ in range(4096):
        again = recorded_event(device, idle)
        if id(again) == first:
            break
        others.append(again)  # held, so the pool moves on to the next
    assert id(again) == first
    again.synchronize()  # its new record, on an idle stream, completes at once
    assert not after_wait.query(), "the wait followed the new record, not the one it was made on"
    torch.cuda.synchronize()
    assert after_wait.query()


def test_a_held_event_is_never_recorded_again_on_the_gpu() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    held = [recorded_event(device, None) for _ in range(8)]
    fresh = [recorded_event(device, None) for _ in range(8)]
    assert not {id(e) for e in held} & {id(e) for e in fresh}
    torch.cuda.synchronize()
