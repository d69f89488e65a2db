"""page_unified (SGLang 0.5.23's host layout for an L3 tier), element by element.

One page is one C-contiguous block: MHA ``(head_group, layer, 2, page_size, head_in_group,
head_dim)``, MLA ``(layer, page_size, head_dim)``. The expected flat index of every item is
written out below from that order alone (not from kvcore.layout), and every item read back
through the canonical view must be it.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import InvalidArgument, InvalidGeometry
from kvcore.layout import (
    Geometry,
    Kind,
    Layout,
    byte_runs,
    byte_strides,
    canonical_view,
    contiguous_page_layouts,
    host_shape,
    locate,
    page_block_contiguous,
    page_contiguous,
    size_from_shape,
)
from kvcore.pools import HostPool
from kvcore.registry import allocate_host_pool

from .helpers import reference_only

L, PAGES, P, H, D = 3, 5, 4, 8, 16
UNIFIED = Layout.PAGE_UNIFIED


def _mha(groups: int, head_num: int = H, head_dim: int = D) -> Geometry:
    return Geometry(Kind.MHA, UNIFIED, L, PAGES * P, head_num, head_dim, P, groups)


def _mla() -> Geometry:
    return Geometry(Kind.MLA, UNIFIED, L, PAGES * P, 1, D, P)


def _expected_mha(groups: int) -> torch.Tensor:
    """Flat index of (kv, layer, page, token, group, head, dim), from SGLang's page order
    (page, head_group, layer, kv, token, head_in_group, dim) alone."""
    hg = H // groups
    kv, layer, page, tok, grp, head, dim = torch.meshgrid(
        torch.arange(2), torch.arange(L), torch.arange(PAGES), torch.arange(P),
        torch.arange(groups), torch.arange(hg), torch.arange(D), indexing="ij")
    return (((((page * groups + grp) * L + layer) * 2 + kv) * P + tok) * hg + head) * D + dim


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_mha_byte_order_is_sglangs(groups: int) -> None:
    g = _mha(groups)
    assert host_shape(g) == (PAGES, groups, L, 2, P, H // groups, D)
    buf = torch.arange(torch.Size(host_shape(g)).numel(), dtype=torch.int64).view(host_shape(g))
    view = canonical_view(buf, g)
    assert view.data_ptr() == buf.data_ptr()  # a view, not a copy
    assert torch.equal(view, _expected_mha(groups))
    # the scalar map agrees, item by item (absolute head = group * heads_per_group + head)
    for kv in range(2):
        for layer in range(L):
            for token in range(PAGES * P):
                for head in range(H):
                    page, tok = divmod(token, P)
                    grp, hin = divmod(head, H // groups)
                    want = (((((page * groups + grp) * L + layer) * 2 + kv) * P + tok)
                            * (H // groups) + hin) * D
                    assert int(buf[locate(g, kv, layer, token, head)][0]) == want


def test_mla_byte_order_is_sglangs() -> None:
    g = _mla()
    assert host_shape(g) == (PAGES, L, P, D)  # SGLang's MLA page_unified: no head axis
    buf = torch.arange(PAGES * L * P * D, dtype=torch.int64).view(host_shape(g))
    view = canonical_view(buf, g)
    assert view.shape == (1, L, PAGES, P, 1, 1, D)
    _, layer, page, tok, _, _, dim = torch.meshgrid(
        *(torch.arange(n) for n in view.shape), indexing="ij")
    assert torch.equal(view, ((page * L + layer) * P + tok) * D + dim)
    # the same bytes as MLA page_first_direct (S/P, L, P, 1, D)
    direct = Geometry(Kind.MLA, Layout.PAGE_FIRST_DIRECT, L, PAGES * P, 1, D, P)
    assert byte_strides(g, 2) == byte_strides(direct, 2)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_native_strides_cut_the_element_into_head_groups(groups: int) -> None:
    g, b = _mha(groups), 2
    s = byte_strides(g, b)
    hg_row = H // groups * D * b
    assert (s.num_chunks, s.chunk_bytes) == ((1, H * D * b) if groups == 1 else (groups, hg_row))
    assert s.token_stride == hg_row and s.kv_stride == P * hg_row
    assert s.layer_stride == 2 * P * hg_row
    assert s.page_stride == H * D * b * P * 2 * L  # a page is one block of K and V
    if groups > 1:
        assert s.chunk_stride == L * 2 * P * hg_row
    assert not page_contiguous(g)  # K and V interleave inside a page: no staged K/V pages
    assert page_block_contiguous(g)  # but the page of K and V together is one run
    assert page_contiguous(_mla())


def test_whole_page_staging_is_declared_for_page_unified_mha_alone() -> None:
    assert contiguous_page_layouts(Kind.MHA, whole=True) == (UNIFIED,)
    assert contiguous_page_layouts(Kind.MLA, whole=True) == ()  # its pages are runs already
    for lay in (Layout.LAYER_FIRST, Layout.PAGE_FIRST):
        g = Geometry(Kind.MHA, lay, L, PAGES * P, H, D, P)
        assert not page_block_contiguous(g)  # K pages and V pages lie apart


@pytest.mark.parametrize("whole", [True, False])
def test_a_staged_variant_binds_to_page_unified_mha_only_if_it_stages_whole_pages(
        whole: bool) -> None:
    import attrs

    from kvcore.errors import TensorMismatch
    from kvcore.native import native_ops
    from kvcore.plan import TransferPlan, TransferRequest
    from kvcore.pools import DevicePool

    staged = next(s for s in native_ops(whole_page_staged=True)
                  if s.staged and s.op.value == "write_back" and UNIFIED in s.layouts
                  and Kind.MHA in s.kinds)
    assert staged.whole_pages and staged.contiguous_pages
    support = attrs.evolve(staged, min_page_bytes=0, whole_pages=whole)
    dev = DevicePool.allocate("mha", L, 64, H, D, torch.bfloat16, "cpu", P)
    host = allocate_host_pool("mha", "page_unified", L, PAGES * P, H, D, torch.bfloat16, P,
                              "cpu", head_group_num=2)
    request = TransferRequest(op=staged.op, kind=Kind.MHA, layout=UNIFIED, dtype=torch.bfloat16,
                              element_bytes=H * D * 2, device=torch.device("cpu"))
    class Backend:  # bind builds it; nothing here runs
        def run(self, job: object) -> None:
            raise AssertionError

    plan = TransferPlan(request, "test", "0", host.memory, (support,), Backend)
    if whole:
        assert plan.bind(dev, host).support is support
    else:
        with pytest.raises(TensorMismatch, match="contiguous host pages"):
            plan.bind(dev, host)


def test_size_is_read_back_from_sglangs_shapes() -> None:
    assert size_from_shape((PAGES, 2, L, 2, P, H // 2, D), Kind.MHA, UNIFIED, P) == PAGES * P
    assert size_from_shape((PAGES, L, P, D), Kind.MLA, UNIFIED, P) == PAGES * P
    with pytest.raises(InvalidArgument, match=r"^buffer:"):
        size_from_shape((PAGES, L, P, 1, D), Kind.MLA, UNIFIED, P)
    pool = HostPool.wrap(torch.empty(PAGES, 4, L, 2, P, H // 4, D, dtype=torch.bfloat16),
                         "mha", "page_unified", L, H, D, P, head_group_num=4)
    assert (pool.geometry.size, pool.geometry.head_group_num) == (PAGES * P, 4)


# -- refusals ---------------------------------------------------------------------------------


def test_a_head_group_num_that_does_not_divide_head_num_is_refused() -> None:
    with pytest.raises(InvalidGeometry, match=r"^head_group_num: expected a divisor of "
                                              r"head_num 6 .*one of 1, 2, 3, 6.*got 4$"):
        Geometry(Kind.MHA, UNIFIED, L, PAGES * P, 6, D, P, 4)


def test_a_head_group_row_off_16_bytes_is_refused() -> None:
    g = _mha(4, head_num=4, head_dim=4)  # bf16 rows of 1 * 4 * 2 = 8 B
    with pytest.raises(InvalidGeometry, match=r"^head_group_num: .*multiple of 16 B for layout "
                                              r"page_unified; use head_group_num 1 or 2, got 4 "
                                              r"\(rows of 8 B\)$"):
        byte_strides(g, 2)
    with pytest.raises(InvalidGeometry, match=r"^head_group_num:"):
        allocate_host_pool("mha", "page_unified", L, PAGES * P, 4, 4, torch.bfloat16, P, "cpu",
                          registry=reference_only(), head_group_num=4)
    odd = _mha(1, head_num=1, head_dim=3)  # 6-byte elements: no head_group_num fits
    with pytest.raises(InvalidGeometry, match=r"no head_group_num fits"):
        byte_strides(odd, 2)
    byte_strides(_mha(2, head_num=4, head_dim=4), 2)  # 16-byte rows are fine


def test_head_groups_exist_only_where_the_layout_has_them() -> None:
    with pytest.raises(InvalidGeometry, match=r"^head_group_num: expected 1 for layout "
                                              r"page_unified mla"):
        Geometry(Kind.MLA, UNIFIED, L, PAGES * P, 1, D, P, 2)
    with pytest.raises(InvalidGeometry, match=r"^head_group_num: expected 1 for layout "
                                              r"page_first mha"):
        Geometry(Kind.MHA, Layout.PAGE_FIRST, L, PAGES * P, H, D, P, 2)


# -- byte runs for an L3 engine ---------------------------------------------------------------


def _covered(runs: list[tuple[int, int]], buf: torch.Tensor) -> torch.Tensor:
    flat = buf.view(-1).view(torch.uint8)
    return torch.cat([flat[o:o + n] for o, n in runs])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_a_page_and_a_head_group_chunk_are_one_run_each(groups: int) -> None:
    g, b = _mha(groups), 2
    page_bytes = 2 * L * P * H * D * b
    assert byte_runs(g, b, [3, 1]) == [(3 * page_bytes, page_bytes), (page_bytes, page_bytes)]
    chunk = 2 * P * (H // groups) * D * b  # one layer of one head group, K and V
    group = groups - 1
    runs = byte_runs(g, b, [2], head_group=group, layers=range(1, 3))
    assert runs == [(2 * page_bytes + (group * L + 1) * chunk, 2 * chunk)]
    # the runs hold exactly the bytes of that chunk, read through the canonical view
    buf = torch.arange(torch.Size(host_shape(g)).numel(), dtype=torch.int16).view(host_shape(g))
    want = canonical_view(buf, g)[:, 1:3, 2, :, group]
    assert torch.equal(_covered(runs, buf).view(torch.int16).sort().values,
                       want.flatten().sort().values)


def test_byte_runs_of_other_layouts_come_from_the_same_record() -> None:
    b = 2
    pf = Geometry(Kind.MHA, Layout.PAGE_FIRST, L, PAGES * P, H, D, P)
    run = L * P * H * D * b  # one page of K, all layers
    assert byte_runs(pf, b, [1]) == [(run, run), (PAGES * run + run, run)]  # K, V
    lf = Geometry(Kind.MHA, Layout.LAYER_FIRST, L, PAGES * P, H, D, P)
    assert len(byte_runs(lf, b, [0])) == 2 * L
    pool = HostPool.wrap(torch.zeros(host_shape(_mha(2)), dtype=torch.bfloat16), "mha",
                         "page_unified", L, H, D, P, head_group_num=2)
    base = pool.buffer.data_ptr()
    assert pool.byte_runs(torch.tensor([4])) == [(base + o, n)
                                                 for o, n in byte_runs(_mha(2), b, [4])]
    for bad in ({"pages": [PAGES]}, {"pages": [0], "head_group": 2},
                {"pages": [0], "layers": range(2, 5)}):
        with pytest.raises(InvalidArgument):
            pool.byte_runs(**bad)  # type: ignore[arg-type]
