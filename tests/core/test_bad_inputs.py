"""Bad inputs raise a typed error naming the argument and change no pool byte, no allocation."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvcore.controller import HiCacheController
from kvcore.errors import (
    AllocatorError,
    InvalidArgument,
    InvalidIndices,
    KVCoreError,
    TensorMismatch,
)
from kvcore.layout import Kind, Layout, Op
from kvcore.registry import Registry
from kvcore.verify import random_fill

from .helpers import assert_unchanged, make_pools, page_tokens, snapshot

PAGE = 4
HOST_PAGES = 6
DEVICE_SIZE = 32
LAYERS = 2


@pytest.fixture(params=[Layout.PAGE_FIRST, Layout.LAYER_FIRST])
def ctl(request: pytest.FixtureRequest, ref_registry: Registry,
        gen: torch.Generator) -> HiCacheController:
    """A controller with random pools and a non-trivial allocator state (pages 0,2 taken)."""
    dev, host = make_pools(Kind.MHA, request.param, num_layers=LAYERS, host_pages=HOST_PAGES,
                           device_size=DEVICE_SIZE, head_num=2, head_dim=8, page_size=PAGE,
                           dtype=torch.bfloat16, registry=ref_registry)
    for t in [*dev.all_buffers(), host.buffer]:
        random_fill(t, gen)
    c = HiCacheController(dev, host, registry=ref_registry)
    c.write(torch.arange(3 * PAGE))
    c.wait_acks()
    c.free_host(page_tokens([1], PAGE))
    return c


def tok(*pages: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return page_tokens(pages, PAGE, dtype)


D8 = torch.arange(8, 16)  # valid device rows (two pages' worth)
META = torch.device("meta")

Call = Callable[[HiCacheController], Any]


def _load_layer(c: HiCacheController, layer: object) -> Any:
    """A per-layer load through the plan itself, with any ``layer`` value."""
    m = c.members[0]
    return c.plan(Op.LOAD_LAYER).transfer(m.device, m.host, tok(0), D8[:4], layer=layer)

CASES: list[tuple[str, Call, type[KVCoreError], str]] = [
    # write-back (device -> host): host slots allocated by write() unless given
    ("write float device", lambda c: c.write(D8.float()), TensorMismatch, "device_indices"),
    ("write 2-D device", lambda c: c.write(D8.view(2, 4)), TensorMismatch, "device_indices"),
    ("write list device", lambda c: c.write(list(range(8))), TensorMismatch, "device_indices"),
    ("write bool device", lambda c: c.write(torch.ones(8, dtype=torch.bool)), TensorMismatch,
     "device_indices"),
    ("write meta device", lambda c: c.write(D8.to(META)), TensorMismatch, "device_indices"),
    ("write device out of range", lambda c: c.write(torch.arange(28, 36)), InvalidIndices,
     "device_indices"),
    ("write device negative", lambda c: c.write(torch.arange(-1, 7)), InvalidIndices,
     "device_indices"),
    ("write partial page", lambda c: c.write(torch.arange(6)), InvalidIndices,
     "device_indices"),
    ("write float host", lambda c: c.write(D8, tok(3, 4).double()), TensorMismatch,
     "host_indices"),
    ("write 2-D host", lambda c: c.write(D8, tok(3, 4).view(2, 4)), TensorMismatch,
     "host_indices"),
    ("write meta host", lambda c: c.write(D8, tok(3, 4).to(META)), TensorMismatch,
     "host_indices"),
    ("write host out of range", lambda c: c.write(D8, tok(5, 6)), InvalidIndices,
     "host_indices"),
    ("write host misaligned", lambda c: c.write(D8, torch.arange(14, 22)), InvalidIndices,
     "host_indices"),
    ("write host not consecutive", lambda c: c.write(D8, torch.tensor([12, 13, 15, 14,
                                                                       16, 17, 18, 19])),
     InvalidIndices, "host_indices"),
    ("write duplicate host", lambda c: c.write(D8, tok(4, 4)), InvalidIndices,
     "host_indices"),
    ("write mismatched lengths", lambda c: c.write(D8, tok(3, 4, 5)), InvalidIndices,
     "device_indices"),
    ("write mismatched int32", lambda c: c.write(D8.int(), tok(3, dtype=torch.int32)),
     InvalidIndices, "device_indices"),
    # load (host -> device), per layer and all layers
    ("load float host", lambda c: c.load(tok(0).float(), D8[:4]), TensorMismatch,
     "host_indices"),
    ("load 2-D device", lambda c: c.load(tok(0, 2), D8.view(4, 2)), TensorMismatch,
     "device_indices"),
    ("load meta device", lambda c: c.load(tok(0), D8[:4].to(META)), TensorMismatch,
     "device_indices"),
    ("load host out of range", lambda c: c.load(tok(6), D8[:4]), InvalidIndices,
     "host_indices"),
    ("load device out of range", lambda c: c.load(tok(0), torch.arange(30, 34)),
     InvalidIndices, "device_indices"),
    ("load host misaligned", lambda c: c.load(torch.arange(1, 5), D8[:4]), InvalidIndices,
     "host_indices"),
    ("load duplicate device", lambda c: c.load(tok(0, 2), torch.tensor([8, 9, 10, 11,
                                                                        12, 13, 14, 8])),
     InvalidIndices, "device_indices"),
    ("load mismatched lengths", lambda c: c.load(tok(0, 2), D8[:4]), InvalidIndices,
     "device_indices"),
    ("load_all float device", lambda c: c.load(tok(0), D8[:4].half(), all_layers=True),
     TensorMismatch, "device_indices"),
    ("load_all host out of range", lambda c: c.load(tok(0, 9), D8, all_layers=True),
     InvalidIndices, "host_indices"),
    ("load_all duplicate device", lambda c: c.load(tok(0), torch.tensor([3, 3, 4, 5]),
                                                   all_layers=True),
     InvalidIndices, "device_indices"),
    ("load_all mismatched lengths", lambda c: c.load(tok(0), D8, all_layers=True),
     InvalidIndices, "device_indices"),
    # a plan used directly: the layer number of a per-layer load (None: every layer)
    *[(f"load_layer layer={layer!r}", functools.partial(_load_layer, layer=layer),
       InvalidArgument, "layer") for layer in (-1, LAYERS, 1.0, "0")],
]


@pytest.mark.parametrize(("call", "error", "argument"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(ctl: HiCacheController, call: Call,
                                                  error: type[KVCoreError],
                                                  argument: str) -> None:
    m = ctl.members[0]
    before = snapshot(m.device, m.host)
    with pytest.raises(error) as info:
        call(ctl)
    exc = info.value
    assert isinstance(exc, KVCoreError)
    assert isinstance(exc, InvalidArgument)
    assert exc.argument == argument
    assert str(exc).startswith(f"{argument}: expected ")
    assert_unchanged(m.device, m.host, before)
    assert ctl.pending_writes == 0
    assert ctl.usable


def test_message_names_backend_and_operation(ctl: HiCacheController) -> None:
    with pytest.raises(InvalidIndices) as info:
        ctl.load(tok(6), D8[:4])
    layout = ctl.members[0].host.geometry.layout.value
    assert str(info.value) == (f"host_indices: expected values in [0, {HOST_PAGES * PAGE}) "
                               f"for reference/{layout} load_layer, got {HOST_PAGES * PAGE + 3}")


def test_full_host_pool_refuses_and_changes_nothing(ctl: HiCacheController) -> None:
    m = ctl.members[0]
    before = snapshot(m.device, m.host)
    free = ctl.allocator.available_size()
    with pytest.raises(AllocatorError, match=r"host pool full"):
        ctl.write(torch.arange(free + PAGE))
    assert_unchanged(m.device, m.host, before)


def test_a_mistake_in_a_write_is_named_before_a_full_host_pool(
        ctl: HiCacheController) -> None:
    """With no room for the write, a device index out of range or of the wrong dtype is still
    what the caller hears (freeing pages would only lead to that error); nothing changes."""
    m = ctl.members[0]
    before = snapshot(m.device, m.host)
    free = ctl.allocator.available_size()
    state = ctl.allocator.state()
    too_far = torch.arange(free + PAGE)
    too_far[-1] = DEVICE_SIZE + 1
    with pytest.raises(InvalidIndices, match=rf"^device_indices: expected values in "
                       rf"\[0, {DEVICE_SIZE}\) .* got {DEVICE_SIZE + 1}$"):
        ctl.write(too_far)
    with pytest.raises(TensorMismatch, match=r"^device_indices: .*float32"):
        ctl.write(torch.arange(free + PAGE, dtype=torch.float32))
    with pytest.raises(AllocatorError, match=r"host pool full"):  # the call itself is right
        ctl.write(torch.arange(free + PAGE))
    assert ctl.allocator.state() == state and ctl.pending_writes == 0
    assert_unchanged(m.device, m.host, before)


def test_double_free_of_host_pages_changes_nothing(ctl: HiCacheController) -> None:
    m = ctl.members[0]
    before = snapshot(m.device, m.host)
    with pytest.raises(AllocatorError, match=r"^host_indices: page 1 \(slots 4\.\.7\) is not "
                                             r"allocated: freed already \(a double free\) or "
                                             r"never handed out; nothing was freed$"):
        ctl.free_host(tok(0, 1))
    assert_unchanged(m.device, m.host, before)


def test_wait_layer_out_of_range(ctl: HiCacheController) -> None:
    handle = ctl.load(tok(0), D8[:4])
    handle.wait()
    for layer in (-1, LAYERS, np.int64(LAYERS), 1.0, "0", None):
        with pytest.raises(InvalidArgument, match=r"^layer: expected an int in"):
            handle.wait_layer(layer)  # type: ignore[arg-type]
    handle.wait_layer(np.int64(LAYERS - 1))  # an integer of another type is that layer
    handle.wait_layer(torch.tensor(0))


def test_the_controller_still_works_after_refusals(ctl: HiCacheController) -> None:
    for _, call, error, _ in CASES:
        with pytest.raises(error):
            call(ctl)
    m = ctl.members[0]
    ack = ctl.write(torch.arange(16, 24))
    assert ctl.wait_acks() == [ack]
    ctl.load(ack.host_indices, torch.arange(24, 32)).wait()
    for kv in range(2):
        for layer in m.device.layers(kv):
            assert torch.equal(layer[16:24].view(torch.uint8), layer[24:32].view(torch.uint8))


def test_the_reference_refuses_pools_on_the_meta_device_naming_the_pool(
        ref_registry: Registry) -> None:
    """Meta tensors have shapes and no memory: the reference refuses the transfer before it
    reads anything (torch's 'Tensor.item() cannot be called on meta tensors' came out of it
    as a failed transfer), the write's host pages go back, and the controller stays usable."""
    from kvcore.pools import DevicePool
    from kvcore.registry import allocate_host_pool

    dev = DevicePool.allocate("mha", LAYERS, DEVICE_SIZE, 2, 8, torch.bfloat16, META, PAGE)
    host = allocate_host_pool("mha", "page_first", LAYERS, HOST_PAGES * PAGE, 2, 8,
                              torch.bfloat16, PAGE, "cpu", registry=ref_registry)
    c = HiCacheController(dev, host, registry=ref_registry)
    for _ in range(2):
        with pytest.raises(InvalidArgument, match=r"^device_pool: expected tensors with memory "
                           r".* got tensors on the meta device"):
            c.write(D8.to(META))
        assert c.allocator.available_size() == c.allocator.size and c.pending_writes == 0
    h = c.allocator.alloc(PAGE)
    with pytest.raises(InvalidArgument, match=r"^device_pool: .*meta"):
        c.load(h, D8[:4].to(META))
