"""The one submit path on a GPU: nothing waits for the device, pools are checked at bind,
device-resident bad indices fail the transfer at its completion without touching a byte
outside the pages it names (GPU machines with a native backend only)."""

from __future__ import annotations

import time

import pytest
import torch

from kvcore import DevicePool, HiCacheController, HostPool
from kvcore.capabilities import HostMemory
from kvcore.cli.common import default_device
from kvcore.errors import InvalidIndices, TensorMismatch, TransferFailed
from kvcore.layout import Geometry, Kind, Layout, Op, host_shape, layouts_for
from kvcore.registry import allocate_host_pool, default_registry, make_request
from kvcore.verify import random_fill

DEVICE = default_device()
LAYERS, HEADS, HEAD_DIM, MLA_DIM = 4, 8, 128, 576
DEVICE_PAGES, HOST_PAGES = 24, 24


def _native() -> str | None:
    if DEVICE.type == "cpu":
        return None
    req = make_request(Op.WRITE_BACK, "mha", "page_first", torch.bfloat16,
                       HEADS * HEAD_DIM * 2, DEVICE)
    name = default_registry().resolve(req).backend_name
    return None if name == "reference" else name


NATIVE = _native()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(NATIVE is None, reason=f"no native backend available for {DEVICE}"),
]

#: every (kind, layout) the backend claims, at a small page (direct/signaled kernels) and a
#: large one (staged write-back and all-layer load, copy-engine per-layer load of layer_first)
CLAIMED = [(kind, layout) for kind in Kind for layout in layouts_for(kind)]
PAGES = [16, 64]


def _pools(kind: Kind, layout: Layout, page: int,
           gen: torch.Generator) -> tuple[DevicePool, HostPool]:
    heads, dim = (HEADS, HEAD_DIM) if kind is Kind.MHA else (1, MLA_DIM)
    dev = DevicePool.allocate(kind, LAYERS, DEVICE_PAGES * page, heads, dim, torch.bfloat16,
                              DEVICE, page)
    host = allocate_host_pool(kind, layout, LAYERS, HOST_PAGES * page, heads, dim,
                             torch.bfloat16, page, DEVICE)
    for t in [*dev.all_buffers(), host.buffer]:
        random_fill(t, gen)
    return dev, host


def _tokens(pages: torch.Tensor, page: int) -> torch.Tensor:
    return (pages[:, None] * page + torch.arange(page, device=pages.device)).flatten()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20261204)


@pytest.fixture(params=["caller", "thread", "direct", "direct_fenced"])
def handover(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Staged write-backs issued on the caller's thread, all handed to the library's, or all
    sent to the direct kernel (the controller's form for small ones): ordered after the
    caller's stream by the library (kvio_transfer_direct_after), or, as for a library without
    that function, by kvcore's fence and completion event."""
    monkeypatch.setattr("kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES",
                        1 if request.param == "thread" else 1 << 62)
    monkeypatch.setattr("kvcore.native.DIRECT_WRITE_BACK_MAX_BYTES",
                        1 << 62 if request.param.startswith("direct") else 0)
    if request.param == "direct_fenced":
        monkeypatch.setattr("kvcore.native_abi.DIRECT_AFTER_FUNCTIONS",
                            frozenset({"kvio_transfer_direct_after", "no such function"}))
    return str(request.param)


def _poll_until(ctl: HiCacheController, n: int, timeout_s: float = 30.0) -> list:
    acks: list = []
    deadline = time.monotonic() + timeout_s
    while len(acks) < n:
        acks += ctl.poll_acks()
        assert time.monotonic() < deadline, "acks never arrived"
    return acks


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("indices_on", ["device", "cpu"])
@pytest.mark.parametrize(("kind", "layout"), CLAIMED)
def test_controller_calls_never_synchronise(kind: Kind, layout: Layout, page: int,
                                            indices_on: str, gen: torch.Generator,
                                            handover: str) -> None:
    dev, host = _pools(kind, layout, page, gen)
    ctl = HiCacheController(dev, host)
    source = [t.clone() for t in dev.all_buffers()]
    where = DEVICE if indices_on == "device" else torch.device("cpu")
    src = _tokens(torch.randperm(DEVICE_PAGES, generator=gen)[:5], page).to(where)
    dst = _tokens(torch.randperm(DEVICE_PAGES, generator=gen)[:5], page).to(where)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ack = ctl.write(src)
        (got,) = _poll_until(ctl, 1)
        handle = ctl.load(got.host_indices, dst)
        for layer in range(LAYERS):
            handle.wait_layer(layer)
        whole = ctl.load(got.host_indices, dst, all_layers=True)
        whole.wait_layer(LAYERS - 1)
        while not whole.done():
            pass
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.id == ack.id
    torch.cuda.synchronize()
    for now, was in zip(dev.all_buffers(), source, strict=True):
        assert torch.equal(now[dst.to(DEVICE)].view(torch.uint8),
                           was[src.to(DEVICE)].view(torch.uint8))


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.LAYER_FIRST])
def test_calls_return_while_the_callers_stream_is_busy(layout: Layout, gen: torch.Generator,
                                                       handover: str) -> None:
    dev, host = _pools(Kind.MHA, layout, 64, gen)
    ctl = HiCacheController(dev, host)
    src = _tokens(torch.randperm(DEVICE_PAGES, generator=gen)[:4], 64).to(DEVICE)
    first = ctl.write(src)
    ctl.wait_acks()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 * 50.0 / start.elapsed_time(end))  # ~50 ms
    timings = {}
    for name, call in (("write", lambda: ctl.write(src)),
                       ("load", lambda: ctl.load(first.host_indices, src))):
        torch.cuda.synchronize()
        busy = torch.cuda.Event()
        torch.cuda._sleep(cycles)  # ~50 ms of work queued on the caller's stream
        busy.record()
        t0 = time.perf_counter()
        call()  # (its ack or load handle is dropped here, unfinished: that must not wait
        timings[name] = time.perf_counter() - t0  # either, a load job's included)
        assert not busy.query(), "the queued work finished before the call returned"
        torch.cuda.synchronize()
    assert timings["write"] < 2e-3 and timings["load"] < 2e-3, timings


def test_the_plan_api_refuses_pools_it_was_not_resolved_for(gen: torch.Generator) -> None:
    dev, host = _pools(Kind.MHA, Layout.PAGE_FIRST, 64, gen)
    plan = default_registry().resolve(make_request(
        Op.WRITE_BACK, "mha", "page_first", torch.bfloat16, dev.element_bytes, DEVICE))
    g = host.geometry
    other_dtype = HostPool(g, torch.empty(host_shape(g), dtype=torch.float16, pin_memory=True),
                           HostMemory.PINNED)
    fewer = Geometry(g.kind, g.layout, LAYERS - 1, g.size, g.head_num, g.head_dim, g.page_size)
    other_layers = HostPool(fewer, torch.empty(host_shape(fewer), dtype=torch.bfloat16,
                                               pin_memory=True), HostMemory.PINNED)
    plain = HostPool.wrap(torch.empty(host_shape(g), dtype=torch.bfloat16), "mha",
                          "page_first", LAYERS, HEADS, HEAD_DIM, 64)
    lying = HostPool(g, torch.empty(host_shape(g), dtype=torch.bfloat16), HostMemory.PINNED)
    for bad, argument in ((other_dtype, "host_pool.dtype"),
                          (other_layers, "host_pool.num_layers"),
                          (plain, "host_pool"), (lying, "host_pool.buffer")):
        with pytest.raises(TensorMismatch, match=argument):
            plan.transfer(dev, bad, torch.arange(64), torch.arange(64, device=DEVICE))
    sub = plan.transfer(dev, host, torch.arange(64), torch.arange(64, device=DEVICE))
    sub.synchronize()
    sub.check()
    torch.cuda.synchronize()  # the GPU is still usable


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("bad", [-3, DEVICE_PAGES * 64 + 5])
@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.LAYER_FIRST])
def test_a_bad_device_index_fails_the_write_at_completion_and_touches_nothing_else(
        layout: Layout, bad: int, page: int, gen: torch.Generator, handover: str) -> None:
    dev, host = _pools(Kind.MHA, layout, page, gen)
    ctl = HiCacheController(dev, host)
    device_before = [t.clone() for t in dev.all_buffers()]
    host_before = host.buffer.clone()
    free_before = ctl.allocator.available_size()
    src = _tokens(torch.randperm(DEVICE_PAGES, generator=gen)[:3], page).to(DEVICE)
    src[page + 7] = bad
    ack = ctl.write(src)  # a device-resident index is not copied back to be checked
    torch.cuda.synchronize()
    with pytest.raises(TransferFailed) as err:
        # a write-back the library's thread issues completes after the device sync's point
        assert _poll_until(ctl, 1) == [], "a write with a bad index was acknowledged"
    assert isinstance(err.value.cause, InvalidIndices)
    assert "device_indices" in str(err.value) and str(bad) in str(err.value)
    assert ctl.allocator.available_size() == free_before  # its host slots were released
    assert ctl.wait_acks() == []  # and it is never acknowledged
    for now, was in zip(dev.all_buffers(), device_before, strict=True):
        assert torch.equal(now.view(torch.uint8), was.view(torch.uint8))
    named = torch.zeros(host.geometry.size, dtype=torch.bool)
    named[ack.host_indices] = True
    view = host.buffer.view(torch.uint8)
    before = host_before.view(torch.uint8)
    untouched = _host_slots_outside(host, named)
    assert torch.equal(view[untouched], before[untouched])
    torch.cuda.synchronize()


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("bad", [-1, DEVICE_PAGES * 64 + 64])
@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.LAYER_FIRST])
def test_a_bad_device_index_fails_the_load_at_completion_and_touches_nothing_else(
        layout: Layout, bad: int, page: int, gen: torch.Generator) -> None:
    dev, host = _pools(Kind.MHA, layout, page, gen)
    ctl = HiCacheController(dev, host)
    src = _tokens(torch.randperm(DEVICE_PAGES, generator=gen)[:3], page).to(DEVICE)
    ack = ctl.write(src)
    ctl.wait_acks()
    device_before = [t.clone() for t in dev.all_buffers()]
    host_before = host.buffer.clone()
    dst = _tokens(torch.randperm(DEVICE_PAGES, generator=gen)[:3], page).to(DEVICE)
    dst[2 * page + 1] = bad
    for all_layers in (False, True):
        handle = ctl.load(ack.host_indices, dst, all_layers=all_layers)
        with pytest.raises(TransferFailed) as err:
            handle.wait()
        assert isinstance(err.value.cause, InvalidIndices)
        assert str(bad) in str(err.value)
        with pytest.raises(TransferFailed):
            handle.check()
    assert torch.equal(host.buffer.view(torch.uint8), host_before.view(torch.uint8))
    named = torch.zeros(dev.size, dtype=torch.bool)
    valid = dst[(dst >= 0) & (dst < dev.size)].cpu()
    named[valid] = True
    for now, was in zip(dev.all_buffers(), device_before, strict=True):
        assert torch.equal(now[~named.to(DEVICE)].view(torch.uint8),
                           was[~named.to(DEVICE)].view(torch.uint8))
    torch.cuda.synchronize()


def _host_slots_outside(host: HostPool, named: torch.Tensor) -> torch.Tensor:
    """A byte mask of the host buffer that is True outside the named token slots."""
    from kvcore.layout import canonical_view

    marks = torch.zeros(host_shape(host.geometry), dtype=torch.uint8)
    view = canonical_view(marks, host.geometry)  # (kv, layers, pages, page, heads, dim)
    per_token = named.view(view.shape[2], view.shape[3])
    view[:, :, per_token] = 1
    byte_marks = marks.view(-1).repeat_interleave(host.buffer.element_size())
    return (byte_marks == 0).view(host.buffer.view(torch.uint8).shape)


@pytest.mark.parametrize("caller", ["default", "side"])
@pytest.mark.parametrize(("kind", "layout"), [(Kind.MHA, Layout.PAGE_FIRST),
                                              (Kind.MLA, Layout.PAGE_FIRST),
                                              (Kind.MHA, Layout.LAYER_FIRST)])
def test_a_write_copies_what_the_callers_stream_wrote_before_the_call(
        kind: Kind, layout: Layout, caller: str, gen: torch.Generator, handover: str) -> None:
    """A staged write-back is issued by the library's thread later: it must still follow the
    caller's stream up to the call, and a burst of writes must each land where its ack says,
    though the caller dropped their index tensors and reuses memory of that size at once."""
    dev, host = _pools(kind, layout, 64, gen)
    ctl = HiCacheController(dev, host)
    stream = torch.cuda.default_stream() if caller == "default" else torch.cuda.Stream()
    pages = torch.randperm(DEVICE_PAGES, generator=gen)[:12]
    fresh = [torch.empty_like(t) for t in dev.all_buffers()]
    for t in fresh:
        random_fill(t, gen)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the new values land long after write() returned
        for t, new in zip(dev.all_buffers(), fresh, strict=True):
            t.copy_(new)
        acks = [ctl.write(_tokens(pages[i:i + 3].to(DEVICE), 64)) for i in range(0, 12, 3)]
        # each write's index tensor is dropped by the caller at once (only its ack holds it):
        # blocks of that size written on this stream now would be those tensors' memory if
        # anything had freed it before the copies read it
        junk = [torch.full((3 * 64,), 7, dtype=torch.int64, device=DEVICE) for _ in range(8)]
    done = ctl.wait_acks()
    del junk
    assert [a.id for a in done] == [a.id for a in acks]
    # read each ack's host pages back into pages no write read from (the load is checked
    # against the reference elsewhere): they must hold the values written after the sleep
    spare = torch.tensor([p for p in range(DEVICE_PAGES) if p not in pages.tolist()][:3])
    dst = _tokens(spare.to(DEVICE), 64)
    for ack in done:
        ctl.load(ack.host_indices, dst, all_layers=True).wait()
        torch.cuda.synchronize()
        for now, new in zip(dev.all_buffers(), fresh, strict=True):
            assert torch.equal(now[dst].view(torch.uint8),
                               new[ack.device_indices].view(torch.uint8))


def test_back_to_back_write_backs_of_mixed_sizes_each_land_whole(
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small write-backs overlap: the next one gathers into the other half of the staging
    buffer while the previous one's host copy runs on the buffer's copy stream. Queued back to
    back between write-backs that the library's thread issues through the same buffer (one
    of them pipelined through all of it) and one-page ones the direct kernel stores, each
    must land whole where its ack says."""
    page_bytes = 2 * LAYERS * 64 * HEADS * HEAD_DIM * 2  # K and V of one page: 1 MiB
    monkeypatch.setattr("kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES", 4 * page_bytes)
    monkeypatch.setattr("kvcore.native.DIRECT_WRITE_BACK_MAX_BYTES", page_bytes)
    dev, host = _pools(Kind.MHA, Layout.PAGE_FIRST, 64, gen)
    ctl = HiCacheController(dev, host)
    source = [t.clone() for t in dev.all_buffers()]
    order = torch.randperm(DEVICE_PAGES, generator=gen)
    # 1 page: the direct kernel; 2 and 3: staged by the caller, overlapped; 16 pages (16 MiB):
    # pipelined by the thread
    sizes = [1, 2, 1, 16, 1, 3]
    assert sum(sizes) == DEVICE_PAGES
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    torch.cuda.synchronize()
    acks = [ctl.write(_tokens(order[s:s + n].to(DEVICE), 64))
            for s, n in zip(starts, sizes, strict=True)]
    done = ctl.wait_acks()
    assert [a.id for a in done] == [a.id for a in acks]
    for t in dev.all_buffers():  # poison: only the loads below can bring the values back
        random_fill(t, gen)
    for ack in done:
        ctl.load(ack.host_indices, ack.device_indices, all_layers=True).wait()
    torch.cuda.synchronize()
    for now, was in zip(dev.all_buffers(), source, strict=True):
        assert torch.equal(now.view(torch.uint8), was.view(torch.uint8))
