"""What the controller hands back: write acknowledgements and per-layer load handles."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from kvcore.errors import InvalidArgument, TransferFailed
from kvcore.signals import LayerSignals
from kvcore.streams import current_stream


@attrs.frozen
class WriteAck:
    """A completed write-back: these device pages are now backed up at ``host_indices``."""

    id: int
    host_indices: torch.Tensor
    device_indices: torch.Tensor


@attrs.define
class PendingWrite:
    """A queued write-back as the controller tracks it until its ack (controller-internal)."""

    ack: WriteAck
    event: Any
    completions: list[Any]
    owns_host: bool


class LoadHandle:
    """A queued load. ``wait_layer(i)`` makes the current stream wait for layer ``i`` only.

    A failed load is never reported as landed: once a layer's transfer is known to have
    failed, every later ``wait_layer``/``wait``/``done`` raises the same TransferFailed.

    ``events`` holds one event per layer, recorded after it (the same event for every layer
    of a load submitted as one job); with ``signals`` (such a job's LayerSignals)
    ``wait_layer`` waits for the layer's own signal instead of the event.
    """

    def __init__(self, events: list[Any], completions: list[list[Any]], device: torch.device,
                 on_failure: Callable[[BaseException], None],
                 signals: LayerSignals | None = None) -> None:
        self._events = events
        self._signals = signals
        self._completions: list[list[Any] | None] = list(completions)
        self._device = device
        self._on_failure = on_failure
        self._failure: TransferFailed | None = None

    @property
    def num_layers(self) -> int:
        return len(self._events)

    def wait_layer(self, layer: int) -> None:
        """Order the current stream after layer ``layer``'s load (returns at once on GPU).

        On a device without streams the layer has already run, so its outcome is checked
        here and a failure raises TransferFailed.
        """
        if not isinstance(layer, int) or not 0 <= layer < len(self._events):
            raise InvalidArgument("layer", f"an int in [0, {len(self._events)})", repr(layer))
        self._raise_failure()
        event = self._events[layer]
        if event is None:
            self._check([layer])
        elif self._signals is not None:
            self._signals.wait_layer(layer, current_stream(self._device))
        else:
            current_stream(self._device).wait_event(event)

    def done(self) -> bool:
        """True when every layer has landed (raises TransferFailed if one failed)."""
        self._raise_failure()
        finished = all(e is None or e.query() for e in self._events)
        if finished:
            self._check(range(len(self._events)))
        return finished

    def wait(self) -> None:
        """Block the host until every layer has landed (raises TransferFailed on failure)."""
        self._raise_failure()
        for e in self._events:
            if e is not None:
                e.synchronize()
        self._check(range(len(self._events)))

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _check(self, layers: Iterable[int]) -> None:
        for layer in layers:
            completions, self._completions[layer] = self._completions[layer], None
            try:
                for c in completions or ():
                    c.check()
            except Exception as exc:
                self._on_failure(exc)
                self._failure = TransferFailed(
                    f"load failed at completion (layer {layer}): {exc}", exc)
                raise self._failure from exc
