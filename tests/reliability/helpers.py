"""Helpers of the reliability tests: small pools, snapshots, an independent oracle."""

from __future__ import annotations

import attrs
import torch

from kvcore.controller import HiCacheController
from kvcore.layout import Geometry, Kind, Layout, host_shape, locate
from kvcore.pools import AllocatorState, DevicePool, HostPool
from kvcore.verify import random_fill

PAGE = 4


def page_tokens(pages: list[int], page_size: int = PAGE) -> torch.Tensor:
    """Token indices of whole ``pages``, in order."""
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).flatten()


def small_pools(kind: Kind = Kind.MHA, layout: Layout = Layout.PAGE_FIRST, *,
                num_layers: int = 2, head_num: int = 2, head_dim: int = 4,
                page_size: int = PAGE, device_pages: int = 6, host_pages: int = 6,
                dtype: torch.dtype = torch.float32, seed: int = 1,
                ) -> tuple[DevicePool, HostPool]:
    """A random-filled CPU device pool and host pool (the host buffer is wrapped, so no
    backend is built to allocate it)."""
    head_num = 1 if kind is Kind.MLA else head_num
    gen = torch.Generator().manual_seed(seed)
    dev = DevicePool.allocate(kind, num_layers, device_pages * page_size, head_num, head_dim,
                              dtype, "cpu", page_size)
    g = Geometry(kind, layout, num_layers, host_pages * page_size, head_num, head_dim,
                 page_size)
    host = HostPool.wrap(torch.empty(host_shape(g), dtype=dtype), kind, layout, num_layers,
                         head_num, head_dim, page_size)
    for t in [*dev.all_buffers(), host.buffer]:
        random_fill(t, gen)
    return dev, host


@attrs.frozen
class Snapshot:
    """Bytes of both pools and the allocator's state, for "nothing changed" assertions."""

    device: tuple[torch.Tensor, ...]
    host: torch.Tensor
    allocator: AllocatorState

    @classmethod
    def of(cls, ctl: HiCacheController) -> Snapshot:
        m = ctl.members[0]
        return cls(tuple(_bytes(t).clone() for t in m.device.all_buffers()),
                   _bytes(m.host.buffer).clone(), ctl.allocator.state())

    def assert_unchanged(self, ctl: HiCacheController, *, host: bool = True,
                         device: bool = True) -> None:
        now = Snapshot.of(ctl)
        assert now.allocator == self.allocator
        if host:
            assert torch.equal(now.host, self.host), "host pool bytes changed"
        if device:
            for a, b in zip(now.device, self.device, strict=True):
                assert torch.equal(a, b), "device pool bytes changed"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def oracle_write(dev: DevicePool, host: HostPool, h: torch.Tensor, d: torch.Tensor,
                 base: torch.Tensor | None = None) -> torch.Tensor:
    """The host buffer (``base``, else the pool's) after writing device tokens ``d`` to host
    tokens ``h``, one element at a time with :func:`kvcore.layout.locate` (independent of
    any backend)."""
    g = host.geometry
    out = (host.buffer if base is None else base).clone()
    for kv in range(g.kv_count):
        for layer in range(g.num_layers):
            src = dev.layers(kv)[layer]
            for hi, di in zip(h.tolist(), d.tolist(), strict=True):
                for head in range(g.head_num):
                    out[locate(g, kv, layer, hi, head)] = src[di, head]
    return out


def oracle_load(dev: DevicePool, host: HostPool, h: torch.Tensor, d: torch.Tensor,
                layers: range | None = None) -> list[torch.Tensor]:
    """The device buffers (K layers then V layers) after loading ``h`` into ``d``."""
    g = host.geometry
    layers = layers if layers is not None else range(g.num_layers)
    outs = []
    for kv in range(g.kv_count):
        for layer in range(g.num_layers):
            t = dev.layers(kv)[layer].clone()
            if layer in layers:
                for hi, di in zip(h.tolist(), d.tolist(), strict=True):
                    for head in range(g.head_num):
                        t[di, head] = host.buffer[locate(g, kv, layer, hi, head)]
            outs.append(t)
    return outs


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))
