"""Index residency and dtype follow the selected capability entry, for every combination."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcore.capabilities import HostMemory, IndexSpec, OpSupport, Residency, residency_device
from kvcore.controller import HiCacheController
from kvcore.errors import NoBackend
from kvcore.layout import Geometry, Kind, Layout, Op, host_shape
from kvcore.plan import BoundPlan
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import Registry, make_request
from kvcore.verify import random_fill

from .helpers import KIND_LAYOUTS, Received, fake_spec, make_pools, page_tokens

#: Page windows: pages under WINDOW bytes use variant "small", the others "large".
WINDOW = 200
NUM_LAYERS = 2
SMALL_PAGE, LARGE_PAGE = 2, 8  # 32-byte elements: page bytes 64/128 vs 256/512
DTYPE_SETS = [(torch.int64,), (torch.int32,), (torch.int64, torch.int32)]


def _declared() -> dict[tuple[Op, Layout, str], tuple[IndexSpec, IndexSpec]]:
    """A different (residency, dtypes) pair for host and device indices per entry."""
    table = {}
    combos = itertools.product(Op, Layout, ("small", "large"))
    for i, (op, layout, variant) in enumerate(combos):
        host = IndexSpec(Residency.HOST if i % 2 == 0 else Residency.DEVICE, DTYPE_SETS[i % 3])
        dev = IndexSpec(Residency.DEVICE if (i // 2) % 2 == 0 else Residency.HOST,
                        DTYPE_SETS[(i + 1) % 3])
        table[(op, layout, variant)] = (host, dev)
    return table


DECLARED = _declared()


def _ops() -> tuple[OpSupport, ...]:
    ops = []
    for (op, layout, variant), (host, dev) in DECLARED.items():
        lo, hi = (0, WINDOW) if variant == "small" else (WINDOW, None)
        ops.append(OpSupport(op=op, kinds=frozenset(Kind), layouts=frozenset([layout]),
                             host_index=host, device_index=dev, variant=variant,
                             min_page_bytes=lo, max_page_bytes=hi))
    return tuple(ops)


def test_the_declarations_cover_every_residency_and_dtype_pairing() -> None:
    pairs = {(h.residency, d.residency) for h, d in DECLARED.values()}
    assert pairs == set(itertools.product(Residency, Residency))
    assert {h.dtypes for h, _ in DECLARED.values()} == set(DTYPE_SETS)
    assert {d.dtypes for _, d in DECLARED.values()} == set(DTYPE_SETS)


@pytest.fixture
def resid() -> tuple[Registry, list[Received]]:
    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    received: list[Received] = []
    with reg.isolated():
        reg.register(fake_spec("resid", priority=50, ops=_ops(), received=received))
        yield reg, received


def _expected_dtype(given: torch.dtype, spec: IndexSpec) -> torch.dtype:
    return given if given in spec.dtypes else spec.dtypes[0]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("page_size", "variant"), [(SMALL_PAGE, "small"),
                                                    (LARGE_PAGE, "large")])
@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_run_receives_what_the_entry_declares(resid: tuple[Registry, list[Received]],
                                              kind: Kind, layout: Layout, page_size: int,
                                              variant: str, index_dtype: torch.dtype,
                                              gen: torch.Generator) -> None:
    reg, received = resid
    head_num, head_dim = (2, 8) if kind is Kind.MHA else (1, 16)
    dev, host = make_pools(kind, layout, num_layers=NUM_LAYERS, host_pages=3,
                           device_size=4 * page_size, head_num=head_num, head_dim=head_dim,
                           page_size=page_size, dtype=torch.bfloat16, registry=reg)
    for t in dev.all_buffers():
        random_fill(t, gen)
    source = [t.clone() for t in dev.all_buffers()]
    ctl = HiCacheController(dev, host, backend="resid", registry=reg)
    d = page_tokens([3, 0], page_size, index_dtype)
    h = page_tokens([2, 1], page_size, index_dtype)
    ctl.allocator.alloc(3 * page_size)  # the caller's host slots, from the allocator
    ctl.write(d, host_indices=h)
    assert len(ctl.wait_acks()) == 1
    back = page_tokens([1, 2], page_size, index_dtype)
    ctl.load(h, back).wait()
    ctl.load(h, back, all_layers=True).wait()

    ops = [Op.WRITE_BACK] + [Op.LOAD_LAYER] * NUM_LAYERS + [Op.LOAD_ALL]
    assert [r.op for r in received] == ops
    assert [r.layer for r in received] == [None, *range(NUM_LAYERS), None]
    for r in received:
        host_spec, dev_spec = DECLARED[(Op(r.op), layout, variant)]
        assert (r.kind, r.layout, r.variant) == (kind, layout, variant)
        assert r.host_device == residency_device(host_spec.residency, dev.device)
        assert r.device_device == residency_device(dev_spec.residency, dev.device)
        assert r.host_dtype == _expected_dtype(index_dtype, host_spec)
        assert r.device_dtype == _expected_dtype(index_dtype, dev_spec)
    # the delegated transfer really happened
    for now, was in zip(dev.all_buffers(), source, strict=True):
        assert torch.equal(now[back].view(torch.uint8), was[d].view(torch.uint8))


def _bound(reg: Registry, kind: Kind, layout: Layout, op: Op, page_size: int,
           device: torch.device) -> BoundPlan:
    """The "resid" plan bound to pools of ``page_size`` on ``device`` (a CPU host pool)."""
    head_num, head_dim = (2, 8) if kind is Kind.MHA else (1, 16)
    plan = reg.resolve(make_request(op, kind, layout, torch.bfloat16, 32, device),
                       backend="resid")
    size = 4 * page_size
    dev = DevicePool.allocate(kind, NUM_LAYERS, size, head_num, head_dim, torch.bfloat16,
                              device, page_size)
    g = Geometry(kind, layout, NUM_LAYERS, size, head_num, head_dim, page_size)
    host = HostPool(g, torch.empty(host_shape(g), dtype=torch.bfloat16), HostMemory.PLAIN)
    return plan.bind(dev, host)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("page_size", "variant"), [(SMALL_PAGE, "small"),
                                                    (LARGE_PAGE, "large")])
@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_place_moves_indices_to_the_declared_device(resid: tuple[Registry, list[Received]],
                                                    kind: Kind, layout: Layout, op: Op,
                                                    page_size: int, variant: str,
                                                    index_dtype: torch.dtype) -> None:
    """On a device that is not the CPU (meta here), host and device residency differ."""
    reg, _ = resid
    meta = torch.device("meta")
    bound = _bound(reg, kind, layout, op, page_size, meta)
    h = torch.arange(8, dtype=index_dtype)
    d = torch.arange(8, dtype=index_dtype)
    support = bound.variant_for(h, d)
    placed_h, placed_d = bound.place(h, d)
    host_spec, dev_spec = DECLARED[(op, layout, variant)]
    assert support.variant == variant
    assert support.host_index == host_spec
    assert placed_h.device == residency_device(host_spec.residency, meta)
    assert placed_d.device == residency_device(dev_spec.residency, meta)
    assert placed_h.device.type == ("cpu" if host_spec.residency is Residency.HOST
                                    else "meta")
    assert placed_d.device.type == ("cpu" if dev_spec.residency is Residency.HOST
                                    else "meta")
    assert placed_h.dtype == _expected_dtype(index_dtype, host_spec)
    assert placed_d.dtype == _expected_dtype(index_dtype, dev_spec)
    if placed_h.device.type == "cpu":
        assert torch.equal(placed_h.to(torch.int64), h.to(torch.int64))


def test_residency_device() -> None:
    cuda = torch.device("cuda", 1)
    assert residency_device(Residency.HOST, cuda) == torch.device("cpu")
    assert residency_device(Residency.DEVICE, cuda) == cuda
    assert residency_device(Residency.DEVICE, torch.device("cpu")) == torch.device("cpu")


def test_place_keeps_tensors_that_already_fit(resid: tuple[Registry, list[Received]]) -> None:
    reg, _ = resid
    bound = _bound(reg, Kind.MHA, Layout.PAGE_FIRST, Op.WRITE_BACK, SMALL_PAGE,
                   torch.device("cpu"))
    support = bound.support
    h = torch.arange(4, dtype=support.host_index.dtypes[0])
    d = torch.arange(4, dtype=support.device_index.dtypes[0])
    placed_h, placed_d = bound.place(h, d)
    assert placed_h is h and placed_d is d
    strided = torch.arange(8, dtype=support.host_index.dtypes[0])[::2]
    out = bound.place(strided, d)[0]
    assert out.is_contiguous() and torch.equal(out, strided)


def test_select_follows_the_half_open_window(resid: tuple[Registry, list[Received]]) -> None:
    reg, _ = resid
    plan = reg.resolve(make_request("load_layer", "mla", "page_first", torch.float16, 32,
                                    "cpu"), backend="resid")
    assert plan.select(0).variant == "small"
    assert plan.select(WINDOW - 1).variant == "small"
    assert plan.select(WINDOW).variant == "large"
    assert plan.select(10**12).variant == "large"
    assert plan.page_bytes(8, 5) == 8 * 32  # load_layer moves one layer
    facts = plan.describe()
    assert facts["backend"] == "resid" and facts["op"] == "load_layer"
    assert [v["variant"] for v in facts["variants"]] == ["small", "large"]


def test_select_without_a_fitting_window_raises(resid: tuple[Registry, list[Received]]) -> None:
    reg, _ = resid
    only_small = tuple(s for s in _ops() if s.variant == "small")
    with reg.isolated():
        reg.register(fake_spec("smallonly", ops=only_small))
        plan = reg.resolve(make_request("write_back", "mha", "page_first", torch.bfloat16, 32,
                                        "cpu"), backend="smallonly")
        with pytest.raises(NoBackend, match=r"smallonly: no variant's page window fits"):
            plan.select(WINDOW)
