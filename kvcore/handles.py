"""What the controller hands back: write acknowledgements and per-layer load handles."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from kvcore.errors import TransferFailed
from kvcore.streams import current_stream, has_streams, synchronize_quietly
from kvcore.validate import check_layer

if TYPE_CHECKING:
    from kvcore.plan import Submission


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
    #: the error that failed it on this rank (a controller with a process group keeps it
    #: queued until every rank knows)
    failed: BaseException | None = None
    #: its host pages (CPU host indices only), read once a free_host asked which pages
    #: queued writes hold (:meth:`kvcore.write_queue.WriteQueue.holding`)
    host_pages: np.ndarray | None = None

    # ``event`` is the last pool-group member's; an earlier member's transfer may complete
    # elsewhere (a library's copy stream or thread), so "done" asks every completion

    def finished(self) -> bool:
        """Whether every member's transfer has completed (never blocks)."""
        if self.completions:
            return all(c.query() for c in self.completions)
        return self.event is None or bool(self.event.query())

    def wait_quietly(self) -> None:
        """Block until every member's transfer has completed, whatever its outcome (what
        must hold before the host slots it writes are released)."""
        for part in (self.event, *self.completions):
            synchronize_quietly(part)  # (a fault is reported by its own drain)


class LoadHandle:
    """A queued load. ``wait_layer(i)`` makes the current stream wait for layer ``i`` only.

    A failed load is never reported as landed: once the load is known to have failed (an
    index the kernels refused, a fault), ``check``/``wait_layer``/``wait``/``done`` raise the
    same TransferFailed. ``submissions`` holds one :class:`~kvcore.plan.Submission` per
    pool-group member.
    """

    def __init__(self, submissions: list[Submission], num_layers: int, device: torch.device,
                 on_failure: Callable[[BaseException], None]) -> None:
        self._submissions = submissions
        self._num_layers = num_layers
        self._device = device
        self._on_failure = on_failure
        self._failure: TransferFailed | None = None
        self._checked = False
        waiters = [sub.current_waiter() for sub in submissions] \
            if has_streams(device) else []
        ready = [w for w in waiters if w is not None]
        self._waiters: list[Callable[[int], None]] | None = (
            ready if ready and len(ready) == len(waiters) else None)
        # the usual case, one member's waiter: called without a loop (wait_layer runs once
        # per layer per load)
        self._wait = ready[0] if self._waiters is not None and len(ready) == 1 else None

    @property
    def num_layers(self) -> int:
        """Layers of the load (``wait_layer`` takes 0 to this minus one)."""
        return self._num_layers

    def wait_layer(self, layer: int) -> None:
        """Order the current stream after layer ``layer``'s load (returns at once on GPU).

        On a device without streams the layer has already run, so its outcome is checked
        here and a failure raises TransferFailed.
        """
        if type(layer) is not int or not 0 <= layer < self._num_layers:
            layer = check_layer(layer, self._num_layers)
        if self._failure is not None:
            raise self._failure
        if self._wait is not None:
            self._wait(layer)
            return
        if self._waiters is not None:
            for wait in self._waiters:
                wait(layer)
            return
        stream = current_stream(self._device)
        if stream is None:
            self._check(layer)
            return
        for sub in self._submissions:
            sub.wait_layer(layer, stream)

    def check(self) -> None:
        """Raise TransferFailed if the load is known to have failed; never blocks (a load
        still in flight passes)."""
        self._raise_failure()
        if all(sub.query() for sub in self._submissions):
            self._check()

    def done(self) -> bool:
        """True when every layer has landed (raises TransferFailed if the load failed)."""
        self._raise_failure()
        finished = all(sub.query() for sub in self._submissions)
        if finished:
            self._check()
        return finished

    def wait(self) -> None:
        """Block the host until every layer has landed (raises TransferFailed on failure)."""
        self._raise_failure()
        for sub in self._submissions:
            sub.synchronize()
        self._check()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _check(self, layer: int | None = None) -> None:
        if self._checked:
            return
        try:
            for sub in self._submissions:
                sub.check(layer)
        except Exception as exc:
            self._on_failure(exc)
            where = "" if layer is None else f" (layer {layer})"
            self._failure = TransferFailed(f"load failed at completion{where}: {exc}", exc)
            raise self._failure from exc
        self._checked = layer is None
