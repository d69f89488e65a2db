"""Putting index tensors where a variant wants them, without waiting for the device.

:func:`place` is the general rule (a dtype the variant accepts, contiguous, on the CPU or the
device). :class:`IndexRing` is the fast way for the common case of a submit: CPU indices a
kernel reads on the device. It copies them through memory allocated once, a pinned ring and a
device ring, instead of a pinned allocation, a staging copy and a device allocation per call
(about 20 us of the ~30 us a one-page load spent before its kernel). A slot is written again
only after the transfer that read it completed: each submit seals the slots it used with its
completion event, and a segment of the ring whose last users are still running is not taken;
the copy then goes through torch's allocators instead. The same tensor staged again on the
same stream with the same values (an engine submitting each layer of a load alone) gets the
slot it got before, while that slot is live, and nothing is copied again. Nothing here ever
waits.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvcore.capabilities import IndexSpec, residency_device
from kvcore.streams import Fence, has_streams, new_stream, synchronize_quietly

#: ring capacity per bound plan (pinned and device each): 64 pages of 64 tokens in int64 take
#: 32 KiB, so a segment holds several of the largest usual submits
RING_BYTES = 1 << 20
#: the ring is cut into this many segments, each reused as a whole
RING_SEGMENTS = 4
#: slots start at multiples of this (a kernel's vector loads of indices stay aligned)
SLOT_ALIGN = 256
#: staged tensors a ring remembers, to hand the same slot to another submit of the same
#: values on the same stream (each layer of a load submitted alone) instead of copying again
RECENT_STAGED = 8


def stream_key(stream: Any) -> Any:
    """What tells streams apart (torch's stream objects are made anew by each lookup; another
    object stands for itself)."""
    if stream is None:
        return None
    sid = getattr(stream, "stream_id", None)
    return stream if sid is None else (stream.device_index, sid)


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised pinned host memory, which a copy to the device reads without waiting (the
    one place this module pins: :mod:`kvcore.testing.stand_in_streams` swaps it for plain
    memory where torch has none)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def place(indices: torch.Tensor, spec: IndexSpec, device: torch.device) -> torch.Tensor:
    """``indices`` where ``spec`` wants them, in a dtype it accepts, contiguous, on the current
    stream. A CPU tensor bound for a device with streams goes from pinned memory, without
    waiting; a device tensor bound for the CPU is copied back, which waits for the device
    (:class:`~kvcore.plan.BoundPlan` never asks for that unless the backend declares no
    variant taking device indices)."""
    target = residency_device(spec.residency, device)
    dtype = indices.dtype if indices.dtype in spec.dtypes else spec.dtypes[0]
    if indices.device == target and indices.dtype == dtype and indices.is_contiguous():
        return indices
    if indices.device.type == "cpu" and has_streams(target):
        staged = pinned_empty(indices.shape, dtype)
        staged.copy_(indices)
        return staged.to(target, non_blocking=True)
    return indices.to(device=target, dtype=dtype).contiguous()


class _Segment:
    __slots__ = ("events", "unsealed", "used")

    def __init__(self) -> None:
        self.used = 0  # bytes handed out since the segment was last reset
        self.unsealed = 0  # slots handed out whose transfer has not been sealed yet
        self.events: dict[Any, Any] = {}  # stream key -> completion event of its last user


#: ``upload(dst, src, nbytes, stream)``: enqueue a copy of ``nbytes`` pinned host bytes at
#: address ``src`` to device address ``dst`` on the torch stream ``stream``, without waiting
#: (a backend's ``upload_indices``, see docs/writing-a-backend.md)
Upload = Callable[[int, int, int, Any], None]


def _wait_for_readers(segments: list[_Segment]) -> None:
    """A dropped ring's release: return once every transfer that read one of its slots
    completed (a fault is the next device call's to report)."""
    for seg in segments:
        for event in list(seg.events.values()):
            synchronize_quietly(event)


class IndexRing:
    """Copies CPU index tensors to ``device`` through preallocated pinned and device memory;
    see the module docstring. One per bound plan; safe for concurrent submits (a lock held
    for the bookkeeping and the copy's enqueueing). With ``upload`` (the backend's own
    copy) the copy goes on the ring's own upload stream, and :meth:`ready` orders the
    stream :meth:`stage` named after it; else it goes through torch on the current stream.

    The upload stream keeps the copy off the transfer's stream: there it ran between the
    kernel before and the kernel that reads it, 2.5-11 us per submit of a queue of per-layer
    loads on an H100 (h100-2026-12-05d), while on its own stream it runs during the kernel
    before, and the transfer's stream then waits for an event that has mostly completed by
    the time it gets there."""

    def __init__(self, device: torch.device, capacity: int = RING_BYTES,
                 segments: int = RING_SEGMENTS, upload: Upload | None = None) -> None:
        self.device = device
        self.upload = upload
        self.segment_bytes = capacity // segments
        self._segments = [_Segment() for _ in range(segments)]
        self._current = 0
        self._pinned: torch.Tensor | None = None
        self._device_mem: torch.Tensor | None = None
        self._host_view: np.ndarray | None = None
        # dtype -> the whole ring as (host numpy, pinned, device) of that dtype: a slot is one
        # view of each (as_strided), not a slice and a dtype view (about 8 us per submit)
        self._typed: dict[torch.dtype, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}
        # how often each segment was reset: a slot handed out in an earlier generation of its
        # segment may hold other values now
        self._generations = [0] * segments
        # (id of the source tensor, dtype, stream key) -> (weak reference to the source,
        # segment, its generation, first element, device view, the proof it was staged
        # under) of the latest stagings
        self._recent: dict[tuple[int, torch.dtype, Any],
                           tuple[weakref.ref[torch.Tensor], int, int, int, torch.Tensor,
                                 object | None]] = {}
        # (dtype, first element) -> the device view last handed out from there: made once
        # per slot start and length (a view costs a microsecond; at most one is kept per
        # start, under a kilobyte each)
        self._views: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._upload_stream: Any = None  # made on the first upload, with its fence
        self._upload_fence: Fence | None = None
        # stream keys whose stagings were uploaded since their stream last waited (ready)
        self._unordered: set[Any] = set()
        self._lock = threading.Lock()
        # dropped (with its plan) while a transfer still reads a slot, the ring's memory would
        # go back to torch at once: another tensor's bytes read as that transfer's indices
        self._release = weakref.finalize(self, _wait_for_readers, self._segments)
        self._release.atexit = False

    def stage(self, indices: torch.Tensor, dtype: torch.dtype, stream: Any = None,
              remember: bool = True, proof: object | None = None,
              ) -> tuple[torch.Tensor, int] | None:
        """A device tensor of ``indices`` (a contiguous CPU tensor) as ``dtype``, for use on
        ``stream`` (with ``upload`` copied on the ring's stream, and :meth:`ready` must order
        ``stream`` before anything reads it; else copied on the current stream, which must be
        ``stream``), and the segment it came from (for :meth:`seal`); None where the ring has
        no free slot that large (the caller places it otherwise).

        The same tensor staged again on the same stream, with the same values, gets the slot
        it got before while that slot is still live: nothing is copied, and the slot is held
        until this submit too is sealed and done (the earlier copy is ahead on the stream).
        ``remember=False``: the caller will not stage this tensor again soon (a submit of a
        whole operation), so neither look for nor keep its slot. ``proof``: an object that
        stands for ``indices``'s values now (:meth:`~kvcore.validate.CheckedTensors.match`):
        a slot staged under the same object is reused without reading them again."""
        with self._lock:
            if not remember:
                return self._stage(indices, dtype, stream)
            key = (id(indices), dtype, stream_key(stream))
            reused = self._reuse(key, indices, proof)
            if reused is not None:
                return reused
            staged = self._stage(indices, dtype, stream)
            if staged is not None:
                self._remember(key, indices, *staged, proof)
            return staged

    def _reuse(self, key: tuple[int, torch.dtype, Any], indices: torch.Tensor,
               proof: object | None) -> tuple[torch.Tensor, int] | None:
        hit = self._recent.get(key)
        if hit is None:
            return None
        ref, segment, generation, first, dst, staged_under = hit
        n = indices.numel()
        if (ref() is not indices or self._generations[segment] != generation
                or dst.numel() != n):
            return None
        # the pinned slot still holds what was copied: the values must be equal, whatever
        # was written into the tensor since (through torch or a NumPy view); the same proof
        # as when it was staged says so without reading them
        if proof is None or staged_under is not proof:
            slot = self._typed[dst.dtype][0][first:first + n]
            if dst.dtype is indices.dtype:  # (staged contiguous: its bytes, without NumPy)
                same = slot.tobytes() == ctypes.string_at(indices.data_ptr(), slot.nbytes)
            else:
                same = bool(np.array_equal(slot, indices.numpy()))
            if not same:
                return None
        self._segments[segment].unsealed += 1
        return dst, segment

    def _remember(self, key: tuple[int, torch.dtype, Any], indices: torch.Tensor,
                  dst: torch.Tensor, segment: int, proof: object | None) -> None:
        recent = self._recent
        recent.pop(key, None)
        if len(recent) >= RECENT_STAGED:
            recent.pop(next(iter(recent)))
        first = int(dst.storage_offset())
        recent[key] = (weakref.ref(indices), segment, self._generations[segment], first, dst,
                       proof)

    def _stage(self, indices: torch.Tensor, dtype: torch.dtype, stream: Any,
               ) -> tuple[torch.Tensor, int] | None:
        itemsize = dtype.itemsize
        nbytes = -(-indices.numel() * itemsize // SLOT_ALIGN) * SLOT_ALIGN
        if nbytes > self.segment_bytes or nbytes == 0:
            return None
        seg = self._segments[self._current]
        if seg.used + nbytes > self.segment_bytes:
            nxt = (self._current + 1) % len(self._segments)
            if not self._reset(nxt):
                return None
            self._current, seg = nxt, self._segments[nxt]
        if self._pinned is None:
            self._allocate()
        start = self._current * self.segment_bytes + seg.used
        seg.used += nbytes
        seg.unsealed += 1
        host, pinned, device_mem = self._typed.get(dtype) or self._typed_views(dtype)
        n, first = indices.numel(), start // itemsize
        dst = self._views.get((dtype, first))
        if dst is None or dst.numel() != n:
            dst = self._views[(dtype, first)] = device_mem.as_strided((n,), (1,), first)
        src = pinned.data_ptr() + start  # the slot's pinned bytes
        try:
            # bytes, without NumPy, where they are plain host memory laid out as the slot's
            if indices.dtype is dtype and indices.is_cpu and indices.is_contiguous():
                ctypes.memmove(src, indices.data_ptr(), n * itemsize)
            else:
                np.copyto(host[first:first + n], indices.numpy(), casting="unsafe")
            if self.upload is not None:
                if self._upload_stream is None:
                    self._upload_stream = new_stream(self.device)
                    self._upload_fence = Fence(self.device)
                self.upload(dst.data_ptr(), src, n * itemsize, self._upload_stream)
                self._unordered.add(stream_key(stream))
            else:
                dst.copy_(pinned.as_strided((n,), (1,), first), non_blocking=True)
        except BaseException:
            # nothing was enqueued and no submit will seal this slot: the segment must not
            # wait for it (its bytes stay used until the segment is reset)
            seg.unsealed -= 1
            raise
        return dst, self._current

    def ready(self, stream: Any) -> None:
        """Order ``stream`` after every upload made so far for stagings on it (one event on
        the upload stream, one wait), where there is one it does not wait for yet. A
        submit calls it after staging its indices and before enqueueing what reads them."""
        key = stream_key(stream)
        with self._lock:  # (held for the wait too: a submit reusing this slot must find it)
            if key not in self._unordered:
                return
            self._unordered.discard(key)
            assert self._upload_fence is not None
            self._upload_fence.order(stream, self._upload_stream)

    def _typed_views(self, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        assert self._host_view is not None and self._pinned is not None
        assert self._device_mem is not None
        views = (self._host_view.view(np.int64 if dtype is torch.int64 else np.int32),
                 self._pinned.view(dtype), self._device_mem.view(dtype))
        self._typed[dtype] = views
        return views

    def seal(self, segments: list[int], event: Any, stream_key: Any) -> None:
        """The slots of these segments handed out for one transfer are free again once
        ``event`` (recorded after that transfer) completed."""
        with self._lock:
            self._seal(segments, event, stream_key)

    def _seal(self, segments: list[int], event: Any, stream_key: Any) -> None:
        for i in segments:
            seg = self._segments[i]
            seg.unsealed -= 1
            seg.events[stream_key] = event

    def _reset(self, index: int) -> bool:
        seg = self._segments[index]
        if seg.unsealed or not all(e.query() for e in seg.events.values()):
            return False
        seg.events.clear()
        seg.used = 0
        self._generations[index] += 1
        return True

    def _allocate(self) -> None:
        size = self.segment_bytes * len(self._segments)
        self._pinned = pinned_empty((size,), torch.uint8)
        self._device_mem = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._host_view = self._pinned.numpy()
