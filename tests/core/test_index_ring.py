"""IndexRing reuses a slot only after the transfer that read it completed, and never waits.

On a CPU machine the ring's pinned and device memory are plain CPU tensors and the events
stand-ins whose completion the test decides; the bookkeeping under test is the same."""

from __future__ import annotations

import pytest
import torch

from kvcore.placement import SLOT_ALIGN, IndexRing


class Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _ring(segments: int = 2, segment_bytes: int = 4 * SLOT_ALIGN) -> IndexRing:
    ring = IndexRing(torch.device("cpu"), capacity=segments * segment_bytes, segments=segments)

    def allocate() -> None:  # no pinned memory on a CPU-only torch
        size = ring.segment_bytes * segments
        ring._pinned = torch.empty(size, dtype=torch.uint8)
        ring._device_mem = torch.full((size,), 0xAB, dtype=torch.uint8)
        ring._host_view = ring._pinned.numpy()

    ring._allocate = allocate  # type: ignore[method-assign]
    return ring


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_staged_values_arrive_in_the_dtype_asked_for(dtype: torch.dtype) -> None:
    ring = _ring()
    src = torch.randint(0, 1 << 30, (37,), generator=torch.Generator().manual_seed(3))
    staged = ring.stage(src, dtype)
    assert staged is not None
    out, segment = staged
    assert out.dtype == dtype and segment == 0
    assert torch.equal(out, src.to(dtype))


def test_a_segment_is_reused_only_once_every_transfer_that_read_it_completed() -> None:
    ring = _ring(segments=2, segment_bytes=4 * SLOT_ALIGN)
    one_slot = torch.arange(SLOT_ALIGN // 8)  # exactly one slot of int64
    first = Event()
    a, seg_a = ring.stage(one_slot, torch.int64)  # type: ignore[misc]
    ring.seal([seg_a], first, "s")
    for _ in range(3):  # the rest of segment 0
        _, seg = ring.stage(one_slot + 1, torch.int64)  # type: ignore[misc]
        ring.seal([seg], Event() if seg else first, "s")
    later = [ring.stage(one_slot + 2, torch.int64) for _ in range(4)]  # segment 1
    assert all(s is not None and s[1] == 1 for s in later)
    pending = Event()
    for s in later:
        ring.seal([s[1]], pending, "s")  # type: ignore[index]
    # segment 0's reader (first) still runs: nothing is handed out, nothing overwritten
    assert ring.stage(one_slot + 9, torch.int64) is None
    assert torch.equal(a, one_slot)
    first.done = True
    again = ring.stage(one_slot + 9, torch.int64)
    assert again is not None and again[1] == 0 and torch.equal(again[0], one_slot + 9)


def test_slots_handed_out_but_never_sealed_keep_their_segment_busy() -> None:
    ring = _ring(segments=2, segment_bytes=SLOT_ALIGN)
    one_slot = torch.arange(SLOT_ALIGN // 8)
    assert ring.stage(one_slot, torch.int64) is not None  # segment 0, never sealed
    b = ring.stage(one_slot, torch.int64)
    assert b is not None and b[1] == 1
    done = Event()
    done.done = True
    ring.seal([1], done, "s")
    assert ring.stage(one_slot, torch.int64) is None  # would reuse unsealed segment 0


def test_a_tensor_larger_than_a_segment_is_left_to_the_caller() -> None:
    ring = _ring(segments=2, segment_bytes=SLOT_ALIGN)
    assert ring.stage(torch.arange(SLOT_ALIGN // 8 + 1), torch.int64) is None
    assert ring.stage(torch.arange(0), torch.int64) is None
