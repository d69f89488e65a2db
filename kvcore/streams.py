"""Device-generic streams and events; on a device without streams (CPU) they are None.

Deciding by the pool's device type is not a platform check: it asks what the tensors in hand
support, through torch's device module for that type (``torch.get_device_module``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` becomes ``cuda:N`` for the current device N.

    Tensors always report an indexed device, so a request, a backend instance and a pool
    compare equal only once the index is filled in. A type whose device module cannot say
    (not compiled in, no driver) is returned as given; availability reports the cause later.
    """
    d = torch.device(device)
    if d.index is not None or not has_streams(d):
        return d
    try:
        return torch.device(d.type, torch.get_device_module(d).current_device())
    except (AssertionError, AttributeError, RuntimeError):
        return d


def has_streams(device: torch.device) -> bool:
    """Whether work on ``device`` is asynchronous and ordered by streams."""
    known = _HAS_STREAMS.get(device)
    if known is None:  # (a torch.device's type is a new string per read: a quarter us)
        known = _HAS_STREAMS[device] = device.type not in ("cpu", "meta")
    return known


_HAS_STREAMS: dict[torch.device, bool] = {}


def new_stream(device: torch.device) -> Any:
    """A new stream on ``device``, or None where the device has no streams."""
    if not has_streams(device):
        return None
    return torch.get_device_module(device).Stream(device=device)


def current_stream(device: torch.device) -> Any:
    """The stream new work on ``device`` is ordered on, or None.

    For the accelerator torch runs on this is torch's generic :class:`torch.Stream` (a lookup
    of under a microsecond; the device module's own ``current_stream`` builds a Python
    subclass and costs several: this is on every submit and every ``wait_layer``).
    """
    lookup = _CURRENT.get(device)
    if lookup is None:
        lookup = _CURRENT.setdefault(device, _current_stream_lookup(device))
    return lookup()


class CurrentStream:
    """``device``'s current stream (:func:`current_stream`), the same object again while the
    stream stays current. ``handle``: a lookup of the current stream's raw handle that builds
    no stream object (a backend's, where it has one; None: every call looks the stream up).
    Building the object cost a one-page ``write()`` about 5% of its CPU on an H100 host
    (docs/benchmarks/h100-2026-12-07); asking the handle costs a fraction of that."""

    __slots__ = ("_device", "_handle", "_last")

    def __init__(self, device: torch.device, handle: Callable[[], int] | None) -> None:
        self._device = device
        self._handle = handle
        self._last: tuple[int, Any] | None = None  # (handle, stream), replaced as a whole

    def __call__(self) -> Any:
        if self._handle is None:
            return current_stream(self._device)
        handle = self._handle()
        last = self._last
        if last is not None and last[0] == handle:
            return last[1]
        stream = current_stream(self._device)
        self._last = (handle, stream)
        return stream


def _current_stream_lookup(device: torch.device) -> Callable[[], Any]:
    """How :func:`current_stream` finds ``device``'s current stream, decided once per device
    (reading a torch.device's type costs a quarter of a microsecond)."""
    if not has_streams(device):
        return lambda: None
    if _accelerator_type() == device.type:
        return functools.partial(torch.accelerator.current_stream, device.index)
    # an int index skips parsing a torch.device on every call
    return functools.partial(torch.get_device_module(device.type).current_stream,
                             device.index if device.index is not None else device)


_CURRENT: dict[torch.device, Callable[[], Any]] = {}


@functools.cache
def _accelerator_type() -> str | None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not all(
            hasattr(accelerator, f) for f in ("current_stream", "set_stream",
                                               "current_device_index")):
        return None
    current = accelerator.current_accelerator()
    return current.type if current is not None else None


def synchronize_quietly(waitable: Any) -> None:
    """Wait for a stream's queued work or an event (anything with ``synchronize``; None:
    nothing), ignoring a device fault: for callers already reporting a failure, or releasing
    what a transfer used with no one left to report to."""
    if waitable is None:
        return
    with contextlib.suppress(Exception):
        waitable.synchronize()


def native_handle(stream: Any) -> int:
    """The runtime's handle of a torch stream (``cudaStream_t`` / ``hipStream_t`` as an int;
    0: the legacy default stream)."""
    handle = getattr(stream, "native_handle", None)
    if handle is None:  # torch before the generic handle: the CUDA/HIP stream's own
        handle = stream.cuda_stream
    return int(handle)


def new_event(device: torch.device) -> Any:
    """A new event for ``device``'s streams, or None where it has none."""
    if not has_streams(device):
        return None
    if _accelerator_type() == device.type:
        return torch.Event(device=device)
    return torch.get_device_module(device).Event()


def recorded_event(device: torch.device, stream: Any) -> Any:
    """An event recorded on ``stream`` now (None: the current stream), or None where
    ``device`` has no streams: one of the device's :class:`EventPool`, so a new one only
    where every earlier one is still held."""
    pool = _POOLS.get(device)  # (a device with a pool has streams: asked once)
    if pool is None:
        if not has_streams(device):
            return None
        pool = _POOLS.setdefault(device, EventPool(functools.partial(new_event, device)))
    return pool.recorded(stream)


#: events an :class:`EventPool` keeps for reuse; beyond them, new events are not kept
EVENT_POOL_SIZE = 1024


class EventPool:
    """Events of one device, recorded again once nothing but the pool refers to them.

    Every submit records an event for its completion (a per-layer load, one per layer), and
    creating one cost the caller about 3 us on an H200 host, against 0.7 us to record one
    again (docs/benchmarks/h200-2026-12-04e, ``call_parts.log``). An event no submission,
    queue, ring or caller holds any more is recorded again instead: a wait enqueued on it
    stays bound to the record it was made against, and nobody is left to query the old one.
    Whether anything holds it is read from the interpreter's reference count; where that is
    not exact (a free-threaded build), every call makes a new event. Each call looks at the
    two oldest events only, so a held one costs a look, not a scan.
    """

    def __init__(self, make: Callable[[], Any], size: int = EVENT_POOL_SIZE) -> None:
        self._make = make
        self._size = size
        self._events: collections.deque[Any] = collections.deque()

    def recorded(self, stream: Any) -> Any:
        events = self._events
        if _UNHELD is not None:
            for _ in range(2 if len(events) > 1 else len(events)):
                try:
                    event = events.popleft()
                except IndexError:  # another thread took the last one
                    break
                events.append(event)
                # held by the deque, this frame and the call's argument, and nothing else
                if sys.getrefcount(event) <= _UNHELD:
                    event.record(stream)
                    return event
        event = self._make()
        if _UNHELD is not None and len(events) < self._size:
            events.append(event)
        event.record(stream)
        return event

    def __len__(self) -> int:
        return len(self._events)


def _unheld_count() -> int | None:
    """What ``sys.getrefcount`` says in :meth:`EventPool.recorded` of an event nothing else
    holds (None where reference counts are not exact, and events are never reused)."""
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return None
    events: collections.deque[Any] = collections.deque([object()])
    event = events.popleft()
    events.append(event)
    return sys.getrefcount(event)


def _reuse_is_sound() -> bool:
    """Whether :meth:`EventPool.recorded` itself, on this interpreter, hands out no event that
    is still held and does take one that is not (a different build could count references
    at that call differently from :func:`_unheld_count`'s)."""

    class Probe:
        def record(self, stream: Any) -> None:
            pass

    pool = EventPool(Probe, size=8)
    held = [pool.recorded(None) for _ in range(3)]
    if len({id(e) for e in held}) != 3:
        return False
    freed = id(held.pop())  # (the pool keeps the object, so its id stays its own)
    for _ in range(4):  # the pool looks at its two oldest events per call
        event = pool.recorded(None)
        if any(event is e for e in held):
            return False
        if id(event) == freed:
            return True
        held.append(event)
    return False


_UNHELD = _unheld_count()
if _UNHELD is not None and not _reuse_is_sound():
    _UNHELD = None
_POOLS: dict[torch.device, EventPool] = {}


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` current for the block (a no-op for None)."""
    if stream is None:
        yield
        return
    if (_accelerator_type() == stream.device.type
            and stream.device_index == torch.accelerator.current_device_index()):
        # the generic calls cost about a microsecond each; the device module's context
        # manager looks streams up through its Python classes (several microseconds)
        previous = torch.accelerator.current_stream(stream.device_index)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)
        return
    module = torch.get_device_module(stream.device)
    with module.stream(stream):
        yield


class Fence:
    """Orders a stream after the work enqueued so far on another, through one event that is
    recorded again for every use (a wait binds to the record made before it, so reusing the
    event is safe and saves creating one per call). A no-op where the device has no
    streams."""

    def __init__(self, device: torch.device) -> None:
        self._event = new_event(device)
        # a record and its wait go together: another thread's record between them would
        # make the wait follow the wrong stream
        self._lock = threading.Lock()

    def order(self, stream: Any, after: Any) -> None:
        """Make ``stream`` wait for everything enqueued on ``after`` until now."""
        if self._event is None or stream is None or after is stream:
            return
        with self._lock:
            self._event.record(after)
            stream.wait_event(self._event)
