"""Observe what a backend's ``run()`` receives, so the suite can check index placement.

:func:`recorded` swaps a backend's registration (inside ``Registry.isolated()``) for one whose
factory wraps each instance in a :class:`RecordingBackend`. The wrapper records the job before
passing it on unchanged; the suite then asserts that the index tensors had the device and
dtype the chosen variant declared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import torch

from kvcore.backend import Completion, TransferBackend, TransferJob
from kvcore.capabilities import BackendSpec, HostMemory, IndexSpec, residency_device
from kvcore.plan import dtype_name
from kvcore.registry import Registry


@attrs.frozen
class Received:
    """What one ``run()`` call received (enough to check placement after the fact)."""

    op: str
    variant: str
    host_index: IndexSpec
    device_index: IndexSpec
    host_device: torch.device
    host_dtype: torch.dtype
    device_device: torch.device
    device_dtype: torch.dtype
    pool_device: torch.device
    kind: str
    layout: str
    layer: int | None

    def placement_errors(self) -> list[str]:
        """Disagreements between where the indices were and what the variant declared."""
        errors = []
        for name, spec, dev, dt in (
                ("host_indices", self.host_index, self.host_device, self.host_dtype),
                ("device_indices", self.device_index, self.device_device, self.device_dtype)):
            want = residency_device(spec.residency, self.pool_device)
            if dev != want or dt not in spec.dtypes:
                allowed = "/".join(dtype_name(d) for d in spec.dtypes)
                errors.append(
                    f"{name}: variant {self.variant!r} of {self.op} declares residency "
                    f"{spec.residency.value} ({allowed} on {want}), but run() received "
                    f"{dtype_name(dt)} on {dev}")
        return errors

    def summary(self) -> str:
        return (f"run() received host_indices {dtype_name(self.host_dtype)} on "
                f"{self.host_device} and device_indices {dtype_name(self.device_dtype)} on "
                f"{self.device_device} for variant {self.variant!r}, which declares host_index "
                f"residency {self.host_index.residency.value} and device_index residency "
                f"{self.device_index.residency.value}")


class RecordingBackend:
    """Passes every call to ``inner`` and remembers what each ``run()`` received (in
    ``received``, which may be a list the caller keeps)."""

    def __init__(self, inner: TransferBackend, received: list[Received] | None = None) -> None:
        self.inner = inner
        self.received: list[Received] = [] if received is None else received

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        return self.inner.allocate_host(shape, dtype)

    def run(self, job: TransferJob) -> Completion | None:
        self.received.append(Received(
            op=job.op.value, variant=job.support.variant, host_index=job.support.host_index,
            device_index=job.support.device_index, host_device=job.host_indices.device,
            host_dtype=job.host_indices.dtype, device_device=job.device_indices.device,
            device_dtype=job.device_indices.dtype, pool_device=job.device_pool.device,
            kind=job.kind.value, layout=job.layout.value, layer=job.layer))
        return self.inner.run(job)


@contextlib.contextmanager
def recorded(registry: Registry, name: str) -> Iterator[dict[str, RecordingBackend]]:
    """Within an isolated registry, make backend ``name`` record its jobs.

    Yields a dict filled with the recording instance of each device (keyed by ``str(device)``)
    as plans build them. The original registration is restored on exit.
    """
    instances: dict[str, RecordingBackend] = {}
    with registry.isolated():
        rec = registry.get(name)
        original = rec.spec

        def factory(device: torch.device) -> RecordingBackend:
            wrapper = RecordingBackend(original.factory(device))
            instances[str(device)] = wrapper
            return wrapper

        registry.unregister(name)
        registry.register(BackendSpec(capabilities=original.capabilities, factory=factory),
                          source=rec.source, distribution=rec.distribution)
        yield instances
