"""An unsupported combination fails at construction with a clear typed error."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvcore.capabilities import HostMemory, Unavailable
from kvcore.controller import HiCacheController
from kvcore.errors import (
    BackendUnavailable,
    BuildError,
    InvalidArgument,
    KVCoreError,
    NoBackend,
    TensorMismatch,
    UnsupportedCombination,
)
from kvcore.layout import Kind, Layout
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import Registry, allocate_host_pool

from .helpers import all_ops, fake_spec, make_pools


@pytest.fixture
def reg() -> Registry:
    r = Registry(environ={"KVCORE_PLUGINS": ""})
    with r.isolated():
        yield r


def _pools(reg: Registry, layout: Layout = Layout.LAYER_FIRST, kind: Kind = Kind.MHA,
           **kw: object) -> tuple[DevicePool, HostPool]:
    sizes = dict(num_layers=2, host_pages=4, device_size=16,
                 head_num=2 if kind is Kind.MHA else 1, head_dim=8, page_size=4,
                 dtype=torch.bfloat16)
    sizes.update(kw)
    return make_pools(kind, layout, registry=reg, **sizes)


def test_mla_page_head_host_pool_is_refused(reg: Registry) -> None:
    with pytest.raises(UnsupportedCombination, match=r"page_head is defined for MHA only"):
        allocate_host_pool("mla", "page_head", 2, 16, 1, 8, torch.bfloat16, 4, "cpu",
                          registry=reg)
    with pytest.raises(UnsupportedCombination, match=r"page_head"):
        HostPool.wrap(torch.empty(4, 1, 4, 2, 8), "mla", "page_head", 2, 1, 8, 4)


def test_forced_backend_without_the_layout_fails_at_construction(reg: Registry) -> None:
    reg.register(fake_spec("narrow", priority=50, ops=all_ops(layouts=[Layout.PAGE_FIRST])))
    dev, host = _pools(reg, Layout.LAYER_FIRST)
    with pytest.raises(NoBackend) as info:
        HiCacheController(dev, host, backend="narrow", registry=reg)
    assert info.value.reasons["narrow"].startswith("does not implement")
    assert "mha/layer_first" in str(info.value)
    # unforced, the reference serves it
    assert HiCacheController(dev, host, registry=reg).plan("write_back").backend_name \
        == "reference"


def test_backend_env_without_the_layout_fails_at_construction() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "", "KVCORE_BACKEND": "narrow"})
    with reg.isolated():
        reg.register(fake_spec("narrow", ops=all_ops(layouts=[Layout.PAGE_FIRST])))
        dev, host = _pools(reg, Layout.PAGE_HEAD)
        with pytest.raises(NoBackend, match=r"narrow: does not implement"):
            HiCacheController(dev, host, registry=reg)


def test_forced_unavailable_backend_fails_at_construction(reg: Registry) -> None:
    reg.register(fake_spec("gone", probe=lambda: Unavailable("no widget on this machine")))
    dev, host = _pools(reg)
    with pytest.raises(BackendUnavailable, match=r"'gone'.*no widget on this machine"):
        HiCacheController(dev, host, backend="gone", registry=reg)


def test_pinned_backend_refuses_a_plain_host_pool(reg: Registry) -> None:
    reg.register(fake_spec("pinned", priority=50, host_memory=HostMemory.PINNED))
    dev, host = _pools(reg, Layout.PAGE_FIRST)
    assert host.memory is HostMemory.PLAIN
    with pytest.raises(TensorMismatch, match=r"^host_pool: expected pinned host memory for "
                                             r"pinned/page_first write_back, got plain"):
        HiCacheController(dev, host, registry=reg)


def test_contiguous_pages_backend_refuses_layer_first(reg: Registry) -> None:
    reg.register(fake_spec("contig", priority=50, ops=all_ops(contiguous_pages=True)))
    dev, host = _pools(reg, Layout.LAYER_FIRST)
    with pytest.raises(TensorMismatch, match=r"^host_pool: expected contiguous host pages"):
        HiCacheController(dev, host, registry=reg)
    dev, host = _pools(reg, Layout.PAGE_FIRST_DIRECT)
    assert HiCacheController(dev, host, registry=reg).plan("load_layer").backend_name == "contig"


@pytest.mark.parametrize(("field", "host_kw"), [
    ("num_layers", dict(num_layers=3)),
    ("head_num", dict(head_num=4)),
    ("head_dim", dict(head_dim=16)),
    ("page_size", dict(page_size=8)),
    ("dtype", dict(dtype=torch.float16)),
])
def test_device_and_host_geometry_must_match(reg: Registry, field: str,
                                             host_kw: dict[str, object]) -> None:
    dev, _ = _pools(reg)
    _, host = _pools(reg, **host_kw)
    with pytest.raises(TensorMismatch, match=rf"^host_pool.{field}: expected") as info:
        HiCacheController(dev, host, registry=reg)
    assert info.value.argument == f"host_pool.{field}"


def test_kind_must_match(reg: Registry) -> None:
    dev, _ = _pools(reg, kind=Kind.MLA)
    _, host = _pools(reg, kind=Kind.MHA, head_num=1)
    with pytest.raises(TensorMismatch, match=r"^host_pool.kind"):
        HiCacheController(dev, host, registry=reg)


def test_group_members_must_share_the_geometry(reg: Registry) -> None:
    dev, host = _pools(reg)
    dev2, host2 = _pools(reg, host_pages=8)
    with pytest.raises(TensorMismatch, match=r"^members\[1\]"):
        HiCacheController(dev, host, registry=reg, members=[(dev2, host2)])


def test_group_members_must_have_the_first_members_layer_count(reg: Registry) -> None:
    """A member with more layers would have its extra layers never loaded (issue 25, item 6)."""
    dev, host = _pools(reg)
    dev3, host3 = _pools(reg, num_layers=3)
    with pytest.raises(TensorMismatch, match=r"^members\[1\]\.num_layers: expected 2"):
        HiCacheController(dev, host, registry=reg, members=[(dev3, host3)])


def test_unknown_write_policy_names_the_argument(reg: Registry) -> None:
    dev, host = _pools(reg)
    with pytest.raises(InvalidArgument, match=r"^write_policy: expected one of write_through"):
        HiCacheController(dev, host, "write_sometimes", registry=reg)


def test_device_pool_tensors_must_agree() -> None:
    k = [torch.empty(16, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(TensorMismatch, match=r"^v_buffers\[1\]: expected bfloat16"):
        DevicePool.wrap("mha", k, [k[0].clone(), torch.empty(16, 2, 8, device="meta")],
                        page_size=4)
    with pytest.raises(TensorMismatch, match=r"^k_buffers\[1\]"):
        DevicePool.wrap("mla", [torch.empty(16, 1, 8), torch.empty(16, 1, 8).half()],
                        page_size=4)
    with pytest.raises(TensorMismatch, match=r"^v_buffers\[0\]: expected a contiguous"):
        DevicePool.wrap("mha", k, [torch.empty(8, 16, 2, dtype=torch.bfloat16).permute(1, 2, 0),
                                   k[1]], page_size=4)
    with pytest.raises(InvalidArgument, match=r"^v_buffers"):
        DevicePool.wrap("mha", k, None, page_size=4)
    with pytest.raises(InvalidArgument, match=r"^page_size"):
        DevicePool.wrap("mla", [torch.empty(16, 1, 8)], page_size=5)


def test_host_pool_buffer_must_be_a_host_tensor_of_the_right_shape() -> None:
    with pytest.raises(TensorMismatch, match=r"^buffer: expected a tensor in host memory"):
        HostPool.wrap(torch.empty(2, 2, 16, 2, 8, device="meta"), "mha", "layer_first", 2, 2, 8,
                      4)
    with pytest.raises(TensorMismatch, match=r"^buffer: expected a contiguous"):
        HostPool.wrap(torch.empty(2, 16, 2, 2, 8).transpose(1, 2), "mha", "layer_first", 2, 2,
                      8, 4)
    with pytest.raises(KVCoreError, match=r"^buffer: expected shape"):
        HostPool.wrap(torch.empty(2, 2, 16, 2, 8), "mha", "layer_first", 3, 2, 8, 4)


def test_a_factory_that_raises_becomes_a_typed_build_error(reg: Registry) -> None:
    def broken_factory(device: torch.device) -> object:
        raise OSError("libkvio_fake.so: cannot open shared object file")

    spec = fake_spec("fragile")
    reg.register(attrs.evolve(spec, factory=broken_factory))
    with pytest.raises(BuildError, match=r"backend 'fragile' could not be created for cpu.*"
                                         r"OSError: libkvio_fake.so"):
        allocate_host_pool("mha", "page_first", 2, 16, 2, 8, torch.bfloat16, 4, "cpu",
                          backend="fragile", registry=reg)


def test_a_factory_of_the_wrong_signature_is_told_how_it_is_called(reg: Registry) -> None:
    spec = fake_spec("no_device")
    reg.register(attrs.evolve(spec, factory=lambda: object()))
    with pytest.raises(BuildError, match=r"backend 'no_device' could not be created for cpu: "
                                         r"TypeError: .* \(kvcore calls the spec's factory "
                                         r"as factory\(device\), with a torch.device\)"):
        reg.instance("no_device", torch.device("cpu"))


def test_a_variant_may_name_kinds_layouts_and_residencies_by_their_values() -> None:
    """As README's example writes them: the record holds the enum members (what ``kvio
    backends`` and the placement compare by identity)."""
    from kvcore.capabilities import Residency, op_support
    from kvcore.layout import Op

    s = op_support("write_back", ("mha", "mla"), "page_first", "host", Residency.DEVICE)
    assert s.op is Op.WRITE_BACK
    assert s.kinds == {Kind.MHA, Kind.MLA} and all(isinstance(k, Kind) for k in s.kinds)
    assert s.layouts == {Layout.PAGE_FIRST} and isinstance(next(iter(s.layouts)), Layout)
    assert s.host_index.residency is Residency.HOST


@pytest.mark.parametrize(("field", "value", "message"), [
    ("kinds", "mhx", r"^kinds: expected one of mha, mla, got 'mhx'"),
    ("kinds", (), r"^kinds: expected at least one of mha, mla, got none"),
    ("layouts", ("page-first",), r"^layouts: expected one of layer_first, .*got 'page-first'"),
    ("host", "pinned", r"^residency: expected one of host, device, got 'pinned'"),
    ("element_alignment", 3, r"^element_alignment: expected a power of two, in bytes, got 3"),
    ("dtypes", "bf16", r"^dtypes: expected torch dtypes \(torch.bfloat16\) or their names "
                       r"\('bfloat16'\), got str 'bf16'"),
    ("dtypes", (torch.bfloat16, 2), r"^dtypes: expected torch dtypes .*, got int 2"),
    ("dtypes", (), r"^dtypes: expected None \(any dtype\) or at least one torch dtype"),
])
def test_a_variant_that_claims_nothing_real_is_refused_when_declared(
        field: str, value: object, message: str) -> None:
    from kvcore.capabilities import Residency, op_support
    from kvcore.layout import Op

    args: dict[str, object] = dict(op=Op.LOAD_ALL, kinds=Kind.MHA, layouts=Layout.PAGE_FIRST,
                                   host=Residency.HOST, device=Residency.DEVICE)
    kw = {}
    if field in args:
        args[field] = value
    else:
        kw[field] = value
    with pytest.raises(InvalidArgument, match=message):
        op_support(*args.values(), **kw)  # type: ignore[arg-type]


def test_a_wrapped_host_buffer_of_the_wrong_shape_is_named_as_the_buffer() -> None:
    """Its size is read from its shape: a transposed buffer is a wrong buffer, not a wrong
    size (it said 'size: expected a multiple of page_size 64, got 2')."""
    from kvcore.layout import Geometry, host_shape

    shape = host_shape(Geometry(Kind.MHA, Layout.PAGE_FIRST, 4, 1024, 8, 64, 64))
    buffer = torch.zeros(*shape, dtype=torch.bfloat16).transpose(0, 1)
    with pytest.raises(TensorMismatch, match=r"^buffer: expected a mha page_first buffer whose "
                                             r"token axes hold whole pages of 64 \(axes \(kv, "
                                             r"page\*token, layer, head, dim\)\), got bfloat16 "
                                             r"\(1024, 2, 4, 8, 64\) on cpu: 2 tokens$"):
        HostPool.wrap(buffer, "mha", "page_first", 4, 8, 64, 64)


def test_a_variant_may_name_its_dtypes_and_what_it_does_not_serve_reads_plainly() -> None:
    """Dtype names are the dtypes (a plugin wrote "bfloat16" and every case came out "not
    claimed: dtype bfloat16 not in (bfloat16, float16)")."""
    from kvcore.capabilities import IndexSpec, Residency, op_support

    s = op_support("load_all", "mha", "page_first", "host", "device",
                   dtypes=("bfloat16", "torch.float16"))
    assert s.dtypes == {torch.bfloat16, torch.float16}
    assert s.refusal(torch.bfloat16, 256) is None
    assert s.refusal(torch.float32, 256) == "dtype float32 not in (bfloat16, float16)"
    assert op_support("load_all", "mha", "page_first", "host", "device",
                      dtypes=torch.float8_e4m3fn).dtypes == {torch.float8_e4m3fn}
    assert IndexSpec(Residency.HOST, ("int32", torch.int64)).dtypes == (torch.int32,
                                                                        torch.int64)


@pytest.mark.parametrize("dtypes", [(torch.float32,), ("int16",), (), "int8"])
def test_an_index_spec_outside_int32_int64_is_refused_with_a_typed_error(
        dtypes: object) -> None:
    from kvcore.capabilities import IndexSpec

    with pytest.raises(InvalidArgument, match=r"^dtypes: expected index dtypes torch.int64 "
                                              r"and/or torch.int32, the preferred first"):
        IndexSpec("device", dtypes)  # type: ignore[arg-type]
