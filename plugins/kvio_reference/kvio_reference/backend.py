"""The reference transfers: gathers and scatters through :func:`kvcore.layout.canonical_view`.

Simple over fast, but with no Python loop over tokens: one gather per layer and one scatter
per K/V into the host view.
"""

from __future__ import annotations

import torch

from kvcore.backend import TransferJob
from kvcore.capabilities import HostMemory
from kvcore.errors import InvalidArgument, InvalidIndices
from kvcore.layout import Op, canonical_view, join_heads, split_heads
from kvcore.streams import on_stream


class ReferenceBackend:
    """Moves pages with plain torch indexing on any device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        if self.device.type == "cpu":
            return torch.empty(shape, dtype=dtype), HostMemory.PLAIN
        return torch.empty(shape, dtype=dtype, pin_memory=True), HostMemory.PINNED

    def run(self, job: TransferJob) -> None:
        for name, t in (("device_pool", job.device_pool.k_buffers[0]),
                        ("host_pool", job.host_buffer), ("host_indices", job.host_indices),
                        ("device_indices", job.device_indices)):
            if t.is_meta:  # (shapes only: nothing to read, copy or range-check)
                raise InvalidArgument(name, "tensors with memory (cpu, cuda, ...)",
                                      "tensors on the meta device", "reference")
        with on_stream(job.stream):
            _transfer(job)


def _transfer(job: TransferJob) -> None:
    g = job.host_geometry
    view = canonical_view(job.host_buffer, g)  # (kv, layer, page, token, group, head, dim)
    _check_range("host_indices", job.host_indices, g.size, job.op)
    _check_range("device_indices", job.device_indices, job.device_pool.size, job.op)
    h = job.host_indices.to(torch.int64)
    page, off = h // g.page_size, h % g.page_size
    d = job.device_indices
    layers = list(job.layers)
    pool = job.device_pool
    for kv in range(g.kv_count):
        tensors = pool.layers(kv)
        if job.op is Op.WRITE_BACK:
            gathered = torch.stack([tensors[i][d] for i in layers])  # (L, n, H, D) on device
            view[kv, layers[0]:layers[-1] + 1, page, off] = split_heads(gathered.to("cpu"), g)
        else:
            host = join_heads(view[kv, layers[0]:layers[-1] + 1, page, off]).to(pool.device)
            for j, i in enumerate(layers):
                tensors[i][d] = host[j]


def _check_range(name: str, indices: torch.Tensor, size: int, op: Op) -> None:
    """Refuse an out-of-range index before torch dereferences it: on a GPU that would be a
    device-side assert, which leaves the process without its device. Device-resident values
    are read back here (the reference waits for the device anyway: it copies through the
    CPU); the plan already checked CPU ones, which cost nothing to check again."""
    if indices.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(indices))
    if lo < 0 or hi >= size:
        raise InvalidIndices(name, f"values in [0, {size})",
                             f"{lo if lo < 0 else hi} (refused by the reference backend, "
                             "which moved nothing)", op.value)
