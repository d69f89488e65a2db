"""Bench test helpers: cases, and in-process backends (wrong, raising, partial)."""

from __future__ import annotations

import torch

from kvcore.backend import TransferJob
from kvcore.bench.sweep import Case
from kvcore.capabilities import (
    API_VERSION,
    Available,
    BackendSpec,
    Capabilities,
    HostMemory,
    Residency,
    op_support,
)
from kvcore.layout import Kind, Layout, Op
from kvcore.registry import REFERENCE, Registry


class Delegating:
    """Runs the reference, then ``after(job)``; counts its runs."""

    def __init__(self, registry: Registry, device: torch.device, after: str) -> None:
        self.inner = registry.instance(REFERENCE, device)
        self.after = after
        self.runs = 0

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        return self.inner.allocate_host(shape, dtype)

    def run(self, job: TransferJob) -> None:
        self.runs += 1
        if self.after == "raise":
            raise RuntimeError("deliberate failure")
        self.inner.run(job)
        if self.after == "corrupt":  # flip one byte of the destination
            dest = (job.host_buffer if job.op is Op.WRITE_BACK
                    else job.device_pool.layers(0)[job.layers[0]])
            dest.view(-1).view(torch.uint8)[0] ^= 0xFF


def register(registry: Registry, name: str, after: str, ops: tuple[Op, ...] = tuple(Op),
             ) -> dict[str, Delegating]:
    """Register backend ``name`` behaving as ``after`` says; returns its instances by device."""
    instances: dict[str, Delegating] = {}

    def factory(device: torch.device) -> Delegating:
        instances[str(device)] = Delegating(registry, device, after)
        return instances[str(device)]

    caps = Capabilities(
        name=name, version="0.0", api_version=API_VERSION, platform="any", priority=-1,
        probe=lambda: Available("test"),
        ops=tuple(op_support(op, (Kind.MHA, Kind.MLA), tuple(Layout), Residency.HOST,
                             Residency.DEVICE) for op in ops),
        host_memory=HostMemory.PLAIN)
    registry.register(BackendSpec(caps, factory))
    return instances


def case(op: Op = Op.WRITE_BACK, kind: Kind = Kind.MHA, layers: int = 3, elem: int = 256,
         page: int = 4, batch: int = 2, total: int = 4,
         dtype: torch.dtype = torch.bfloat16) -> Case:
    """A page_first case with small defaults."""
    return Case(op, kind, Layout.PAGE_FIRST, dtype, page, batch, total, layers, elem)
