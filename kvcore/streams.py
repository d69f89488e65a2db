"""Device-generic streams and events; on a device without streams (CPU) they are None.

Deciding by the pool's device type is not a platform check: it asks what the tensors in hand
support, through torch's device module for that type (``torch.get_device_module``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
    return device.type not in ("cpu", "meta")


def new_stream(device: torch.device) -> Any:
    """A new stream on ``device``, or None where the device has no streams."""
    if not has_streams(device):
        return None
    return torch.get_device_module(device).Stream(device=device)


def current_stream(device: torch.device) -> Any:
    """The stream new work on ``device`` is ordered on, or None."""
    if not has_streams(device):
        return None
    # an int index skips parsing a torch.device on every call (this is on every submit)
    return torch.get_device_module(device.type).current_stream(
        device.index if device.index is not None else device)


def new_event(device: torch.device) -> Any:
    return torch.get_device_module(device).Event() if has_streams(device) else None


def recorded_event(device: torch.device, stream: Any) -> Any:
    """A new event recorded on ``stream`` (None: the current stream), or None where
    ``device`` has no streams."""
    event = new_event(device)
    if event is not None:
        event.record(stream)
    return event


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` current for the block (a no-op for None)."""
    if stream is None:
        yield
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

    def order(self, stream: Any, after: Any) -> None:
        """Make ``stream`` wait for everything enqueued on ``after`` until now."""
        if self._event is None or stream is None:
            return
        self._event.record(after)
        stream.wait_event(self._event)
