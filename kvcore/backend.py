"""The runtime contract of a backend instance: what a plan hands it and what it must do.

A backend receives a :class:`TransferJob` whose indices are placed as its chosen
:class:`~kvcore.capabilities.OpSupport` variant declared; those that came from the CPU are
validated (range, whole pages, no duplicate destination), device-resident values are not: the
backend must never dereference an out-of-range one and reports it through its completion
(``check()`` raises InvalidIndices). It enqueues the transfer on ``job.stream`` (or runs it
synchronously when ``job.stream`` is None, as on CPU), never waits for the device, never moves
indices itself and never chooses another variant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import torch

from kvcore.capabilities import HostMemory, OpSupport
from kvcore.layout import ByteStrides, Geometry, Kind, Layout, Op

if TYPE_CHECKING:
    from kvcore.pools import DevicePool


@attrs.frozen
class TransferJob:
    """One validated, placed transfer. ``layer`` is set for LOAD_LAYER only, except that a
    variant declared with ``layer_signals`` also gets LOAD_LAYER jobs with ``layer`` None: all
    layers in one submission, answered with a :class:`~kvcore.signals.LayerSignals`.

    ``chained`` is a promise from the caller: the work enqueued on ``stream`` just before this
    job is an earlier job of the same load (the same host pool and placed indices, another
    layer or pool-group member), with nothing in between but event records. Such a job writes
    only device-pool layers other than this job's, so a backend may start reading the host
    pool and the indices before it has finished (kvio_cuda does, see docs/native-abi.md).
    Ignoring it is always correct.
    """

    op: Op
    support: OpSupport
    device_pool: DevicePool
    host_buffer: torch.Tensor
    host_geometry: Geometry
    host_strides: ByteStrides
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    layer: int | None = None
    stream: Any = None
    chained: bool = False

    @property
    def kind(self) -> Kind:
        """The pools' kind (MHA or MLA)."""
        return self.host_geometry.kind

    @property
    def layout(self) -> Layout:
        """The host pool's layout."""
        return self.host_geometry.layout

    @property
    def layers(self) -> range:
        """The layers this job moves."""
        if self.layer is None:
            return range(self.host_geometry.num_layers)
        return range(self.layer, self.layer + 1)


class Completion(Protocol):
    """Reports the outcome of an asynchronous transfer once its stream work finished."""

    def check(self) -> None:
        """Raise if the transfer failed; return None if it succeeded."""
        ...


@runtime_checkable
class TransferBackend(Protocol):
    """What a :class:`~kvcore.capabilities.BackendSpec` factory returns."""

    def allocate_host(self, shape: tuple[int, ...], dtype: torch.dtype,
                      ) -> tuple[torch.Tensor, HostMemory]:
        """Allocate a host buffer its kernels may dereference; say what memory it is."""
        ...

    def run(self, job: TransferJob) -> Completion | None:
        """Enqueue (or perform) the transfer described by ``job``.

        Raise at once for failures known at submission. A LOAD_LAYER job with ``layer`` None
        (only a ``layer_signals`` variant gets one) returns a
        :class:`~kvcore.signals.LayerSignals`, which is also its Completion. Otherwise a
        backend whose failures can only be known later returns a :class:`Completion`; the
        controller calls its ``check()`` once the transfer's stream event completed and never
        acknowledges a transfer whose check raised. Raise :class:`kvcore.errors.DeviceFault`
        when the device can no longer be used.
        """
        ...


#: ``runner(host_indices, device_indices, layer, stream, chained)``: what ``backend.run`` does
#: for the job a :func:`runner_for` was prepared from, with these five fields replaced.
#:
#: A write-back or all-layer runner may set ``runner.follows = True``: it then takes a sixth
#: argument, ``after``, a stream whose work enqueued so far the transfer must follow (the
#: controller's caller), and orders the transfer after it itself instead of the bound plan
#: fencing ``stream`` first; without ``after`` the transfer must be on ``stream`` when the
#: runner returns, as for any runner. Such a runner may return an object with ``query()``,
#: ``synchronize()`` and ``check()`` (a transfer another thread issues,
#: :class:`~kvcore.native_job.NativeJob`): the submission then takes it as its completion
#: event instead of recording one on ``stream``.
Runner = Callable[[torch.Tensor, torch.Tensor, "int | None", Any, bool], Any]


def runner_for(backend: TransferBackend, job: TransferJob) -> Runner:
    """A :data:`Runner` for jobs that differ from ``job`` only in their indices, layer, stream
    and chaining: what a bound plan calls on every submit.

    A backend may define ``prepare(job) -> Runner`` to do once what every ``run`` of such jobs
    repeats (pointers, layouts, looking up its functions); the runner must behave exactly as
    ``run`` would. Without it, each call builds the job and calls ``run``.
    """
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        return prepare(job)
    return job_runner(backend.run, job)


def job_runner(run: Callable[[TransferJob], Any], job: TransferJob) -> Runner:
    """The :data:`Runner` that builds each job from ``job`` and calls ``run`` with it."""
    op, support, pool = job.op, job.support, job.device_pool
    buffer, geometry, strides = job.host_buffer, job.host_geometry, job.host_strides

    def runner(host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None,
               stream: Any, chained: bool) -> Any:
        return run(TransferJob(op, support, pool, buffer, geometry, strides, host_indices,
                               device_indices, layer, stream, chained))

    return runner
