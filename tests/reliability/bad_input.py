"""One random bad-input case through the public API, judged by an independent oracle: shared
by the reference's run (test_bad_input.py) and the GPU path's on an emulated native library
(tests/rocm/test_rocm_controller_emulated.py)."""

from __future__ import annotations

import torch
from hypothesis import event
from hypothesis import strategies as st

from kvcore.controller import HiCacheController
from kvcore.errors import KVCoreError

from .helpers import Snapshot, bytes_equal, oracle_load, oracle_write

INDEX_DTYPES = [torch.int32, torch.int16, torch.uint8,
                torch.float32, torch.bool]
NOT_TENSORS = [None, [0, 1, 2, 3], 3, "0:4", (0, 1)]


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


def bad_input_case(data: st.DataObject, ctl: HiCacheController) -> None:
    """Draw an operation and its indices (maybe mutated), run it through ``ctl``: it raises a
    KVCoreError with nothing changed and the controller usable, or moves exactly what the
    oracle says."""
    m = ctl.members[0]
    g = m.host.geometry
    op = data.draw(st.sampled_from(["write", "write_at", "load", "load_all", "load_layer"]))
    n_pages = data.draw(st.integers(0, 3))
    d = data.draw(indices(m.device.size, g.page_size, n_pages), label="device_indices")
    h = data.draw(indices(g.size, g.page_size, n_pages), label="host_indices")
    layer = data.draw(st.sampled_from([0, g.num_layers - 1, -1, g.num_layers, None, 0.0]))
    if op != "write":  # the caller's host slots come from the controller's allocator
        ctl.allocator.alloc(ctl.allocator.available_size())
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
        if op == "load_layer":
            ctl.plan("load_layer").transfer(m.device, m.host, h, d, layer=layer)  # type: ignore[arg-type]
        else:
            ctl.load(h, d).wait()  # type: ignore[arg-type]
        for got, want in zip(m.device.all_buffers(), expected_dev, strict=True):
            assert bytes_equal(got, want)
