"""Arguments of the wrong type or value, through the controller, plans, pools and requests,
raise InvalidArgument (or a subclass) naming the argument, never an error from deep inside,
and a refused call changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvcore.capabilities import HostMemory, op_support
from kvcore.controller import HiCacheController
from kvcore.errors import BackendUnavailable, InvalidArgument
from kvcore.layout import Kind, Layout, Op
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import Registry, allocate_host_pool, make_request
from kvcore.verify import random_fill

from .helpers import assert_unchanged, make_pools, page_tokens, reference_only, snapshot

P, LAYERS = 4, 2


def pools() -> tuple[DevicePool, HostPool]:
    return make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=LAYERS, host_pages=6,
                      device_size=32, head_num=2, head_dim=8, page_size=P,
                      dtype=torch.bfloat16, registry=reference_only())


@pytest.fixture
def ctl(gen: torch.Generator) -> HiCacheController:
    dev, host = pools()
    for t in [*dev.all_buffers(), host.buffer]:
        random_fill(t, gen)
    return HiCacheController(dev, host, registry=reference_only())


def _ctl(**kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        dev, host = pools()
        args = {"device_pool": dev, "host_pool": host, "registry": reference_only(), **kwargs}
        return HiCacheController(args.pop("device_pool"), args.pop("host_pool"), **args)
    return make


CONSTRUCTION = [
    ("device_pool", _ctl(device_pool=None)),
    ("device_pool", _ctl(device_pool="pool")),
    ("host_pool", _ctl(host_pool=None)),
    ("members", _ctl(members=None)),
    (r"members\[1\]", _ctl(members=[pools()[0]])),
    (r"members\[1\]", _ctl(members=[(*pools(), 1)])),
    (r"members\[1\]\.device_pool", _ctl(members=[(None, pools()[1])])),
    ("registry", _ctl(registry="x")),
    ("backend", _ctl(backend=["reference"])),
    ("selective_threshold", _ctl(selective_threshold="2")),
    ("selective_threshold", _ctl(selective_threshold=0)),
    ("process_group", _ctl(process_group="x")),
]


@pytest.mark.parametrize(("argument", "make"), CONSTRUCTION,
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(CONSTRUCTION)])
def test_construction_names_the_argument(argument: str, make: Callable[[], Any]) -> None:
    with pytest.raises(InvalidArgument, match=rf"^{argument}: expected"):
        make()


def test_pool_group_members_may_not_share_memory() -> None:
    dev, host = pools()
    dev2, host2 = pools()
    reg = reference_only()
    with pytest.raises(InvalidArgument, match=r"^members\[1\]\.host_pool: expected a host_pool "
                       r"of its own .* got memory shared with host_pool"):
        HiCacheController(dev, host, members=[(dev2, host)], registry=reg)
    with pytest.raises(InvalidArgument, match=r"^members\[1\]\.device_pool: .* shared with "
                       r"device_pool"):
        HiCacheController(dev, host, members=[(dev, host2)], registry=reg)
    # views that overlap in part count too
    big = [torch.zeros(48, 2, 8, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    a = DevicePool.wrap("mha", [t[:32] for t in big[:LAYERS]], [t[:32] for t in big[LAYERS:]], P)
    b = DevicePool.wrap("mha", [t[16:] for t in big[:LAYERS]], [t[16:] for t in big[LAYERS:]], P)
    with pytest.raises(InvalidArgument, match=r"members\[1\]\.device_pool"):
        HiCacheController(a, host, members=[(b, host2)], registry=reg)
    HiCacheController(dev, host, members=[(dev2, host2)], registry=reg)  # apart: fine


def _acked(c: HiCacheController) -> torch.Tensor:
    """The host indices of a write-back, acknowledged (a load may read them)."""
    ack = c.write(torch.arange(4))
    c.wait_acks()
    return ack.host_indices


CALLS: list[tuple[str, Callable[[HiCacheController], Any]]] = [
    ("member", lambda c: c.plan(Op.WRITE_BACK, member=1)),
    ("member", lambda c: c.plan(Op.WRITE_BACK, member=True)),
    ("member", lambda c: c.plan(Op.WRITE_BACK, member="0")),
    ("all_layers", lambda c: c.load(page_tokens([0], P), torch.arange(4), all_layers="no")),
    ("hits", lambda c: c.on_cache_event("hit", torch.arange(4), hits="2")),
    ("hits", lambda c: c.on_cache_event("hit", torch.arange(4), hits=-1)),
    ("device_indices", lambda c: c.on_cache_event("evict", [0, 1, 2, 3])),
    ("layer", lambda c: c.load(_acked(c), torch.arange(4, 8)).wait_layer(True)),
    ("layer", lambda c: c.bound[(0, Op.LOAD_LAYER)].submit(
        page_tokens([0], P), torch.arange(4), layer=True)),
    ("layer", lambda c: c.bound[(0, Op.LOAD_LAYER)].submit(
        page_tokens([0], P), torch.arange(4), layer=LAYERS, check=False)),
    ("layer", lambda c: c.bound[(0, Op.LOAD_LAYER)].submit(
        page_tokens([0], P), torch.arange(4), layer=-1, check=False)),
    ("layer", lambda c: c.bound[(0, Op.WRITE_BACK)].submit(
        page_tokens([0], P), torch.arange(4), layer=0, check=False)),
    # check=False vouches for values only: a kernel reads as many device indices as host ones
    ("device_indices", lambda c: c.bound[(0, Op.LOAD_LAYER)].submit(
        page_tokens([0, 1], P), torch.arange(4), check=False)),
    ("device_indices", lambda c: c.bound[(0, Op.WRITE_BACK)].submit(
        page_tokens([0], P), torch.arange(4.0), check=False)),
    ("host_indices", lambda c: c.bound[(0, Op.LOAD_ALL)].submit(
        [0, 1, 2, 3], torch.arange(4), check=False)),
    ("host_indices", lambda c: c.bound[(0, Op.LOAD_ALL)].submit(
        page_tokens([0], P).view(2, 2), torch.arange(4), check=False)),
    ("host_indices", lambda c: c.bound[(0, Op.LOAD_LAYER)].place([0, 1, 2, 3], torch.arange(4))),
    ("host_indices", lambda c: c.bound[(0, Op.LOAD_LAYER)].place(
        page_tokens([0], P).float() + 0.7, torch.arange(4))),
    ("device_indices", lambda c: c.bound[(0, Op.LOAD_LAYER)].variant_for(
        page_tokens([0], P), [0])),
    ("support", lambda c: c.bound[(0, Op.LOAD_LAYER)].place(
        page_tokens([0], P), torch.arange(4), support="x")),
    ("device_pool", lambda c: c.plan(Op.WRITE_BACK).bind(None, c.members[0].host)),  # type: ignore[arg-type]
    ("host_pool", lambda c: c.plan(Op.WRITE_BACK).bind(c.members[0].device,
                                                       c.members[0].device)),  # type: ignore[arg-type]
    ("request", lambda c: c.registry.resolve("write_back")),  # type: ignore[arg-type]
    ("backend", lambda c: c.registry.resolve(c.plan("write_back").request, ["reference"])),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("argument", "call"), CALLS,
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(CALLS)])
def test_calls_name_the_argument_and_change_nothing(ctl: HiCacheController, argument: str,
                                                    call: Callable[[HiCacheController], Any],
                                                    ) -> None:
    m = ctl.members[0]
    before = snapshot(m.device, m.host)
    pending = ctl.pending_writes
    with pytest.raises(InvalidArgument, match=rf"^{argument}: expected"):
        call(ctl)
    if argument != "layer":  # (the wait_layer case writes and loads before its refusal)
        assert_unchanged(m.device, m.host, before)
        assert ctl.pending_writes == pending
    assert ctl.usable


def test_a_layer_is_an_int_or_a_numpy_int_everywhere(ctl: HiCacheController) -> None:
    ack = ctl.write(torch.arange(4))
    ctl.wait_acks()
    bound = ctl.bound[(0, Op.LOAD_LAYER)]
    sub = bound.submit(ack.host_indices, torch.arange(4, 8), layer=np.int64(1))
    assert sub.layers == (1,)
    ctl.load(ack.host_indices, torch.arange(8, 12)).wait_layer(np.int32(LAYERS - 1))
    for bad in (True, 1.0, "1", None):
        with pytest.raises(InvalidArgument, match=r"^layer: expected an int"):
            sub.wait_layer(bad, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"^layer: expected an int or None"):
        sub.check(1.5)  # type: ignore[arg-type]


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("dtype", {"dtype": None}), ("dtype", {"dtype": "float32"}),
    ("element_bytes", {"element_bytes": "64"}), ("element_bytes", {"element_bytes": True}),
    ("element_bytes", {"element_bytes": 2.5}), ("element_bytes", {"element_bytes": 0}),
    ("device", {"device": "gpu"}), ("device", {"device": None}), ("device", {"device": 3}),
]


@pytest.mark.parametrize(("argument", "change"), REQUESTS,
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(REQUESTS)])
def test_make_request_names_the_argument(argument: str, change: dict[str, Any]) -> None:
    args = {"op": "write_back", "kind": "mha", "layout": "page_first",
            "dtype": torch.bfloat16, "element_bytes": 32, "device": "cpu", **change}
    with pytest.raises(InvalidArgument, match=rf"^{argument}: expected"):
        make_request(**args)


POOLS: list[tuple[str, Callable[[], Any]]] = [
    ("num_layers", lambda: DevicePool.allocate("mha", 0, 8, 2, 8, torch.float32, "cpu", P)),
    ("size", lambda: DevicePool.allocate("mha", 2, 8.0, 2, 8, torch.float32, "cpu", P)),
    ("head_num", lambda: DevicePool.allocate("mha", 2, 8, -2, 8, torch.float32, "cpu", P)),
    ("head_dim", lambda: DevicePool.allocate("mha", 2, 8, 2, None, torch.float32, "cpu", P)),
    ("page_size", lambda: DevicePool.allocate("mha", 2, 8, 2, 8, torch.float32, "cpu", "4")),
    ("dtype", lambda: DevicePool.allocate("mha", 2, 8, 2, 8, "float32", "cpu", P)),
    ("device", lambda: DevicePool.allocate("mha", 2, 8, 2, 8, torch.float32, "gpu", P)),
    ("k_buffers", lambda: DevicePool.wrap("mha", None, [torch.zeros(8, 2, 8)], P)),
    (r"k_buffers\[1\]", lambda: DevicePool.wrap(
        "mha", [torch.zeros(8, 2, 8), None], [torch.zeros(8, 2, 8)] * 2, P)),
    (r"k_buffers\[0\]", lambda: DevicePool.wrap("mla", [torch.zeros(0, 1, 8)], None, P)),
    ("page_size", lambda: DevicePool.wrap("mla", [torch.zeros(8, 1, 8)], None, 4.0)),
    ("buffer", lambda: HostPool.wrap(None, "mha", "page_first", 2, 2, 8, P)),  # type: ignore[arg-type]
    ("page_size", lambda: HostPool.wrap(torch.zeros(2, 6, 2, 2, 4, 8), "mha", "page_head",
                                        2, 2, 8, 0)),
    ("memory", lambda: HostPool.wrap(torch.zeros(2, 6 * P, 2, 2, 8), "mha", "page_first",
                                     2, 2, 8, P, memory="pinned-ish")),  # type: ignore[arg-type]
    ("dtype", lambda: allocate_host_pool("mha", "page_first", 2, 8, 2, 8, "float32", P, "cpu",
                                         registry=reference_only())),  # type: ignore[arg-type]
    ("registry", lambda: allocate_host_pool("mha", "page_first", 2, 8, 2, 8, torch.float32, P,
                                            "cpu", registry="x")),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("argument", "make"), POOLS,
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(POOLS)])
def test_pools_name_the_argument(argument: str, make: Callable[[], Any]) -> None:
    with pytest.raises(InvalidArgument, match=rf"^{argument}: expected"):
        make()


def test_host_pool_wrap_parses_the_memory_kind() -> None:
    buf = torch.zeros(2, 6 * P, 2, 2, 8)
    pool = HostPool.wrap(buf, "mha", "page_first", 2, 2, 8, P, memory="plain")  # type: ignore[arg-type]
    assert pool.memory is HostMemory.PLAIN


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_a_host_pool_for_a_device_torch_cannot_serve_is_a_typed_error() -> None:
    with pytest.raises((BackendUnavailable, InvalidArgument)):
        allocate_host_pool("mha", "page_first", 2, 8, 2, 8, torch.float32, P, "cuda",
                           registry=Registry({"KVCORE_PLUGINS": ""}))


@pytest.mark.parametrize(("argument", "declare"), [
    ("layer_signals", lambda: op_support("write_back", "mha", "page_first", "host", "device",
                                         layer_signals=True)),
    ("layer_signals", lambda: op_support("load_all", "mla", "page_first", "host", "device",
                                         layer_signals=True)),
    ("layouts", lambda: op_support("load_layer", "mla", "page_head", "host", "device")),
])
def test_impossible_declarations_are_refused_where_they_are_made(
        argument: str, declare: Callable[[], Any]) -> None:
    with pytest.raises(InvalidArgument, match=rf"^{argument}: expected"):
        declare()
    # a layout only some of the kinds have is fine: it is never asked of the others
    op_support("load_layer", ("mha", "mla"), ("page_head", "page_first"), "host", "device",
               layer_signals=True)
