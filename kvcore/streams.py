"""Device-generic streams and events; on a device without streams (CPU) they are None.

Deciding by the pool's device type is not a platform check: it asks what the tensors in hand
support, through torch's device module for that type (``torch.get_device_module``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
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
    """The stream new work on ``device`` is ordered on, or None.

    For the accelerator torch runs on this is torch's generic :class:`torch.Stream` (a lookup
    of under a microsecond; the device module's own ``current_stream`` builds a Python
    subclass and costs several: this is on every submit and every ``wait_layer``).
    """
    if not has_streams(device):
        return None
    if _accelerator_type() == device.type:
        return torch.accelerator.current_stream(device.index)
    # an int index skips parsing a torch.device on every call
    return torch.get_device_module(device.type).current_stream(
        device.index if device.index is not None else device)


@functools.cache
def _accelerator_type() -> str | None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not all(
            hasattr(accelerator, f) for f in ("current_stream", "set_stream",
                                               "current_device_index")):
        return None
    current = accelerator.current_accelerator()
    return current.type if current is not None else None


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
