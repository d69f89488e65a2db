"""Host shapes (DESIGN.md section 3) and the index maps locate / canonical_view / byte_strides."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcore.errors import InvalidArgument, UnsupportedCombination
from kvcore.layout import (
    Geometry,
    Kind,
    Layout,
    Op,
    byte_strides,
    canonical_view,
    check_combination,
    host_shape,
    layouts_for,
    locate,
    page_contiguous,
    spec,
)

from .helpers import KIND_LAYOUTS

L, S, H, D, P = 3, 24, 5, 7, 4

#: DESIGN.md section 3, written out literally.
DESIGN_SHAPES = {
    (Kind.MHA, Layout.LAYER_FIRST): (2, L, S, H, D),
    (Kind.MHA, Layout.PAGE_FIRST): (2, S, L, H, D),
    (Kind.MHA, Layout.PAGE_FIRST_DIRECT): (2, S // P, L, P, H, D),
    (Kind.MHA, Layout.PAGE_HEAD): (2, S // P, H, P, L, D),
    (Kind.MLA, Layout.LAYER_FIRST): (L, S, 1, D),
    (Kind.MLA, Layout.PAGE_FIRST): (S, L, 1, D),
    (Kind.MLA, Layout.PAGE_FIRST_DIRECT): (S // P, L, P, 1, D),
    (Kind.MHA, Layout.PAGE_UNIFIED): (S // P, 1, L, 2, P, H, D),  # head_group_num 1
    (Kind.MLA, Layout.PAGE_UNIFIED): (S // P, L, P, D),
}

#: DESIGN.md section 3, "h lives at", as functions of (kv, layer, token, head).
DESIGN_PLACES = {
    Layout.LAYER_FIRST: lambda kv, ly, h, hd: (kv, ly, h, hd),
    Layout.PAGE_FIRST: lambda kv, ly, h, hd: (kv, h, ly, hd),
    Layout.PAGE_FIRST_DIRECT: lambda kv, ly, h, hd: (kv, h // P, ly, h % P, hd),
    Layout.PAGE_HEAD: lambda kv, ly, h, hd: (kv, h // P, hd, h % P, ly),
    Layout.PAGE_UNIFIED: lambda kv, ly, h, hd: (h // P, 0, ly, kv, h % P, hd),
}

#: where an MLA place is not the MHA place without its kv index
MLA_PLACES = {Layout.PAGE_UNIFIED: lambda ly, h: (h // P, ly, h % P)}


def _geometry(kind: Kind, layout: Layout) -> Geometry:
    return Geometry(kind, layout, L, S, H if kind is Kind.MHA else 1, D, P)


@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_host_shape_is_the_design_table(kind: Kind, layout: Layout) -> None:
    assert host_shape(_geometry(kind, layout)) == DESIGN_SHAPES[(kind, layout)]


def test_kind_layout_pairs_are_exactly_the_design_table() -> None:
    assert set(KIND_LAYOUTS) == set(DESIGN_SHAPES)
    assert Layout.PAGE_HEAD not in layouts_for(Kind.MLA)


@pytest.mark.parametrize("op", list(Op))
def test_mla_page_head_does_not_exist(op: Op) -> None:
    with pytest.raises(UnsupportedCombination, match=r"page_head"):
        check_combination(op, Kind.MLA, Layout.PAGE_HEAD)
    with pytest.raises(UnsupportedCombination, match=r"page_head"):
        Geometry(Kind.MLA, Layout.PAGE_HEAD, L, S, 1, D, P)


@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_locate_is_the_design_place(kind: Kind, layout: Layout) -> None:
    g = _geometry(kind, layout)
    heads = g.head_num
    for kv in range(g.kv_count):
        for layer in range(L):
            for token in (0, 1, P - 1, P, S - 1):
                for head in {0, heads - 1}:
                    want = DESIGN_PLACES[layout](kv, layer, token, head)
                    if kind is Kind.MLA and layout in MLA_PLACES:
                        want = MLA_PLACES[layout](layer, token)
                    elif kind is Kind.MLA:  # no kv axis; the single head keeps its axis
                        want = want[1:]
                    assert locate(g, kv, layer, token, head) == want


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("size", -4), ("head_num", 0), ("head_dim", 0), ("page_size", 0),
     ("size", 10)])
def test_bad_geometry_names_the_field(field: str, value: int) -> None:
    sizes = dict(num_layers=L, size=S, head_num=H, head_dim=D, page_size=P)
    sizes[field] = value
    with pytest.raises(InvalidArgument, match=rf"^{field}:"):
        Geometry(Kind.MHA, Layout.PAGE_FIRST, **sizes)


def test_mla_geometry_needs_one_head() -> None:
    with pytest.raises(InvalidArgument, match=r"^head_num:"):
        Geometry(Kind.MLA, Layout.PAGE_FIRST, L, S, 2, D, P)


def test_canonical_view_refuses_a_wrong_shape() -> None:
    g = _geometry(Kind.MHA, Layout.PAGE_FIRST)
    with pytest.raises(InvalidArgument, match=r"host buffer"):
        canonical_view(torch.empty(2, L, S, H, D), g)


#: layouts whose pages (per K/V) are NOT one run: layer_first (layers outside pages)
SPLIT_PAGES = {(Kind.MHA, Layout.LAYER_FIRST), (Kind.MLA, Layout.LAYER_FIRST),
               (Kind.MHA, Layout.PAGE_UNIFIED)}  # K and V interleave inside the page


@pytest.mark.parametrize(("kind", "layout"), KIND_LAYOUTS)
def test_page_contiguous_matches_the_layout(kind: Kind, layout: Layout) -> None:
    g = _geometry(kind, layout)
    assert page_contiguous(g) == ((kind, layout) not in SPLIT_PAGES)
    one_layer = Geometry(kind, layout, 1, S, g.head_num, D, P)
    assert page_contiguous(one_layer) == (layout is Layout.LAYER_FIRST
                                          or (kind, layout) not in SPLIT_PAGES)


# -- property tests --------------------------------------------------------------------------


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    kind, layout = draw(st.sampled_from(KIND_LAYOUTS))
    page_size = draw(st.integers(1, 6))
    heads = 1 if kind is Kind.MLA else draw(st.integers(1, 4))
    groups = 1
    if spec(layout).has_head_groups(kind):
        groups = draw(st.sampled_from([n for n in range(1, heads + 1) if heads % n == 0]))
    return Geometry(kind, layout, num_layers=draw(st.integers(1, 4)),
                    size=page_size * draw(st.integers(1, 5)), head_num=heads,
                    head_dim=draw(st.integers(1, 9)), page_size=page_size,
                    head_group_num=groups)


def _at(view: torch.Tensor, g: Geometry, kv: int, layer: int, token: int,
        head: int) -> torch.Tensor:
    """The canonical view's head_dim items of (kv, layer, token, head)."""
    page, off = divmod(token, g.page_size)
    group, head_in = divmod(head, g.heads_per_group)
    return view[kv, layer, page, off, group, head_in]


@st.composite
def geometry_and_place(draw: st.DrawFn) -> tuple[Geometry, int, int, int, int]:
    g = draw(geometries())
    return (g, draw(st.integers(0, g.kv_count - 1)), draw(st.integers(0, g.num_layers - 1)),
            draw(st.integers(0, g.size - 1)), draw(st.integers(0, g.head_num - 1)))


def _numbered(g: Geometry, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    shape = host_shape(g)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.int64).to(dtype).view(shape)


@settings(max_examples=150, deadline=None)
@given(geometry_and_place())
def test_locate_agrees_with_canonical_view(case: tuple) -> None:
    g, kv, layer, token, head = case
    buf = _numbered(g)
    at = buf[locate(g, kv, layer, token, head)]
    via_view = _at(canonical_view(buf, g), g, kv, layer, token, head)
    assert at.shape == (g.head_dim,)
    assert at.data_ptr() == via_view.data_ptr()
    assert torch.equal(at, via_view)


@settings(max_examples=150, deadline=None)
@given(geometry_and_place(), st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]))
def test_byte_strides_address_the_located_element(case: tuple, dtype: torch.dtype) -> None:
    g, kv, layer, token, head = case
    itemsize = dtype.itemsize
    assume(g.heads_per_group * g.head_dim * itemsize % spec(g.layout).row_alignment == 0)
    buf = torch.empty(host_shape(g), dtype=dtype)
    s = byte_strides(g, itemsize)
    page, off = divmod(token, g.page_size)
    chunk, in_chunk = divmod(head * g.head_dim * itemsize, s.chunk_bytes)
    head_offset = chunk * s.chunk_stride + in_chunk  # a chunk: all heads, a group or a head
    offset = (kv * s.kv_stride + layer * s.layer_stride + page * s.page_stride
              + off * s.token_stride + head_offset)
    element = buf[locate(g, kv, layer, token, head)]
    assert element.data_ptr() - buf.data_ptr() == offset
    assert s.element_bytes == g.head_num * g.head_dim * itemsize
    assert s.page_size == g.page_size
    assert element.stride() == (1,)  # the head's D values are one run inside its chunk


@settings(max_examples=100, deadline=None)
@given(geometries())
def test_canonical_view_is_a_bijection_onto_the_buffer(g: Geometry) -> None:
    buf = _numbered(g)
    view = canonical_view(buf, g)
    assert view.shape == (g.kv_count, g.num_layers, g.num_pages, g.page_size,
                          g.head_group_num, g.heads_per_group, g.head_dim)
    assert view.data_ptr() == buf.data_ptr()
    assert torch.equal(view.flatten().sort().values, buf.flatten())


@settings(max_examples=100, deadline=None)
@given(geometries())
def test_page_contiguous_agrees_with_the_addresses(g: Geometry) -> None:
    # with a single page the page stride is unobservable; page_contiguous answers for the
    # layout's general case (a conservative False for a one-page layer_first pool)
    assume(g.num_pages >= 2)
    view = canonical_view(_numbered(g), g)
    run = g.num_layers * g.page_size * g.head_num * g.head_dim
    contiguous = True
    for kv in range(g.kv_count):
        base = int(view[kv].min())
        for page in range(g.num_pages):
            values = view[kv, :, page].flatten().sort().values
            want = torch.arange(base + page * run, base + (page + 1) * run)
            contiguous &= torch.equal(values, want)
    assert page_contiguous(g) == contiguous


@settings(max_examples=30, deadline=None)
@given(geometries())
def test_writing_through_the_view_writes_the_located_bytes(g: Geometry) -> None:
    buf = torch.zeros(host_shape(g), dtype=torch.int32)
    view = canonical_view(buf, g)
    view.copy_(torch.arange(view.numel(), dtype=torch.int32).view(view.shape) + 1)
    for kv in range(g.kv_count):
        for layer in range(g.num_layers):
            for token in range(g.size):
                for head in range(g.head_num):
                    assert torch.equal(buf[locate(g, kv, layer, token, head)],
                                       _at(view, g, kv, layer, token, head))


def test_the_layout_helpers_take_names_and_refuse_what_is_none() -> None:
    """layouts.md: a name that is not a layout (or kind, or op) is an InvalidArgument
    everywhere; a name that is one answers as its member does."""
    from kvcore.errors import InvalidArgument, UnsupportedCombination
    from kvcore.layout import Kind, Layout, check_combination, head_group_options, layouts_for

    assert layouts_for("mha") == layouts_for(Kind.MHA) and Layout.PAGE_HEAD in layouts_for("mha")
    assert head_group_options("mha", "page_unified", 8, 128, 2) == \
        head_group_options(Kind.MHA, Layout.PAGE_UNIFIED, 8, 128, 2) == (1, 2, 4, 8)
    with pytest.raises(UnsupportedCombination, match="page_head is defined for MHA only"):
        check_combination("write_back", "mla", "page_head")
    for call, argument in ((lambda: layouts_for("bogus"), "kind"),
                           (lambda: check_combination("write_back", "mlx", "page_first"), "kind"),
                           (lambda: check_combination("write-back", "mla", "page_first"), "op"),
                           (lambda: head_group_options("mha", "page-head", 8, 128, 2), "layout")):
        with pytest.raises(InvalidArgument, match=rf"^{argument}: expected one of "):
            call()
