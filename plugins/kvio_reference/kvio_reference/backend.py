"""The reference transfers: gathers and scatters through :func:`kvcore.layout.canonical_view`.

Simple over fast, but with no Python loop over tokens: one gather per layer and one scatter
per K/V into the host view.
"""

from __future__ import annotations

import torch

from kvcore.backend import TransferJob
from kvcore.capabilities import HostMemory
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
        with on_stream(job.stream):
            _transfer(job)


def _transfer(job: TransferJob) -> None:
    g = job.host_geometry
    view = canonical_view(job.host_buffer, g)  # (kv, layer, page, token, group, head, dim)
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
