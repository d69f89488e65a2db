"""KV kinds, host layouts, their shapes and index maps, and the rules of which combinations exist.

This module is the one place that knows where a host token lives. Everything else (the
reference backend, the kernels' byte strides, validation) derives from
:func:`canonical_view`, which presents any host buffer as a strided view of shape
``(kv, layers, pages, page_size, heads, head_dim)`` over the same memory.

Host shapes (S = host tokens, P = page size, L = layers, H = heads, D = head_dim):

=================  =========================  =======================
layout             MHA                        MLA
=================  =========================  =======================
layer_first        (2, L, S, H, D)            (L, S, 1, D)
page_first         (2, S, L, H, D)            (S, L, 1, D)
page_first_direct  (2, S/P, L, P, H, D)       (S/P, L, P, 1, D)
page_head          (2, S/P, H, P, L, D)       not defined
=================  =========================  =======================
"""

from __future__ import annotations

import enum

import attrs
import torch

from kvcore.errors import InvalidArgument, UnsupportedCombination


class Kind(str, enum.Enum):
    """What one token of one layer holds: K and V heads (MHA) or one latent vector (MLA)."""

    MHA = "mha"
    MLA = "mla"


class Layout(str, enum.Enum):
    """How the host buffer orders tokens, layers and heads."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"


class Op(str, enum.Enum):
    """The transfers a backend can implement."""

    WRITE_BACK = "write_back"  # device -> host, all layers
    LOAD_LAYER = "load_layer"  # host -> device, one layer per call
    LOAD_ALL = "load_all"  # host -> device, all layers at once (prefetch)


def parse_enum(cls: type[enum.Enum], value: object, argument: str) -> enum.Enum:
    """Return ``cls(value)`` or raise InvalidArgument listing the allowed values."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise InvalidArgument(argument, f"one of {allowed}", repr(value)) from None


def check_combination(op: Op, kind: Kind, layout: Layout) -> None:
    """Raise UnsupportedCombination if (op, kind, layout) does not exist.

    Every op exists for every layout of a kind; page_head is defined for MHA only, because an
    MLA token has a single head and page_head would equal page_first_direct.
    """
    if kind is Kind.MLA and layout is Layout.PAGE_HEAD:
        raise UnsupportedCombination(
            f"layout page_head is defined for MHA only, got kind mla for {op.value}; "
            "use page_first_direct, which has the same bytes for a single-head latent"
        )


def layouts_for(kind: Kind) -> tuple[Layout, ...]:
    """The host layouts that exist for ``kind``, in declaration order."""
    return tuple(lay for lay in Layout if not (kind is Kind.MLA and lay is Layout.PAGE_HEAD))


@attrs.frozen
class Geometry:
    """The sizes that fix a host buffer's shape."""

    kind: Kind
    layout: Layout
    num_layers: int
    size: int  # host tokens
    head_num: int
    head_dim: int
    page_size: int

    def __attrs_post_init__(self) -> None:
        check_combination(Op.WRITE_BACK, self.kind, self.layout)
        for name in ("num_layers", "size", "head_num", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(name, "a positive int", repr(value))
        if self.kind is Kind.MLA and self.head_num != 1:
            raise InvalidArgument("head_num", "1 for an MLA pool", str(self.head_num))
        if self.size % self.page_size:
            raise InvalidArgument(
                "size", f"a multiple of page_size {self.page_size}", str(self.size)
            )

    @property
    def num_pages(self) -> int:
        return self.size // self.page_size

    @property
    def kv_count(self) -> int:
        """2 for MHA (K and V), 1 for MLA."""
        return 2 if self.kind is Kind.MHA else 1


def host_shape(g: Geometry) -> tuple[int, ...]:
    """The host buffer shape of DESIGN.md section 3 (equal to SGLang's host pools)."""
    L, S, H, D, P = g.num_layers, g.size, g.head_num, g.head_dim, g.page_size
    shapes = {
        Layout.LAYER_FIRST: (L, S, H, D),
        Layout.PAGE_FIRST: (S, L, H, D),
        Layout.PAGE_FIRST_DIRECT: (S // P, L, P, H, D),
        Layout.PAGE_HEAD: (S // P, H, P, L, D),
    }
    shape = shapes[g.layout]
    return (2, *shape) if g.kind is Kind.MHA else shape


def canonical_view(buffer: torch.Tensor, g: Geometry) -> torch.Tensor:
    """View ``buffer`` as ``(kv, layer, page, token_in_page, head, dim)`` without copying.

    Writing through the view writes the buffer. ``kv`` has extent 1 for MLA.
    """
    expected = host_shape(g)
    if tuple(buffer.shape) != expected:
        raise InvalidArgument("host buffer", f"shape {expected}", str(tuple(buffer.shape)))
    t = buffer if g.kind is Kind.MHA else buffer.unsqueeze(0)
    kv, L, S, H, D, P = g.kv_count, g.num_layers, g.size, g.head_num, g.head_dim, g.page_size
    if g.layout is Layout.LAYER_FIRST:
        return t.view(kv, L, S // P, P, H, D)
    if g.layout is Layout.PAGE_FIRST:
        return t.view(kv, S // P, P, L, H, D).permute(0, 3, 1, 2, 4, 5)
    if g.layout is Layout.PAGE_FIRST_DIRECT:
        return t.permute(0, 2, 1, 3, 4, 5)
    return t.permute(0, 4, 1, 3, 2, 5)  # PAGE_HEAD: (kv, pages, H, P, L, D)


def locate(g: Geometry, kv: int, layer: int, token: int, head: int = 0) -> tuple[int, ...]:
    """The index into a host buffer of ``host_shape(g)`` where (kv, layer, token, head) lives.

    The scalar form of :func:`canonical_view`, for readers and property tests.
    """
    page, off = divmod(token, g.page_size)
    places = {
        Layout.LAYER_FIRST: (layer, token, head),
        Layout.PAGE_FIRST: (token, layer, head),
        Layout.PAGE_FIRST_DIRECT: (page, layer, off, head),
        Layout.PAGE_HEAD: (page, head, off, layer),
    }
    place = places[g.layout]
    return (kv, *place) if g.kind is Kind.MHA else place


@attrs.frozen(cache_hash=True)
class ByteStrides:
    """Byte geometry of a host buffer, as native kernels consume it (docs/native-abi.md)."""

    kv_stride: int
    layer_stride: int
    page_stride: int
    token_stride: int
    chunk_stride: int
    page_size: int
    chunk_bytes: int
    num_chunks: int

    @property
    def element_bytes(self) -> int:
        return self.chunk_bytes * self.num_chunks


def byte_strides(g: Geometry, itemsize: int) -> ByteStrides:
    """Byte strides of every host layout, derived from :func:`canonical_view` (one rule)."""
    probe = torch.empty(host_shape(g), dtype=torch.uint8, device="meta")
    kv_s, layer_s, page_s, tok_s, head_s, dim_s = canonical_view(probe, g).stride()
    assert dim_s == 1
    whole = head_s == g.head_dim or g.head_num == 1
    return ByteStrides(
        kv_stride=kv_s * itemsize,
        layer_stride=layer_s * itemsize,
        page_stride=page_s * itemsize,
        token_stride=tok_s * itemsize,
        chunk_stride=(head_s if not whole else g.head_num * g.head_dim) * itemsize,
        page_size=g.page_size,
        chunk_bytes=(g.head_num * g.head_dim if whole else g.head_dim) * itemsize,
        num_chunks=1 if whole else g.head_num,
    )


def page_contiguous(g: Geometry) -> bool:
    """True when all layers of one page of K (or V) are one contiguous run of bytes."""
    s = byte_strides(g, 1)
    run = g.num_layers * g.page_size * g.head_num * g.head_dim
    spans = (s.layer_stride * (g.num_layers - 1) + s.token_stride * (g.page_size - 1)
             + s.chunk_stride * (s.num_chunks - 1) + s.chunk_bytes)
    return spans == run and s.page_stride == run
