"""Deliberately wrong in-process backends: each breaks the contract in one way."""

from __future__ import annotations

import attrs
import torch

from kvcore import BackendSpec, IndexSpec, Op, Residency, TransferJob
from kvcore.capabilities import HostMemory
from kvcore.errors import KernelError
from kvcore.layout import canonical_view
from kvcore.registry import Registry
from kvcore.signals import EventLayerSignals


class _Delegate:
    """Runs the reference, then applies ``damage``."""

    def __init__(self, registry: Registry, device: torch.device) -> None:
        self.inner = registry.instance("reference", device)

    def allocate_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        return self.inner.allocate_host(shape, dtype)

    def run(self, job: TransferJob) -> None:
        self.check(job)
        self.inner.run(job)
        self.damage(job)

    def check(self, job: TransferJob) -> None:
        pass

    def damage(self, job: TransferJob) -> None:
        pass


class FlippedByte(_Delegate):
    """Flips one bit of the first element it writes."""

    def damage(self, job: TransferJob) -> None:
        layer = job.layers.start
        if job.op is Op.WRITE_BACK:
            g = job.host_geometry
            h = int(job.host_indices[0])
            item = canonical_view(job.host_buffer, g)[0, layer, h // g.page_size,
                                                      h % g.page_size, 0, 0, 0]
        else:
            item = job.device_pool.layers(0)[layer][int(job.device_indices[0]), 0, 0]
        item.view(1).view(torch.uint8)[0] ^= 1


class NeedsDeviceIndices(_Delegate):
    """Its kernel reads device indices from device memory, but it declares HOST residency.

    On a CPU-only machine host and device memory are the same place, so the simulated kernel
    asserts on the residency the plan placed for (a GPU kernel would fault on the pointer).
    """

    def check(self, job: TransferJob) -> None:
        if job.support.device_index.residency is not Residency.DEVICE:
            raise KernelError("kernel reads device_indices from device memory; got a "
                              "host-resident index tensor")


class NoBoundCheck(_Delegate):
    """Writes one token past the end of each destination page."""

    def damage(self, job: TransferJob) -> None:
        g = job.host_geometry
        p = g.page_size
        if job.op is Op.WRITE_BACK:
            view = canonical_view(job.host_buffer, g)
            for h in job.host_indices[p - 1::p].tolist():
                nxt = h + 1
                if nxt < g.size:
                    view[:, job.layers.start:job.layers.stop, nxt // p, nxt % p] = \
                        view[:, job.layers.start:job.layers.stop, h // p, h % p]
        else:
            for kv in range(g.kv_count):
                for layer in job.layers:
                    t = job.device_pool.layers(kv)[layer]
                    for d in job.device_indices[p - 1::p].tolist():
                        if d + 1 < t.shape[0]:
                            t[d + 1] = t[d]


class Signaled(_Delegate):
    """A correct per-layer load submitted as one job: declares layer_signals and answers a
    job for every layer with LayerSignals (the reference has already run it)."""

    def run(self, job: TransferJob) -> EventLayerSignals | None:
        super().run(job)
        if job.op is Op.LOAD_LAYER and job.layer is None:
            return EventLayerSignals([None] * job.host_geometry.num_layers)
        return None


class ForgetsSignals(_Delegate):
    """Declares layer_signals but answers a job for every layer with nothing."""


def _signaled_ops(ops: tuple) -> tuple:
    return tuple(attrs.evolve(s, layer_signals=True) if s.op is Op.LOAD_LAYER else s
                 for s in ops)


class RaisesBare(_Delegate):
    """Raises a bare ValueError for more than 3 pages (the contract asks for KVCoreError)."""

    def check(self, job: TransferJob) -> None:
        if job.device_indices.numel() > 3 * job.host_geometry.page_size:
            raise ValueError("too many tokens")


def register_bad(registry: Registry) -> None:
    """Register the bad backends (flipped_byte, wrong_residency, no_bound_check,
    forgets_signals, raises_bare, claims_pinned) and correct ones that claim write-back only
    (write_only) or submit a per-layer load as one job (signaled)."""
    ref = registry.get("reference").spec.capabilities
    plans = {
        "flipped_byte": (FlippedByte, ref.ops),
        "wrong_residency": (NeedsDeviceIndices, tuple(
            attrs.evolve(s, device_index=IndexSpec(Residency.HOST)) for s in ref.ops)),
        "no_bound_check": (NoBoundCheck, ref.ops),
        "write_only": (_Delegate, tuple(s for s in ref.ops if s.op is Op.WRITE_BACK)),
        "signaled": (Signaled, _signaled_ops(ref.ops)),
        "forgets_signals": (ForgetsSignals, _signaled_ops(ref.ops)),
        "raises_bare": (RaisesBare, ref.ops),
        "claims_pinned": (_Delegate, ref.ops),  # declares pinned host memory, allocates plain
    }
    for name, (cls, ops) in plans.items():
        caps = attrs.evolve(ref, name=name, ops=ops, priority=-100, description=cls.__doc__)
        if name == "claims_pinned":
            caps = attrs.evolve(caps, host_memory=HostMemory.PINNED)
        registry.register(BackendSpec(
            capabilities=caps,
            factory=lambda device, cls=cls: cls(registry, device)))
