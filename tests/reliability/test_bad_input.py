"""Random shapes, dtypes, devices and index values through the public API either give the
result of an independent oracle or raise a KVCoreError, never another exception, and leave
both pools and the allocator unchanged when they raise."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcore.controller import HiCacheController
from kvcore.errors import KVCoreError
from kvcore.layout import Kind, head_group_options, layouts_for
from kvcore.registry import Registry

from .helpers import Snapshot, bytes_equal, oracle_load, oracle_write, small_pools

REGISTRY = Registry({"KVCORE_PLUGINS": ""})  # the reference only, whatever is installed
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8]
INDEX_DTYPES = [torch.int32, torch.int16, torch.uint8,
                torch.float32, torch.bool]
NOT_TENSORS = [None, [0, 1, 2, 3], 3, "0:4", (0, 1)]


@st.composite
def pools(draw: st.DrawFn) -> HiCacheController:
    kind = draw(st.sampled_from(list(Kind)))
    layout = draw(st.sampled_from(layouts_for(kind)))
    head_num = 1 if kind is Kind.MLA else draw(st.integers(1, 2))
    head_dim, dtype = draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from(DTYPES))
    if not head_group_options(kind, layout, head_num, head_dim, dtype.itemsize):
        head_dim = 16  # page_unified's 16-byte rows
    ctl = HiCacheController(*small_pools(
        kind, layout, num_layers=draw(st.integers(1, 2)), head_num=head_num,
        head_dim=head_dim, page_size=draw(st.sampled_from([1, 2, 4])),
        device_pages=draw(st.integers(1, 3)), host_pages=draw(st.integers(1, 3)),
        dtype=dtype, seed=draw(st.integers(0, 2**16))),
        registry=REGISTRY)
    return ctl


@st.composite
def indices(draw: st.DrawFn, size: int, page_size: int, n_pages: int) -> object:
    """Whole pages (``n_pages`` of them, maybe repeated), then half the time one mutation:
    raw values, another dtype, another shape, another device, or no tensor at all."""
    unique = n_pages <= size // page_size and draw(st.integers(0, 3)) > 0
    pages = draw(st.lists(st.integers(0, size // page_size - 1), min_size=n_pages,
                          max_size=n_pages, unique=unique))
    t = (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size
         + torch.arange(page_size)).flatten()
    mutation = draw(st.sampled_from(["none"] * 5 + ["values", "dtype", "shape", "device",
                                                    "other"]))
    if mutation == "values":
        t = torch.tensor(draw(st.lists(st.integers(-2, size + 2), max_size=8)),
                         dtype=torch.int64)
    elif mutation == "dtype":
        t = t.to(draw(st.sampled_from(INDEX_DTYPES)))
    elif mutation == "shape":
        t = t.view(1, -1) if draw(st.booleans()) else (t[0] if t.numel() else torch.tensor(0))
    elif mutation == "device":
        t = t.to("meta")
    elif mutation == "other":
        return draw(st.sampled_from(NOT_TENSORS))
    return t


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_input_gives_the_oracle_result_or_a_typed_error(data: st.DataObject) -> None:
    ctl = data.draw(pools())
    m = ctl.members[0]
    g = m.host.geometry
    op = data.draw(st.sampled_from(["write", "write_at", "load", "load_all", "load_layer"]))
    n_pages = data.draw(st.integers(0, 3))
    d = data.draw(indices(m.device.size, g.page_size, n_pages), label="device_indices")
    h = data.draw(indices(g.size, g.page_size, n_pages), label="host_indices")
    layer = data.draw(st.sampled_from([0, g.num_layers - 1, -1, g.num_layers, None, 0.0]))
    before = Snapshot.of(ctl)
    host0 = m.host.buffer.clone()
    dev0 = [t.clone() for t in m.device.all_buffers()]
    try:
        if op == "write":
            ack = ctl.write(d)  # type: ignore[arg-type]
        elif op == "write_at":
            ack = ctl.write(d, h)  # type: ignore[arg-type]
        elif op == "load_layer":
            ctl.plan("load_layer").transfer(m.device, m.host, h, d, layer=layer)  # type: ignore[arg-type]
        else:
            ctl.load(h, d, all_layers=op == "load_all").wait()  # type: ignore[arg-type]
        if op.startswith("write"):
            assert ctl.wait_acks() == [ack]
    except KVCoreError as exc:
        event(f"{op}: {type(exc).__name__}")
        before.assert_unchanged(ctl)
        assert ctl.usable and ctl.pending_writes == 0
        return
    # it ran: the result is the oracle's, and nothing else moved
    event(f"{op}: ran")
    if op.startswith("write"):
        expected = oracle_write(m.device, m.host, ack.host_indices, ack.device_indices,
                                base=host0)
        assert bytes_equal(m.host.buffer, expected)
        assert all(bytes_equal(a, b) for a, b in zip(m.device.all_buffers(), dev0,
                                                     strict=True))
    else:
        assert bytes_equal(m.host.buffer, host0)
        for t, orig in zip(m.device.all_buffers(), dev0, strict=True):
            t.copy_(orig)  # recompute from the pre-transfer device state
        # a per-layer load through the plan with layer None moves every layer
        layers = range(layer, layer + 1) if op == "load_layer" and layer is not None else None
        expected_dev = oracle_load(m.device, m.host, h, d, layers)  # type: ignore[arg-type]
        ctl.load(h, d).wait() if layers is None else ctl.plan("load_layer").transfer(  # type: ignore[arg-type]
            m.device, m.host, h, d, layer=layer)
        for got, want in zip(m.device.all_buffers(), expected_dev, strict=True):
            assert bytes_equal(got, want)
