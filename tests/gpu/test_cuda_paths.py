"""kvio_cuda's copy-engine per-layer load and its staged write-back and load, against the
reference on the GPU (CUDA machines only; skipped with the reason elsewhere).

The conformance suite (`kvio check cuda`) covers these variants through the capability records;
these tests aim at what it cannot choose: index patterns that split and merge copy runs, and a
staging budget small enough that one page of K and V together does not fit twice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_marks import needs_kvio_cuda

from kvcore import DevicePool, HostPool
from kvcore.cli.common import default_device
from kvcore.layout import Op
from kvcore.plan import TransferPlan
from kvcore.registry import allocate_host_pool, default_registry, make_request
from kvcore.verify import random_fill

DEVICE = default_device()
PAGE, LAYERS, POOL_PAGES = 64, 6, 48


pytestmark = needs_kvio_cuda(DEVICE)


def _geometry(kind: str) -> tuple[int, int]:
    return (4, 64) if kind == "mha" else (1, 576)  # 512-B and 1152-B elements in bf16


def _pools(kind: str, layout: str, gen: torch.Generator) -> tuple[DevicePool, HostPool]:
    heads, dim = _geometry(kind)
    dev = DevicePool.allocate(kind, LAYERS, POOL_PAGES * PAGE, heads, dim, torch.bfloat16,
                              DEVICE, PAGE)
    host = allocate_host_pool(kind, layout, LAYERS, POOL_PAGES * PAGE, heads, dim,
                             torch.bfloat16, PAGE, DEVICE, backend="cuda")
    for t in (*dev.all_buffers(), host.buffer):
        random_fill(t, gen)
    return dev, host


def _plan(op: Op, kind: str, layout: str, backend: str) -> TransferPlan:
    heads, dim = _geometry(kind)
    req = make_request(op, kind, layout, torch.bfloat16, heads * dim * 2, DEVICE)
    return default_registry().resolve(req, backend)


def _tokens(pages: list[int]) -> torch.Tensor:
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * PAGE + torch.arange(PAGE)).flatten()


def _index_patterns(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    perm = torch.randperm(POOL_PAGES, generator=gen).tolist()
    within = _tokens([3, 4])
    shuffled = within[torch.randperm(within.numel(), generator=gen)]
    return {
        # runs of several pages contiguous on both sides (merged into one copy each)
        "adjacent": (_tokens([5, 6, 7, 20, 21]), _tokens([30, 31, 32, 1, 2])),
        # scattered pages, host in reverse order
        "scattered": (_tokens(perm[:17][::-1]), _tokens(perm[17:34])),
        # single tokens: every run one element long
        "tokens": (within, shuffled),
        # two host pages into device slots that start mid-page (one run on a layer_first host)
        "ragged": (_tokens([8, 9]), torch.arange(7, 7 + 2 * PAGE)),
    }


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_dma_per_layer_load_equals_the_reference(kind: str, layout: str) -> None:
    import attrs

    from kvcore.layout import Layout
    from kvcore.native import native_ops

    # the dma variant first, whatever kvio_cuda.DMA_LOAD_LAYOUTS ships with
    ops = native_ops(dma_load_layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT))
    # from the smallest page on: this test's pools have 32 KiB (MHA) and 72 KiB (MLA) slices
    dma = attrs.evolve(next(v for v in ops if v.variant == "dma"), min_page_bytes=0)
    base = _plan(Op.LOAD_LAYER, kind, layout, "cuda")
    plan = attrs.evolve(base, variants=(dma, *base.variants))
    assert plan.select(PAGE * 1024).variant == "dma"
    gen = torch.Generator().manual_seed(97)
    ref = _plan(Op.LOAD_LAYER, kind, layout, "reference")
    for name, (h, d) in _index_patterns(gen).items():
        dev, host = _pools(kind, layout, gen)
        before = dev.clone()
        expected = dev.clone()
        h, d = h.cpu(), d.cpu()  # the copy engine computes its addresses on the CPU
        for layer in range(LAYERS):
            assert plan.bind(dev, host).variant_for(h, d).variant == "dma"
            plan.transfer(dev, host, h, d, layer=layer)
            ref.transfer(expected, host, h, d.to(DEVICE), layer=layer)
        torch.cuda.synchronize()
        untouched = torch.ones(POOL_PAGES * PAGE, dtype=torch.bool, device=DEVICE)
        untouched[d.to(DEVICE)] = False
        for kv in range(2 if kind == "mha" else 1):
            for layer in range(LAYERS):
                got, want = dev.layers(kv)[layer], expected.layers(kv)[layer]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                    (name, kv, layer)
                old = before.layers(kv)[layer]
                assert torch.equal(got[untouched].view(torch.int16),
                                   old[untouched].view(torch.int16)), (name, kv, layer)


def _shrink_staging(plan: TransferPlan, monkeypatch: pytest.MonkeyPatch, staging_pages: int,
                    page_bytes: int) -> None:
    """Give the plan's backend a staging buffer of ``staging_pages`` and a half pages."""
    backend = plan.instance()
    monkeypatch.setattr(backend, "staging_bytes", staging_pages * page_bytes + page_bytes // 2)
    monkeypatch.setattr(backend, "_staging", {})


@pytest.mark.parametrize("staging_pages", [1, 3])  # per-K/V pages the staging buffer holds
def test_staged_write_back_splits_k_and_v_when_a_page_pair_does_not_fit_twice(
        staging_pages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(11)
    plan = _plan(Op.WRITE_BACK, "mha", "page_first", "cuda")
    page_bytes = plan.page_bytes(PAGE, LAYERS)
    assert plan.select(page_bytes).variant == "staged"
    _shrink_staging(plan, monkeypatch, staging_pages, page_bytes)
    dev, host = _pools("mha", "page_first", gen)
    want = host.buffer.clone()
    h_pages = torch.randperm(POOL_PAGES, generator=gen)[:19].tolist()
    d_pages = torch.randperm(POOL_PAGES, generator=gen)[:19].tolist()
    h, d = _tokens(h_pages), _tokens(d_pages).to(DEVICE)
    plan.transfer(dev, host, h, d)
    expected = HostPool.wrap(want, "mha", "page_first", LAYERS, *_geometry("mha"), PAGE)
    _plan(Op.WRITE_BACK, "mha", "page_first", "reference").transfer(dev, expected, h, d)
    torch.cuda.synchronize()
    assert torch.equal(host.buffer.view(torch.int16), expected.buffer.view(torch.int16))


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("staging_pages", [1, 3, None])  # None: the shipped staging budget
def test_staged_all_layer_load_equals_the_reference_for_any_staging_budget(
        kind: str, staging_pages: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(13)
    plan = _plan(Op.LOAD_ALL, kind, "page_first", "cuda")
    page_bytes = plan.page_bytes(PAGE, LAYERS)
    assert plan.select(page_bytes).variant == "staged"
    if staging_pages is not None:  # a page of K and V together fits once (1) or not twice (3)
        _shrink_staging(plan, monkeypatch, staging_pages, page_bytes)
    ref = _plan(Op.LOAD_ALL, kind, "page_first", "reference")
    for name, (h, d) in _index_patterns(gen).items():
        if name in ("tokens", "ragged"):
            continue  # the staged variant moves whole pages only
        dev, host = _pools(kind, "page_first", gen)
        expected = dev.clone()
        plan.transfer(dev, host, h, d.to(DEVICE))
        ref.transfer(expected, host, h, d.to(DEVICE))
        torch.cuda.synchronize()
        for kv in range(2 if kind == "mha" else 1):
            for layer in range(LAYERS):  # untouched slots included: expected started as dev
                got, want = dev.layers(kv)[layer], expected.layers(kv)[layer]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                    (name, kv, layer)


# ------------------------------------------------------------------ the signaled per-layer load


def _signaled_load(kind: str, layout: str, gen: torch.Generator, stream: torch.cuda.Stream,
                   ) -> tuple[TransferPlan, DevicePool, HostPool, DevicePool, object,
                              torch.Tensor]:
    """A signaled per-layer load of the 'scattered' pattern enqueued on ``stream``; returns
    the plan, the pool, the host pool, the reference's result, the signals and the device
    destinations."""
    plan = _plan(Op.LOAD_LAYER, kind, layout, "cuda")
    ref = _plan(Op.LOAD_LAYER, kind, layout, "reference")
    h, d = _index_patterns(gen)["scattered"]
    dev, host = _pools(kind, layout, gen)
    expected = dev.clone()
    for layer in range(LAYERS):
        ref.transfer(expected, host, h, d.to(DEVICE), layer=layer)
    torch.cuda.synchronize()
    bound = plan.bind(dev, host)
    assert bound.variant_for(h, d.to(DEVICE)).layer_signals, bound.support
    with torch.cuda.stream(stream):
        sub = bound.submit(h, d.to(DEVICE), stream=stream)
    (signals,) = sub.completions
    return plan, dev, host, expected, signals, d.to(DEVICE)


# (layer_first MLA slices of 64 x 1152 B go to the copy engine; page_head is MHA only)
@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first"), ("mla", "page_first"),
                                              ("mha", "layer_first"), ("mha", "page_head")])
def test_signaled_load_equals_the_reference_and_raises_every_flag(kind: str,
                                                                  layout: str) -> None:
    from kvcore.native import NativeLayerSignals

    gen = torch.Generator().manual_seed(2024)
    stream = torch.cuda.Stream(DEVICE)
    plan, dev, _, expected, signals, _ = _signaled_load(kind, layout, gen, stream)
    assert isinstance(signals, NativeLayerSignals)
    consumer = torch.cuda.Stream(DEVICE)
    for layer in range(LAYERS):
        signals.wait_layer(layer, consumer)
    consumer.synchronize()  # returns: every flag was raised
    stream.synchronize()
    for kv in range(2 if kind == "mha" else 1):
        for layer in range(LAYERS):
            assert torch.equal(dev.layers(kv)[layer].view(torch.int16),
                               expected.layers(kv)[layer].view(torch.int16)), (kv, layer)
    buf = plan.instance()._signals[int(stream.cuda_stream)]
    assert buf.flag_memory[:LAYERS].tolist() == [signals.epoch] * LAYERS
    assert all(buf.has_landed(layer, signals.epoch) for layer in range(LAYERS))
    # the warp that completes a group zeroes its counter, so the next load starts from zero
    assert not any(buf.counter_memory.tolist()), buf.counter_memory.tolist()


def test_a_wait_on_a_layer_holds_its_stream_until_the_flag_is_raised() -> None:
    gen = torch.Generator().manual_seed(5)
    stream = torch.cuda.Stream(DEVICE)
    plan, _, _, _, signals, _ = _signaled_load("mha", "layer_first", gen, stream)
    stream.synchronize()
    buf = plan.instance()._signals[int(stream.cuda_stream)]
    # a wait for the next epoch, whose flag a slow writer enqueued BEFORE the wait raises by
    # hand (as a load does): a wait blocks its hardware queue, which other streams may share,
    # so the work that raises a flag must be enqueued before any wait on it
    future = type(signals)(plan.instance(), buf, (signals.epoch + 1) & 0xFFFFFFFF,
                           signals._done)
    writer, consumer = torch.cuda.Stream(DEVICE), torch.cuda.Stream(DEVICE)
    # the flags are pinned host memory: the writer raises one with a copy on its stream
    raised = torch.tensor([future.epoch, signals.epoch], dtype=torch.int32, device=DEVICE)
    with torch.cuda.stream(writer):
        torch.cuda._sleep(100_000_000)  # about 50 ms
        buf.flag_memory[3:4].copy_(raised[:1], non_blocking=True)
    assert not buf.has_landed(3, future.epoch)
    future.wait_layer(3, consumer)
    after = torch.cuda.Event()
    after.record(consumer)
    assert not after.query(), "the wait passed a flag that was not raised yet"
    after.synchronize()  # the consumer goes on once the writer raised it
    assert writer.query() and buf.has_landed(3, future.epoch)
    with torch.cuda.stream(writer):
        buf.flag_memory[3:4].copy_(raised[1:], non_blocking=True)
    writer.synchronize()


def test_back_to_back_signaled_loads_on_one_stream_raise_growing_epochs_and_stay_exact(
) -> None:
    gen = torch.Generator().manual_seed(77)
    stream = torch.cuda.Stream(DEVICE)
    plan, dev, host, expected, first, d = _signaled_load("mla", "page_first", gen, stream)
    h, _ = _index_patterns(torch.Generator().manual_seed(77))["scattered"]
    with torch.cuda.stream(stream):
        (second,) = plan.bind(dev, host).submit(h, d, stream=stream).completions
    assert second.epoch == first.epoch + 1
    consumer = torch.cuda.Stream(DEVICE)
    second.wait_layer(LAYERS - 1, consumer)
    consumer.synchronize()
    stream.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dev.layers(0)[layer].view(torch.int16),
                           expected.layers(0)[layer].view(torch.int16)), layer


#: (pages, through the ring): 15 pages (960 tokens) travel in the launch one index per token,
#: 16 one per page; forced through the index ring, 16 are uploaded
INLINE_ROUTES = [(15, False), (16, False), (16, True)]


def _inline_or_ring(bound: Any, variant: Any, ring: bool, grid_bytes: int) -> None:
    """Check how many CPU host indices ``variant``'s launch carries (whole pages of PAGE, a
    grid moving ``grid_bytes`` per token); ``ring``: make the plan upload them instead."""
    from kvcore.native_abi import inline_index_limit

    assert bound._inline_host[id(variant)] == inline_index_limit(PAGE, grid_bytes)
    if ring:
        bound._inline_host[id(variant)] = 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("pages", "ring"), INLINE_ROUTES)
def test_a_signaled_load_equals_the_reference_with_host_indices_in_its_launch_or_uploaded(
        pages: int, ring: bool, dtype: torch.dtype) -> None:
    """CPU host indices travel in the launch (one per token up to KVIO_INLINE_INDEX_TOKENS,
    else one per whole page) or, forced, through the index ring: each moves exactly what the
    reference moves and leaves every other device slot as it was."""
    gen = torch.Generator().manual_seed(300 + pages + ring)
    dev, host = _pools("mla", "page_first", gen)
    bound = _plan(Op.LOAD_LAYER, "mla", "page_first", "cuda").bind(dev, host)
    ref = _plan(Op.LOAD_LAYER, "mla", "page_first", "reference")
    perm = torch.randperm(POOL_PAGES, generator=gen).tolist()
    h, d = _tokens(perm[:pages]).to(dtype), _tokens(perm[pages:2 * pages]).to(DEVICE)
    variant = bound.variant_for(h, d)
    assert variant.layer_signals
    _inline_or_ring(bound, variant, ring, 576 * 2)  # (one layer's MLA element per grid)
    expected, before = dev.clone(), dev.clone()
    for layer in range(LAYERS):
        ref.transfer(expected, host, h.to(torch.int64), d, layer=layer)
    sub = bound.submit(h, d)
    sub.synchronize()
    sub.check()
    touched = torch.zeros(POOL_PAGES * PAGE, dtype=torch.bool, device=DEVICE)
    touched[d] = True
    for layer in range(LAYERS):
        got, want = dev.layers(0)[layer], expected.layers(0)[layer]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), layer
        assert torch.equal(got[~touched].view(torch.int16),
                           before.layers(0)[layer][~touched].view(torch.int16)), layer


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("pages", "ring"), INLINE_ROUTES)
def test_a_direct_write_back_equals_the_reference_with_host_indices_in_its_launch_or_uploaded(
        pages: int, ring: bool, dtype: torch.dtype) -> None:
    """layer_first write-backs go to the direct kernel: CPU host indices in its launch (one
    per token, or per page), or, forced, through the index ring. The whole host pool must
    equal the reference's (the pages named written, every other byte as it was)."""
    gen = torch.Generator().manual_seed(400 + pages + ring)
    dev, host = _pools("mha", "layer_first", gen)
    bound = _plan(Op.WRITE_BACK, "mha", "layer_first", "cuda").bind(dev, host)
    perm = torch.randperm(POOL_PAGES, generator=gen).tolist()
    h, d = _tokens(perm[:pages]).to(dtype), _tokens(perm[pages:2 * pages]).to(DEVICE)
    variant = bound.variant_for(h, d)
    assert variant.variant == "direct"
    _inline_or_ring(bound, variant, ring, 2 * 512 * LAYERS)  # (K and V of every layer)
    expected = HostPool.wrap(host.buffer.clone(), "mha", "layer_first", LAYERS,
                             *_geometry("mha"), PAGE)
    _plan(Op.WRITE_BACK, "mha", "layer_first", "reference").transfer(dev, expected,
                                                                     h.to(torch.int64), d)
    sub = bound.submit(h, d)
    sub.synchronize()
    sub.check()
    assert torch.equal(host.buffer.view(torch.int16), expected.buffer.view(torch.int16))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_per_layer_submits_of_the_same_cpu_indices_move_what_each_submit_names(
        layout: str) -> None:
    """An engine submitting each layer of a load with the same CPU tensors (SGLang's hooks):
    the bound plan's ring hands later layers the slot the first one uploaded, and must notice
    values changed between layers, by torch or through a NumPy view."""
    gen = torch.Generator().manual_seed(131)
    dev, host = _pools("mha", layout, gen)
    bound = _plan(Op.LOAD_LAYER, "mha", layout, "cuda").bind(dev, host)
    ref = _plan(Op.LOAD_LAYER, "mha", layout, "reference")
    expected, before = dev.clone(), dev.clone()
    perm = torch.randperm(POOL_PAGES, generator=gen).tolist()
    h, d = _tokens(perm[:5]), _tokens(perm[5:10])
    touched = torch.zeros(POOL_PAGES * PAGE, dtype=torch.bool, device=DEVICE)
    for layer in range(LAYERS):
        if layer == 2:
            h.numpy()[:] = _tokens(perm[10:15]).numpy()  # no version bump
        if layer == 4:
            d.copy_(_tokens(perm[15:20]))
        bound.submit(h, d, layer=layer, chained=layer > 0)
        ref.transfer(expected, host, h.clone(), d.to(DEVICE), layer=layer)
        touched[d.to(DEVICE)] = True
    torch.cuda.synchronize()
    for kv in range(2):
        for layer in range(LAYERS):
            got, want = dev.layers(kv)[layer], expected.layers(kv)[layer]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (kv, layer)
            old = before.layers(kv)[layer]
            assert torch.equal(got[~touched].view(torch.int16),
                               old[~touched].view(torch.int16)), (kv, layer)


# ------------------------------------------------------------------ the index ring's upload stream


@pytest.mark.parametrize(("op", "layout"), [(Op.LOAD_LAYER, "page_first"),
                                            (Op.WRITE_BACK, "layer_first")])
def test_a_transfer_waits_for_its_index_upload_held_back_on_the_rings_stream(
        op: Op, layout: str) -> None:
    """CPU host indices that do not go in a launch (here: the plan told that none do) go to
    the device on the index ring's own stream, and the transfer's stream waits for them. Here
    the ring's stream is held 50 ms behind a sleeping kernel when the transfer is submitted: a
    transfer that did not wait would read the slot before its indices arrived (the ring's
    fresh device memory) and move other pages."""
    gen = torch.Generator().manual_seed(61)
    plan, ref = _plan(op, "mha", layout, "cuda"), _plan(op, "mha", layout, "reference")
    dev, host = _pools("mha", layout, gen)
    bound = plan.bind(dev, host)
    bound._inline_host = dict.fromkeys(bound._inline_host, 0)
    n = 16  # pages per transfer
    pages = torch.randperm(POOL_PAGES - 1, generator=gen)[:2 * n] + 1  # (never page 0)
    first, second = _tokens(pages[:n].tolist()), _tokens(pages[n:].tolist())
    d = _tokens(torch.randperm(POOL_PAGES, generator=gen)[:n].tolist()).to(DEVICE)
    stream = torch.cuda.Stream(DEVICE)
    with torch.cuda.stream(stream):
        bound.submit(first, d, stream=stream)  # makes the ring's stream
    stream.synchronize()
    ring = bound._ring
    assert ring is not None and ring._upload_stream is not None, "no upload through the ring"
    expected_dev, expected_host = dev.clone(), host.buffer.clone()
    expected_pools = (expected_dev, HostPool.wrap(expected_host, "mha", layout, LAYERS,
                                                  *_geometry("mha"), PAGE))
    layers = range(LAYERS) if op is Op.LOAD_LAYER else [None]
    for layer in layers:
        ref.transfer(*expected_pools, second, d, layer=layer)
    torch.cuda.synchronize()
    with torch.cuda.stream(ring._upload_stream):
        torch.cuda._sleep(100_000_000)  # about 50 ms
    with torch.cuda.stream(stream):
        sub = bound.submit(second, d, stream=stream)
    torch.cuda.synchronize()
    for c in sub.completions:
        c.check()
    for kv in range(2):
        for layer in range(LAYERS):
            assert torch.equal(dev.layers(kv)[layer].view(torch.int16),
                               expected_dev.layers(kv)[layer].view(torch.int16)), (kv, layer)
    assert torch.equal(host.buffer.view(torch.int16), expected_host.view(torch.int16))
