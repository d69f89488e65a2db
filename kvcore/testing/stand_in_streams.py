"""The path a GPU takes, run on a machine without one: streams and events that do nothing.

kvcore decides from a tensor's device whether work on it is ordered by streams
(:func:`kvcore.streams.has_streams`). Inside :func:`stand_in_streams` a device of the given
type counts as one with streams, so the controller and the bound plans take the GPU's path:
transfer streams ordered after the caller's by fences, completion events, the index ring
copying CPU indices into "device" memory through the backend's upload, signal and report
memory. The streams are stand-ins that order nothing (whatever the library enqueues has run
when its call returns), every event has completed, and memory kvcore would pin is plain.

Two uses: with a native library emulated on the CPU (kvio_rocm's ``-DKVIO_EMULATE`` build)
and ``device_type="cpu"``, real bytes move along that path and can be compared with an oracle
(tests/rocm/test_rocm_controller_emulated.py); with a library that does nothing and
``device_type="meta"`` (scripts/null_kvio.c), the time left is kvcore's own
(scripts/probe_null_device.py). Ordering bugs between streams cannot show here; everything
else on the path runs.

Given a ``calls`` counter, the stand-ins count what kvcore asks of the runtime through them
(``event.record``, ``stream.wait_event``, ...): on a GPU each is a runtime call the caller
pays for, so a count is what a submit costs beyond kvcore's own Python.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

import kvcore.controller
import kvcore.handles
import kvcore.native
import kvcore.placement
import kvcore.plan
import kvcore.streams
from kvcore.streams import EventPool

#: what the stand-ins count, one name per runtime call a GPU's stream or event would make
CALLS = ("stream.new", "stream.current", "stream.switch", "stream.wait_event",
         "stream.synchronize", "event.new", "event.record", "event.query",
         "event.synchronize", "event.wait", "tensor.record_stream")


class NullStream:
    """A stream that orders nothing; ``native_handle`` is what a library receives for it.
    ``calls``: where its calls are counted (None: nowhere)."""

    _ids = itertools.count(1)

    def __init__(self, device: torch.device,
                 calls: collections.Counter[str] | None = None) -> None:
        self.device = device
        self.device_index = device.index or 0
        self.stream_id = next(self._ids)
        self.native_handle = 0x1000 + self.stream_id
        self.calls = calls

    def wait_event(self, event: Any) -> None:
        if self.calls is not None:
            self.calls["stream.wait_event"] += 1

    def synchronize(self) -> None:
        if self.calls is not None:
            self.calls["stream.synchronize"] += 1


class NullEvent:
    """An event that has always completed. ``calls``: where its calls are counted."""

    def __init__(self, calls: collections.Counter[str] | None = None) -> None:
        self.calls = calls

    def record(self, stream: Any = None) -> None:
        if self.calls is not None:
            self.calls["event.record"] += 1

    def query(self) -> bool:
        if self.calls is not None:
            self.calls["event.query"] += 1
        return True

    def synchronize(self) -> None:
        if self.calls is not None:
            self.calls["event.synchronize"] += 1

    def wait(self, stream: Any = None) -> None:
        if self.calls is not None:
            self.calls["event.wait"] += 1


#: the modules that took kvcore.streams' helpers by name
_USERS = (kvcore.streams, kvcore.plan, kvcore.controller, kvcore.placement, kvcore.handles,
          kvcore.native)


@contextlib.contextmanager
def stand_in_streams(device_type: str,
                     calls: collections.Counter[str] | None = None) -> Iterator[NullStream]:
    """Within the block, devices of ``device_type`` have (stand-in) streams; yields the
    stream that counts as current. Everything is put back on exit. ``calls``: a counter
    each stand-in call adds one to, under its name in :data:`CALLS`."""
    current = NullStream(torch.device(device_type), calls)

    def new_event(device: Any = None) -> NullEvent:
        if calls is not None:
            calls["event.new"] += 1
        return NullEvent(calls)

    def new_stream(device: torch.device) -> NullStream:
        if calls is not None:
            calls["stream.new"] += 1
        return NullStream(device, calls)

    events = EventPool(new_event)  # (as recorded_event keeps a device's events)

    known: dict[torch.device, bool] = {}

    def has_streams(device: torch.device) -> bool:  # (remembered per device, as kvcore's)
        answer = known.get(device)
        if answer is None:
            answer = known[device] = device.type == device_type
        return answer

    @contextlib.contextmanager
    def on_stream(stream: Any) -> Iterator[None]:
        if calls is not None:
            calls["stream.switch"] += 1
        yield

    # kvcore asks for streams and events of a pool's device only, so these need not look at
    # the device (and stay cheap: the null-library probe times what is around them)
    stand_ins: dict[str, Any] = {
        "has_streams": has_streams,
        "new_stream": new_stream,
        "current_stream": lambda device: current,
        "new_event": new_event,
        "recorded_event": lambda device, stream: events.recorded(stream),
        "on_stream": on_stream,
    }
    record_stream: Any = lambda self, stream: None  # noqa: E731
    if calls is not None:
        def current_stream(device: torch.device) -> NullStream:
            calls["stream.current"] += 1
            return current

        def counted_record_stream(self: torch.Tensor, stream: Any) -> None:
            calls["tensor.record_stream"] += 1

        stand_ins["current_stream"] = current_stream
        record_stream = counted_record_stream
    saved: list[tuple[Any, str, Any]] = []
    inherited = object()  # marks an attribute the owner took from a base class

    def swap(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, vars(owner).get(name, inherited)))
        setattr(owner, name, value)

    try:
        for module in _USERS:
            for name, fn in stand_ins.items():
                # (kvcore.streams keeps its own has_streams: resolve_device asks it, and a
                # device module of the stand-in type need not know a current device)
                if hasattr(module, name) and (module, name) != (kvcore.streams, "has_streams"):
                    swap(module, name, fn)
        # signal flags and bounds reports: plain memory the library writes, not pinned
        swap(kvcore.native, "has_streams", lambda device: False)
        swap(kvcore.placement, "pinned_empty",
             lambda shape, dtype: torch.empty(shape, dtype=dtype))
        # (a tensor used on a stand-in stream has nothing to record)
        swap(torch.Tensor, "record_stream", record_stream)
        yield current
    finally:
        for owner, name, value in reversed(saved):
            if value is inherited:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


__all__ = ["CALLS", "NullEvent", "NullStream", "stand_in_streams"]
