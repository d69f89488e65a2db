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
"""

from __future__ import annotations

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


class NullStream:
    """A stream that orders nothing; ``native_handle`` is what a library receives for it."""

    _ids = itertools.count(1)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.device_index = device.index or 0
        self.stream_id = next(self._ids)
        self.native_handle = 0x1000 + self.stream_id

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class NullEvent:
    """An event that has always completed."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


#: the modules that took kvcore.streams' helpers by name
_USERS = (kvcore.streams, kvcore.plan, kvcore.controller, kvcore.placement, kvcore.handles,
          kvcore.native)


@contextlib.contextmanager
def stand_in_streams(device_type: str) -> Iterator[NullStream]:
    """Within the block, devices of ``device_type`` have (stand-in) streams; yields the
    stream that counts as current. Everything is put back on exit."""
    current = NullStream(torch.device(device_type))
    events = EventPool(NullEvent)  # (as recorded_event keeps a device's events)

    known: dict[torch.device, bool] = {}

    def has_streams(device: torch.device) -> bool:  # (remembered per device, as kvcore's)
        answer = known.get(device)
        if answer is None:
            answer = known[device] = device.type == device_type
        return answer

    @contextlib.contextmanager
    def on_stream(stream: Any) -> Iterator[None]:
        yield

    # kvcore asks for streams and events of a pool's device only, so these need not look at
    # the device (and stay cheap: the null-library probe times what is around them)
    stand_ins: dict[str, Any] = {
        "has_streams": has_streams,
        "new_stream": NullStream,
        "current_stream": lambda device: current,
        "new_event": lambda device: NullEvent(),
        "recorded_event": lambda device, stream: events.recorded(stream),
        "on_stream": on_stream,
    }
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
        swap(torch.Tensor, "record_stream", lambda self, stream: None)
        yield current
    finally:
        for owner, name, value in reversed(saved):
            if value is inherited:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


__all__ = ["NullEvent", "NullStream", "stand_in_streams"]
