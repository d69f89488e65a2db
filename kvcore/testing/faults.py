"""A fault-injecting backend for reliability tests: it really transfers and fails on command.

Not a mock of the kernels' results: every transfer goes through a real backend (the
reference by default, found through the registry), and an armed :class:`Fault` makes the
Nth call of an operation fail the way a native backend can fail:

- ``RAISE``: ``run()`` raises before moving anything (a failure known at submission);
- ``ASYNC``: the data moves, and the returned completion's ``check()`` raises (a failure
  the device reports only when the stream work finished);
- ``CORRUPT``: the data moves and one element of the destination is flipped, silently
  (what end-to-end checksums, as in ``kvio replay``, must catch).

``error`` picks the exception: :class:`~kvcore.errors.KernelError` for a recoverable
failure, :class:`~kvcore.errors.DeviceFault` for a sticky one. ``FaultInjector.fail_build``
makes the backend factory raise, as a kernel library that does not compile would.

Example::

    with fault_backend() as faults:
        faults.arm(Fault(Op.WRITE_BACK, nth=2, mode=FaultMode.ASYNC))
        ctl = HiCacheController(dev, host, backend=faults.name)
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from kvcore.backend import TransferBackend, TransferJob
from kvcore.capabilities import BackendSpec, HostMemory
from kvcore.errors import KernelError
from kvcore.layout import Op, canonical_view
from kvcore.registry import REFERENCE, Registry, default_registry

__all__ = ["Fault", "FaultInjector", "FaultMode", "FaultyBackend", "fault_backend",
           "fault_spec"]


class FaultMode(str, enum.Enum):
    """How an armed fault shows itself."""

    RAISE = "raise"
    ASYNC = "async"
    CORRUPT = "corrupt"


@attrs.define
class Fault:
    """Fail call number ``nth`` (1-based, counted per operation) of ``op``.

    ``repeat``: fail every call from the ``nth`` on, not only that one.
    """

    op: Op
    nth: int = 1
    mode: FaultMode = FaultMode.RAISE
    error: Callable[[str], BaseException] = KernelError
    repeat: bool = False

    def matches(self, op: Op, call: int) -> bool:
        return op is self.op and (call == self.nth or (self.repeat and call > self.nth))


@attrs.define
class FaultInjector:
    """Shared state of the faulty backend: the armed faults and what happened."""

    name: str = "faulty"
    faults: list[Fault] = attrs.Factory(list)
    fail_build: BaseException | None = None
    calls: collections.Counter[Op] = attrs.Factory(collections.Counter)
    injected: list[tuple[Op, int, FaultMode]] = attrs.Factory(list)
    builds: int = 0

    def arm(self, *faults: Fault) -> FaultInjector:
        """Add faults (counting continues from the calls already made)."""
        self.faults.extend(faults)
        return self

    def disarm(self) -> None:
        self.faults.clear()

    def next_fault(self, op: Op) -> tuple[int, Fault | None]:
        """Count one call of ``op``; return its number and the fault armed for it, if any."""
        self.calls[op] += 1
        call = self.calls[op]
        return call, next((f for f in self.faults if f.matches(op, call)), None)


@attrs.frozen
class _Outcome:
    """A completion: ``check()`` raises ``error`` if there is one, else what the wrapped
    backend returned raises; ``wait_layer`` passes a wrapped backend's per-layer signals
    through (a signaled per-layer load)."""

    error: BaseException | None = None
    inner: Any = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.inner is not None:
            self.inner.check()

    def wait_layer(self, layer: int, stream: Any) -> None:
        if self.inner is not None and hasattr(self.inner, "wait_layer"):
            self.inner.wait_layer(layer, stream)


class FaultyBackend:
    """Runs jobs through ``inner`` and fails them as the injector says."""

    def __init__(self, inner: TransferBackend, injector: FaultInjector) -> None:
        self.inner = inner
        self.injector = injector

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        return self.inner.allocate_host(shape, dtype)

    def run(self, job: TransferJob) -> _Outcome:
        call, fault = self.injector.next_fault(job.op)
        if fault is None:
            return _Outcome(inner=self.inner.run(job))
        self.injector.injected.append((job.op, call, fault.mode))
        error = fault.error(f"injected {fault.mode.value} fault on {job.op.value} call {call}")
        if fault.mode is FaultMode.RAISE:
            raise error
        done = self.inner.run(job)
        if fault.mode is FaultMode.ASYNC:
            return _Outcome(error, done)
        _corrupt_destination(job)
        return _Outcome(inner=done)


def _corrupt_destination(job: TransferJob) -> None:
    """Flip the bytes of the first element of the first page the job wrote."""
    if job.device_indices.numel() == 0:
        return
    layer = job.layers[0]
    if job.op is Op.WRITE_BACK:
        g = job.host_geometry
        h = int(job.host_indices[0])
        target = canonical_view(job.host_buffer, g)[0, layer, h // g.page_size,
                                                    h % g.page_size, 0, 0, 0:1]
    else:
        target = job.device_pool.layers(0)[layer][int(job.device_indices[0]), 0, 0:1]
    target.view(torch.uint8).bitwise_xor_(0xFF)


def fault_spec(injector: FaultInjector, registry: Registry, base: str = REFERENCE,
               priority: int = -1) -> BackendSpec:
    """A backend named ``injector.name`` with ``base``'s capabilities, failing on command.

    Its priority is below every real backend's, so only callers that name it get it.
    """
    base_spec = registry.get(base).spec
    caps = attrs.evolve(base_spec.capabilities, name=injector.name, priority=priority,
                        description=f"fault injection over {base}")

    def factory(device: torch.device) -> TransferBackend:
        injector.builds += 1
        if injector.fail_build is not None:
            raise injector.fail_build
        return FaultyBackend(base_spec.factory(device), injector)

    return BackendSpec(capabilities=caps, factory=factory)


@contextlib.contextmanager
def fault_backend(injector: FaultInjector | None = None, registry: Registry | None = None,
                  base: str = REFERENCE) -> Iterator[FaultInjector]:
    """Register a faulty backend for the duration of the block (the registry is restored)."""
    reg = registry or default_registry()
    inj = injector or FaultInjector()
    with reg.isolated():
        reg.register(fault_spec(inj, reg, base))
        yield inj
