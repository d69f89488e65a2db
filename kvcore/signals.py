"""Per-layer readiness of a per-layer load that a backend submitted as one job.

A LOAD_LAYER variant declared with ``layer_signals`` (see
:class:`~kvcore.capabilities.OpSupport`) receives one job for all layers (``layer`` None)
instead of one job per layer, and returns a :class:`LayerSignals`. The controller's
:meth:`~kvcore.handles.LoadHandle.wait_layer` then orders the caller's stream after one layer
through it, so a consumer of layer ``i`` still waits for layer ``i`` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class LayerSignals(Protocol):
    """What a ``layer_signals`` variant returns for a job that moves every layer."""

    def wait_layer(self, layer: int, stream: Any) -> None:
        """Make ``stream`` wait until layer ``layer`` has landed in the device pool.

        Enqueues the wait and returns at once; work enqueued on ``stream`` afterwards sees the
        layer's data complete. It may wait for more than that layer (the layers that land
        with it), never less, and may enqueue nothing where an earlier wait on ``stream``
        already covers the layer. ``layer`` is in range (the caller checks).
        """
        ...

    def check(self) -> None:
        """Raise if the transfer failed (as :class:`~kvcore.backend.Completion`)."""
        ...


#: LayerSignals may also offer ``wait_layer_current(layer)``: :meth:`LayerSignals.wait_layer`
#: on the device's current stream, looked up however the backend does it fastest; the
#: controller's ``wait_layer`` then calls it instead of looking the stream up itself
WAIT_CURRENT = "wait_layer_current"

#: LayerSignals may also offer ``ends_with(event)``: the plan hands it the event it recorded on
#: the load's stream right after the job, and a wait may then wait for that event instead of
#: a layer's own signal where that event comes no later (the last layers): a stream-side
#: event wait resolves inside the device, where a wait for a flag polls memory
ENDS_WITH = "ends_with"


class EventLayerSignals:
    """LayerSignals from one stream event per layer, recorded after each layer's work: what a
    backend returns when it issued the layers one by one after all. A None event (a device
    without streams, where the layer has already run) needs no wait. ``completions`` are
    the layers' own completions, which ``check`` checks."""

    def __init__(self, events: Sequence[Any], completions: Sequence[Any] = ()) -> None:
        self._events = list(events)
        self._completions = list(completions)

    def wait_layer(self, layer: int, stream: Any) -> None:
        event = self._events[layer]
        if event is not None:
            stream.wait_event(event)

    def check(self) -> None:
        for c in self._completions:
            c.check()
