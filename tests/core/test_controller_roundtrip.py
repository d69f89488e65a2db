"""Write-back then load through HiCacheController with the reference backend, bit exact.

Host and device destinations are poisoned with a sentinel first; slots that were not written
(host) or not loaded (device) must still hold it. The host buffer is also checked against an
independent computation through :func:`kvcore.layout.locate`, not only by round-trip symmetry.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.controller import HiCacheController
from kvcore.layout import Geometry, Kind, Layout, head_group_options, layouts_for, locate
from kvcore.pools import DevicePool
from kvcore.registry import Registry
from kvcore.verify import random_fill

from .helpers import (
    KIND_LAYOUTS,
    bytes_equal,
    make_pools,
    page_tokens,
    poison,
    poisoned_like,
    reference_only,
)

NUM_LAYERS = 3


def _host_rows(g: Geometry, buffer: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Host elements of ``tokens`` as (kv, layer, token, head, dim), gathered via locate."""
    places = [locate(g, kv, layer, t, head) for kv in range(g.kv_count)
              for layer in range(g.num_layers) for t in tokens for head in range(g.head_num)]
    columns = tuple(torch.tensor(c, dtype=torch.int64) for c in zip(*places, strict=True))
    return buffer[columns].view(g.kv_count, g.num_layers, len(tokens), g.head_num, g.head_dim)


def _device_rows(layers: list[list[torch.Tensor]], rows: torch.Tensor) -> torch.Tensor:
    """Device rows as (kv, layer, token, head, dim)."""
    r = rows.to(torch.int64)
    return torch.stack([torch.stack([t[r] for t in kv]) for kv in layers])


def _layers(dev: DevicePool) -> list[list[torch.Tensor]]:
    return [dev.layers(kv) for kv in range(2 if dev.kind is Kind.MHA else 1)]


def _poisoned_layers(dev: DevicePool) -> list[list[torch.Tensor]]:
    """A sentinel-only twin of the device pool: what untouched rows must still equal."""
    return [[poisoned_like(t) for t in kv] for kv in _layers(dev)]


def _others(size: int, used: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(size, dtype=torch.bool)
    mask[used.to(torch.int64)] = False
    return torch.nonzero(mask).flatten()


def roundtrip(registry: Registry, gen: torch.Generator, kind: Kind, layout: Layout, *,
              dtype: torch.dtype, pages: int, page_size: int, index_dtype: torch.dtype,
              reverse_host: bool, head_num: int, head_dim: int) -> None:
    tokens = pages * page_size
    host_pages = pages + 2
    device_size = tokens + 2 * page_size
    dev, host = make_pools(kind, layout, num_layers=NUM_LAYERS, host_pages=host_pages,
                           device_size=device_size, head_num=head_num, head_dim=head_dim,
                           page_size=page_size, dtype=dtype, registry=registry)
    for t in dev.all_buffers():
        random_fill(t, gen)
    poison(host.buffer)
    ctl = HiCacheController(dev, host, backend="reference", registry=registry)
    assert ctl.plan("write_back").backend_name == "reference"

    # -- write-back: random device rows into host pages (allocated, or given in reverse) ----
    d = torch.randperm(device_size, generator=gen)[:tokens].to(index_dtype)
    if reverse_host:
        ctl.allocator.alloc(host_pages * page_size)  # the caller's slots, of the allocator
        h = page_tokens(range(pages, 0, -1), page_size, index_dtype)  # pages 0, last unused
        ack = ctl.write(d, host_indices=h)
    else:
        ack = ctl.write(d)
        h = ack.host_indices
        assert torch.equal(h, page_tokens(range(pages), page_size))
        assert ctl.allocator.is_allocated(h)
        assert ctl.allocator.available_size() == (host_pages - pages) * page_size
    assert ctl.wait_acks() == [ack]
    assert ctl.pending_writes == 0

    g = host.geometry
    source = _device_rows(_layers(dev), d)
    assert bytes_equal(_host_rows(g, host.buffer, h.tolist()), source)
    untouched = _others(g.size, h).tolist()
    assert len(untouched) == 2 * page_size
    assert bytes_equal(_host_rows(g, host.buffer, untouched),
                       _host_rows(g, poisoned_like(host.buffer), untouched))

    # -- load (per layer, then all layers) into other poisoned device rows ------------------
    saved = [t.clone() for t in dev.all_buffers()]
    blank = _poisoned_layers(dev)
    for all_layers in (False, True):
        for t in dev.all_buffers():
            poison(t)
        d2 = torch.randperm(device_size, generator=gen)[:tokens].to(index_dtype)
        handle = ctl.load(h, d2, all_layers=all_layers)
        assert handle.num_layers == NUM_LAYERS
        for layer in range(NUM_LAYERS):
            handle.wait_layer(layer)
        handle.wait()
        assert handle.done()
        assert bytes_equal(_device_rows(_layers(dev), d2), source)
        rest = _others(device_size, d2)
        assert bytes_equal(_device_rows(_layers(dev), rest), _device_rows(blank, rest))
    for t in dev.all_buffers():  # the host copy survives the loads, and so do the sources
        t.copy_(saved.pop(0))
    assert bytes_equal(_host_rows(g, host.buffer, h.tolist()), source)

    if not reverse_host:
        ctl.free_host(h)
        assert ctl.allocator.available_size() == host.geometry.size


def _heads(kind: Kind) -> dict[str, int]:
    return dict(head_num=2, head_dim=8) if kind is Kind.MHA else dict(head_num=1, head_dim=16)


@pytest.mark.parametrize("reverse_host", [False, True], ids=["allocated", "reversed"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("pages", [1, 63, 64, 65, 129])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_roundtrip(ref_registry: Registry, gen: torch.Generator, kind: Kind, layout: Layout,
                   dtype: torch.dtype, pages: int, index_dtype: torch.dtype,
                   reverse_host: bool) -> None:
    roundtrip(ref_registry, gen, kind, layout, dtype=dtype, pages=pages, page_size=4,
              index_dtype=index_dtype, reverse_host=reverse_host, **_heads(kind))


@pytest.mark.parametrize("reverse_host", [False, True], ids=["allocated", "reversed"])
@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_roundtrip_page_size_64(ref_registry: Registry, gen: torch.Generator, kind: Kind,
                                layout: Layout, reverse_host: bool) -> None:
    roundtrip(ref_registry, gen, kind, layout, dtype=torch.bfloat16, pages=3, page_size=64,
              index_dtype=torch.int64, reverse_host=reverse_host, **_heads(kind))


ODD_ELEMENTS = [(Kind.MHA, 1, 72), (Kind.MHA, 3, 24), (Kind.MHA, 3, 5), (Kind.MLA, 1, 72),
                (Kind.MLA, 1, 9)]
#: the layouts that take the element (page_unified needs 16-byte head group rows)
ODD_CASES = [(k, lay, h, d) for k, h, d in ODD_ELEMENTS for lay in layouts_for(k)
             if head_group_options(k, lay, h, d, torch.float16.itemsize)]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize(("kind", "layout", "head_num", "head_dim"), ODD_CASES,
                         ids=[f"{k.value}-{lay.value}-{h}x{d}" for k, lay, h, d in ODD_CASES])
def test_roundtrip_odd_element_sizes(ref_registry: Registry, gen: torch.Generator, kind: Kind,
                                     layout: Layout, head_num: int, head_dim: int,
                                     index_dtype: torch.dtype) -> None:
    roundtrip(ref_registry, gen, kind, layout, dtype=torch.float16, pages=5, page_size=8,
              index_dtype=index_dtype, reverse_host=True, head_num=head_num,
              head_dim=head_dim)


def test_an_acks_host_indices_are_checked_again_once_modified() -> None:
    """load() trusts the host indices of its own acks only while they are unmodified."""
    from kvcore.errors import InvalidIndices

    dev, host = make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=2, host_pages=4,
                           device_size=32, head_num=2, head_dim=8, page_size=4,
                           dtype=torch.bfloat16, registry=reference_only())
    ctl = HiCacheController(dev, host, registry=reference_only())
    ack = ctl.write(torch.arange(8))
    ctl.wait_acks()
    ctl.load(ack.host_indices, torch.arange(8, 16)).wait()  # its own, unmodified: fine
    ack.host_indices[0] = 10**6  # in place: the version moves on
    with pytest.raises(InvalidIndices, match="host_indices"):
        ctl.load(ack.host_indices, torch.arange(8, 16))


@pytest.mark.parametrize("write", ["torch", "numpy"])
def test_free_host_checks_an_acks_host_indices_again_once_modified(write: str) -> None:
    """free_host() skips the value checks of its own acks' host indices only while they are
    unmodified (through torch or a NumPy view); a bad value then frees nothing."""
    from kvcore.errors import AllocatorError, InvalidIndices

    dev, host = make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=2, host_pages=4,
                           device_size=32, head_num=2, head_dim=8, page_size=4,
                           dtype=torch.bfloat16, registry=reference_only())
    ctl = HiCacheController(dev, host, registry=reference_only())
    first, second = ctl.write(torch.arange(8)), ctl.write(torch.arange(8, 16))
    ctl.wait_acks()
    before = ctl.allocator.state()
    values = first.host_indices.numpy() if write == "numpy" else first.host_indices
    values[5] = 10**6  # no longer whole pages, and out of range
    with pytest.raises(InvalidIndices, match="indices"):
        ctl.free_host(first.host_indices)
    assert ctl.allocator.state() == before
    values[:] = second.host_indices  # valid pages, but another ack's: freed once only
    ctl.free_host(first.host_indices)
    with pytest.raises(AllocatorError, match="double free"):
        ctl.free_host(second.host_indices)
    ctl.free_host(torch.arange(0, 8))  # the pages `first` was given are still allocated
    assert ctl.allocator.available_size() == 16
