"""IndexRing reuses a slot only after the transfer that read it completed, and never waits.

On a CPU machine the ring's pinned and device memory are plain CPU tensors and the events
stand-ins whose completion the test decides; the bookkeeping under test is the same."""

from __future__ import annotations

import ctypes
import gc
import weakref

import pytest
import torch

from kvcore.placement import SLOT_ALIGN, IndexRing


class Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _ring(segments: int = 2, segment_bytes: int = 4 * SLOT_ALIGN,
          upload: object = None) -> IndexRing:
    ring = IndexRing(torch.device("cpu"), capacity=segments * segment_bytes, segments=segments,
                     upload=upload)  # type: ignore[arg-type]

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
    b = ring.stage(one_slot.clone(), torch.int64)
    assert b is not None and b[1] == 1
    done = Event()
    done.done = True
    ring.seal([1], done, "s")
    assert ring.stage(one_slot.clone(), torch.int64) is None  # would reuse unsealed segment 0


def test_a_tensor_larger_than_a_segment_is_left_to_the_caller() -> None:
    ring = _ring(segments=2, segment_bytes=SLOT_ALIGN)
    assert ring.stage(torch.arange(SLOT_ALIGN // 8 + 1), torch.int64) is None
    assert ring.stage(torch.arange(0), torch.int64) is None


class Stream:
    """Stands for a stream: records the events it is made to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waits: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waits.append(event)


class RecordedEvent:
    """Stands for the upload fence's event: each record is a new point, noted with its
    stream."""

    def __init__(self, recorded: list[tuple[str, object]]) -> None:
        self.recorded = recorded

    def record(self, stream: Stream) -> None:
        self.recorded.append((stream.name, object()))


class RecordingStream(Stream):
    def wait_event(self, event: object) -> None:  # waits for the event's latest record
        assert isinstance(event, RecordedEvent)
        self.waits.append(event.recorded[-1][1])


def _streams(monkeypatch: pytest.MonkeyPatch) -> tuple[Stream, list[tuple[str, object]]]:
    """The ring's upload stream, made by kvcore.placement.new_stream, and the points its
    fence recorded (on which stream)."""
    import kvcore.placement
    import kvcore.streams

    upload_stream = Stream("upload")
    recorded: list[tuple[str, object]] = []
    monkeypatch.setattr(kvcore.placement, "new_stream", lambda device: upload_stream)
    monkeypatch.setattr(kvcore.streams, "new_event", lambda device: RecordedEvent(recorded))
    return upload_stream, recorded


def test_with_the_backends_upload_the_copy_goes_on_the_rings_own_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    upload_stream, _ = _streams(monkeypatch)
    calls: list[tuple[int, int, int, object]] = []

    def upload(dst: int, src: int, nbytes: int, stream: object) -> None:
        calls.append((dst, src, nbytes, stream))
        ctypes.memmove(dst, src, nbytes)  # what the library's copy does, later on the stream

    ring = _ring(upload=upload)
    src = torch.randint(0, 1 << 30, (37,), generator=torch.Generator().manual_seed(4))
    out, _ = ring.stage(src, torch.int32, Stream("transfer"))  # type: ignore[misc]
    assert ring._pinned is not None and ring._device_mem is not None
    assert calls == [(ring._device_mem.data_ptr(), ring._pinned.data_ptr(), 37 * 4,
                      upload_stream)]
    assert out.data_ptr() == ring._device_mem.data_ptr() and torch.equal(out, src.to(torch.int32))


def test_a_stream_waits_once_for_the_uploads_staged_for_it_and_only_for_those(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What reads a slot is enqueued after ready(): its stream then waits for an event
    recorded on the upload stream after the slot's copy. A stream with nothing uploaded
    since its last wait (a slot reused, another stream's copy) waits for nothing."""
    _, recorded = _streams(monkeypatch)
    ring, copies = _counting_ring(segments=2, segment_bytes=16 * SLOT_ALIGN)
    a, b = RecordingStream("a"), RecordingStream("b")
    src = torch.arange(40)
    ring.stage(src, torch.int64, a)
    ring.stage(src + 1, torch.int32, a)  # two copies for one submit: one wait
    ring.ready(a)
    assert len(copies) == 2 and [name for name, _ in recorded] == ["upload"]
    assert a.waits == [recorded[0][1]]
    ring.ready(a)  # nothing new for it
    ring.stage(src, torch.int64, a)  # the same slot again: no copy, no wait
    ring.ready(a)
    ring.ready(b)  # nothing staged for b
    assert len(copies) == 2 and len(a.waits) == 1 and b.waits == []
    ring.stage(src, torch.int64, b)  # another stream: copied anew, and b waits for it
    ring.ready(b)
    assert len(copies) == 3 and len(b.waits) == 1 and b.waits[0] is recorded[1][1]
    assert len(a.waits) == 1


def test_without_the_backends_upload_nothing_needs_a_wait() -> None:
    ring = _ring()
    transfer = Stream("transfer")
    ring.stage(torch.arange(8), torch.int64, transfer)  # (torch's copy on the current stream)
    ring.ready(transfer)
    assert transfer.waits == []


def test_slots_reused_with_other_lengths_and_dtypes_hold_exactly_the_new_values() -> None:
    ring = _ring(segments=2, segment_bytes=16 * SLOT_ALIGN)
    gen = torch.Generator().manual_seed(5)
    for n, dtype in [(8, torch.int64), (8, torch.int32), (5, torch.int64), (8, torch.int64)]:
        for seg in (0, 1):  # fill both segments, then come back to the same slots
            ring._segments[seg].used = 0
            ring._current = seg
            src = torch.randint(0, 1 << 30, (n,), generator=gen)
            out, _ = ring.stage(src, dtype)  # type: ignore[misc]
            assert out.dtype == dtype and out.numel() == n
            assert torch.equal(out, src.to(dtype))


# -- the same indices staged again (each layer of a load submitted alone) -------------------


def _counting_ring(**kwargs: int) -> tuple[IndexRing, list[int]]:
    copies: list[int] = []

    def upload(dst: int, src: int, nbytes: int, stream: object) -> None:
        copies.append(nbytes)
        ctypes.memmove(dst, src, nbytes)

    return _ring(upload=upload, **kwargs), copies


def test_the_same_indices_on_the_same_stream_reuse_their_slot_until_it_is_done() -> None:
    ring, copies = _counting_ring(segments=2, segment_bytes=SLOT_ALIGN)
    src = torch.arange(SLOT_ALIGN // 8)  # one slot fills a segment
    first, seg = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    layer0 = Event()
    ring.seal([seg], layer0, "s")  # each submit seals in stream order, as BoundPlan.submit
    events = []
    for _ in range(3):  # layers 1..3 of the same load
        again, seg_again = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
        assert again.data_ptr() == first.data_ptr() and seg_again == seg
        events.append(Event())
        ring.seal([seg_again], events[-1], "s")
    assert copies == [SLOT_ALIGN]  # one copy for the four submits
    layer0.done = True
    other = torch.arange(SLOT_ALIGN // 8) + 7
    assert ring.stage(other, torch.int64, "s") is not None  # segment 1
    # segment 0 is held by the last submit that reused it, not by the first one's completion
    assert ring.stage(other.clone(), torch.int64, "s") is None
    events[-1].done = True
    assert ring.stage(other.clone(), torch.int64, "s") is not None


def test_changed_values_another_stream_or_dtype_are_copied_anew() -> None:
    ring, copies = _counting_ring(segments=2, segment_bytes=16 * SLOT_ALIGN)
    src = torch.arange(40)
    a, _ = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    src.numpy()[3] = 1000  # a write torch does not count (no version bump)
    b, _ = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    assert b.data_ptr() != a.data_ptr() and int(b[3]) == 1000 and int(a[3]) == 3
    src[4] = 2000
    c, _ = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    assert int(c[4]) == 2000
    d, _ = ring.stage(src, torch.int64, "other stream")  # type: ignore[misc]
    e, _ = ring.stage(src, torch.int32, "s")  # type: ignore[misc]
    assert len({t.data_ptr() for t in (a, b, c, d, e)}) == 5 and len(copies) == 5
    assert torch.equal(d, src) and torch.equal(e, src.to(torch.int32))
    same, _ = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    assert same.data_ptr() == c.data_ptr() and len(copies) == 5


def test_a_slot_staged_under_a_proof_is_reused_under_it_and_values_changed_since_are_not(
        ) -> None:
    """With kvcore.validate.CheckedTensors's proofs: the same proof reuses the slot without
    reading the tensor, and a change, after which it gives a new proof, stages the new
    values."""
    from kvcore.validate import CheckedTensors

    ring, copies = _counting_ring(segments=2, segment_bytes=16 * SLOT_ALIGN)
    seen = CheckedTensors()
    src = torch.randint(0, 1 << 20, (40,), generator=torch.Generator().manual_seed(9))
    proof = seen.add(src)
    a, _ = ring.stage(src, torch.int64, "s", proof=proof)  # type: ignore[misc]
    for _ in range(3):
        same, _ = ring.stage(src, torch.int64, "s", proof=seen.match(src))  # type: ignore[misc]
        assert same.data_ptr() == a.data_ptr()
    assert len(copies) == 1
    src[7] = -5
    assert seen.match(src) is None
    changed, _ = ring.stage(src, torch.int64, "s", proof=seen.add(src))  # type: ignore[misc]
    assert changed.data_ptr() != a.data_ptr() and torch.equal(changed, src)
    assert len(copies) == 2
    # another object is no proof: the slot is read and still matches
    equal, _ = ring.stage(src, torch.int64, "s", proof=object())  # type: ignore[misc]
    assert equal.data_ptr() == changed.data_ptr() and len(copies) == 2
    src[8] = -6  # no proof at all: read, differs, copied anew
    fresh, _ = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    assert fresh.data_ptr() != changed.data_ptr() and torch.equal(fresh, src)


def test_a_slot_of_a_segment_reset_since_is_never_handed_out_again() -> None:
    ring, copies = _counting_ring(segments=2, segment_bytes=SLOT_ALIGN)
    src = torch.arange(SLOT_ALIGN // 8)
    a, seg = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    done = Event()
    done.done = True
    ring.seal([seg], done, "s")
    for k in (1, 2):  # segment 1, then segment 0 again: reset, its slot rewritten
        _, segment = ring.stage(src + k, torch.int64, "s")  # type: ignore[misc]
        ring.seal([segment], done, "s")
    assert int(a[0]) == 2  # the old slot now holds other values
    b, _ = ring.stage(src, torch.int64, "s")  # type: ignore[misc]
    assert torch.equal(b, src) and len(copies) == 4


def test_a_failed_upload_does_not_hold_its_segment() -> None:
    """The upload raised: nothing was enqueued and no submit seals the slot, so the segment
    it is in must still be reset once the transfers sealed into it completed."""
    fail = [True]

    def upload(dst: int, src: int, nbytes: int, stream: object) -> None:
        if fail.pop() if fail else False:
            raise RuntimeError("copy refused")
        ctypes.memmove(dst, src, nbytes)

    ring = _ring(segments=2, segment_bytes=2 * SLOT_ALIGN, upload=upload)
    one_slot = torch.arange(SLOT_ALIGN // 8)
    with pytest.raises(RuntimeError, match="copy refused"):
        ring.stage(one_slot, torch.int64, "s")
    done = Event()
    done.done = True
    for n in range(6):  # segment 0 (one slot left), 1, then 0 again, 1 again
        staged = ring.stage(one_slot + n, torch.int64, "s")
        assert staged is not None, f"stage {n}: the ring is stuck"
        assert torch.equal(staged[0], one_slot + n)
        ring.seal([staged[1]], done, "s")


def test_indices_it_cannot_read_fail_the_stage_without_holding_its_segment() -> None:
    """Memory the host cannot read as bytes (here a meta tensor; a device tensor alike) is
    never copied byte for byte: the stage raises, and the slot it took is given back."""
    ring = _ring(segments=2, segment_bytes=2 * SLOT_ALIGN)
    one_slot = torch.arange(SLOT_ALIGN // 8)
    with pytest.raises((RuntimeError, TypeError)):
        ring.stage(torch.arange(SLOT_ALIGN // 8, device="meta"), torch.int64, "s")
    done = Event()
    done.done = True
    for n in range(6):
        staged = ring.stage(one_slot + n, torch.int64, "s")
        assert staged is not None, f"stage {n}: the ring is stuck"
        ring.seal([staged[1]], done, "s")


def test_strided_and_other_dtype_indices_arrive_as_their_values() -> None:
    ring = _ring(segments=2, segment_bytes=16 * SLOT_ALIGN)
    gen = torch.Generator().manual_seed(11)
    base = torch.randint(0, 1 << 30, (64,), generator=gen)
    for src, dtype in [(base[::2], torch.int64), (base[::3], torch.int32),
                       (base.to(torch.int32), torch.int64), (base[5:37], torch.int64)]:
        out, _ = ring.stage(src, dtype)  # type: ignore[misc]
        assert out.dtype == dtype and torch.equal(out, src.to(dtype))


def test_a_dropped_ring_waits_for_every_transfer_that_read_a_slot() -> None:
    """Its memory goes back to torch once the ring is gone: no transfer may still read it."""
    ring = _ring(segments=2, segment_bytes=4 * SLOT_ALIGN)
    readers = [Event(), Event(), Event()]
    for i, event in enumerate(readers):
        _, seg = ring.stage(torch.arange(SLOT_ALIGN // 8) + i, torch.int64)  # type: ignore[misc]
        ring.seal([seg], event, f"stream {i}")
    gone = weakref.ref(ring)
    del ring
    gc.collect()
    assert gone() is None, "the release must not keep the ring alive"
    assert all(e.done for e in readers)
