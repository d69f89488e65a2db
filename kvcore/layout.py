"""KV kinds, host layouts, their shapes and index maps, and the rules of which combinations exist.

This module is the one place that knows where a host token lives. A layout is one record
(:class:`LayoutSpec`): the order of its axes, outermost first, for each kind it exists for.
Everything else is derived from that record: the buffer shape (:func:`host_shape`), the token
count read back from a shape (:func:`size_from_shape`), the canonical view
(:func:`canonical_view`), the scalar index map (:func:`locate`), the native kernels' byte
strides (:func:`byte_strides`), page contiguity (:func:`page_contiguous`,
:func:`page_block_contiguous`), the contiguous byte
runs of a page (:func:`byte_runs`) and which (kind, layout) pairs exist
(:func:`check_combination`, :func:`layouts_for`). No other module branches on a layout's name.

The axes of a host token (S = host tokens, P = page size, L = layers, H = heads, G = head
groups, D = head_dim):

=======  ===========  ==========================================================
axis     extent       meaning
=======  ===========  ==========================================================
kv       2 (MLA: 1)   K = 0, V = 1
layer    L
page     S / P        host page
token    P            slot in the page (host token h = page * P + token)
group    G            head group (``head_group_num``; 1 unless the layout has it)
head     H / G        head within its group
dim      D            item of a head
=======  ===========  ==========================================================

A record lists the buffer's dimensions, each a run of axes merged into one dimension
(``("page", "token")`` is the S axis of layer_first). An axis a record leaves out has extent 1.
Host shapes:

=================  ============================  ======================
layout             MHA                           MLA
=================  ============================  ======================
layer_first        (2, L, S, H, D)               (L, S, 1, D)
page_first         (2, S, L, H, D)               (S, L, 1, D)
page_first_direct  (2, S/P, L, P, H, D)          (S/P, L, P, 1, D)
page_head          (2, S/P, H, P, L, D)          not defined
page_unified       (S/P, G, L, 2, P, H/G, D)     (S/P, L, P, D)
=================  ============================  ======================

MLA shapes are SGLang's own host pools' shapes, so buffers interoperate: the MLA buffer is the
MHA one without the K/V axis; the older layouts keep a head axis of extent 1 there, as SGLang
does, and page_unified has none, as SGLang's page_unified pool (the bytes are the same either
way: MLA page_unified is byte for byte MLA page_first_direct). page_unified needs a head
group's token row (H/G * D * itemsize) to be a multiple of 16 bytes.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from typing import TypeVar

import attrs
import torch

from kvcore.errors import InvalidArgument, InvalidGeometry, UnsupportedCombination


class Kind(str, enum.Enum):
    """What one token of one layer holds: K and V heads (MHA) or one latent vector (MLA)."""

    MHA = "mha"
    MLA = "mla"


class Layout(str, enum.Enum):
    """How the host buffer orders tokens, layers and heads (each has a record in SPECS)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"
    PAGE_UNIFIED = "page_unified"


class Op(str, enum.Enum):
    """The transfers a backend can implement."""

    WRITE_BACK = "write_back"  # device -> host, all layers
    LOAD_LAYER = "load_layer"  # host -> device, one layer per call
    LOAD_ALL = "load_all"  # host -> device, all layers at once (prefetch)


#: the axes of the canonical view, in its order
AXES = ("kv", "layer", "page", "token", "group", "head", "dim")

#: axes every MHA record must place (group may be left out: then head_group_num is 1)
_MHA_AXES = frozenset(AXES) - {"group"}

Dims = tuple[tuple[str, ...], ...]


def _dims(spec: str) -> Dims:
    """``"kv layer page.token head dim"`` -> ((kv,), (layer,), (page, token), (head,), (dim,))."""
    return tuple(tuple(d.split(".")) for d in spec.split())


@attrs.frozen
class LayoutSpec:
    """One host layout: the order of its axes for each kind, outermost first.

    ``mha`` / ``mla``: the buffer's dimensions, each a tuple of the :data:`AXES` it merges
    (outer first); ``mla`` None when the layout does not exist for MLA, ``mla_missing`` then
    says why and what to use. ``row_alignment``: bytes a head group's token row
    (head_num / head_group_num * head_dim * itemsize) must be a multiple of.
    """

    layout: Layout
    mha: Dims
    mla: Dims | None
    mla_missing: str = ""
    row_alignment: int = 1

    def __attrs_post_init__(self) -> None:
        for kind, dims in ((Kind.MHA, self.mha), (Kind.MLA, self.mla)):
            if dims is None:
                continue
            axes = [a for d in dims for a in d]
            if len(set(axes)) != len(axes) or not set(axes) <= set(AXES):
                raise ValueError(f"{self.layout.value}/{kind.value}: axes {axes} must be "
                                 f"distinct names from {AXES}")
            if kind is Kind.MHA and not _MHA_AXES <= set(axes):
                raise ValueError(f"{self.layout.value}/mha: axes {axes} lack "
                                 f"{sorted(_MHA_AXES - set(axes))}")
            if kind is Kind.MLA and not {"layer", "page", "token", "dim"} <= set(axes):
                raise ValueError(f"{self.layout.value}/mla: axes {axes} lack a data axis")

    def dims(self, kind: Kind) -> Dims:
        """The buffer dimensions of ``kind``; UnsupportedCombination where it does not exist."""
        dims = self.mha if kind is Kind.MHA else self.mla
        if dims is None:
            raise UnsupportedCombination(
                f"layout {self.layout.value} is defined for MHA only, got kind {kind.value}"
                + (f"; {self.mla_missing}" if self.mla_missing else ""))
        return dims

    def exists_for(self, kind: Kind) -> bool:
        return (self.mha if kind is Kind.MHA else self.mla) is not None

    def has_head_groups(self, kind: Kind) -> bool:
        """True when the layout splits the heads into groups (``head_group_num`` > 1 allowed)."""
        return self.exists_for(kind) and any("group" in d for d in self.dims(kind))


#: The records. A new layout is one more entry here (and its name in :class:`Layout`).
SPECS: dict[Layout, LayoutSpec] = {s.layout: s for s in (
    LayoutSpec(Layout.LAYER_FIRST, mha=_dims("kv layer page.token head dim"),
               mla=_dims("layer page.token head dim")),
    LayoutSpec(Layout.PAGE_FIRST, mha=_dims("kv page.token layer head dim"),
               mla=_dims("page.token layer head dim")),
    LayoutSpec(Layout.PAGE_FIRST_DIRECT, mha=_dims("kv page layer token head dim"),
               mla=_dims("page layer token head dim")),
    LayoutSpec(Layout.PAGE_HEAD, mha=_dims("kv page head token layer dim"), mla=None,
               mla_missing="an MLA token has a single head, so page_head would equal "
                           "page_first_direct; use page_first_direct, which has the same bytes "
                           "for a single-head latent"),
    # SGLang 0.5.23 (mem_cache/pool_host/page_unified.py): one page is one block, cut by head
    # group, then layer, so a (head group, layer range) chunk is one run for an L3 store
    LayoutSpec(Layout.PAGE_UNIFIED, mha=_dims("page group layer kv token head dim"),
               mla=_dims("page layer token dim"), row_alignment=16),
)}


def spec(layout: Layout | str) -> LayoutSpec:
    """The record of ``layout``; InvalidArgument for a name that is not a layout."""
    lay = parse_enum(Layout, layout, "layout")
    try:
        return SPECS[lay]
    except KeyError:
        raise InvalidArgument("layout", "a layout with a record in kvcore.layout.SPECS",
                              repr(lay)) from None


E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], value: object, argument: str) -> E:
    """Return ``cls(value)`` or raise InvalidArgument listing the allowed values."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise InvalidArgument(argument, f"one of {allowed}", repr(value)) from None


def check_combination(op: Op | str, kind: Kind | str, layout: Layout | str) -> None:
    """Raise UnsupportedCombination if (op, kind, layout) does not exist (InvalidArgument for
    a name that is none of them).

    Every op exists for every layout of a kind; a layout exists for a kind when its record
    has axes for that kind (page_head has none for MLA).
    """
    op, kind = parse_enum(Op, op, "op"), parse_enum(Kind, kind, "kind")
    s = spec(layout)
    if not s.exists_for(kind):
        raise UnsupportedCombination(
            f"layout {s.layout.value} is defined for MHA only, got kind {kind.value} for "
            f"{op.value}" + (f"; {s.mla_missing}" if s.mla_missing else ""))


def layouts_for(kind: Kind | str) -> tuple[Layout, ...]:
    """The host layouts that exist for ``kind``, in declaration order."""
    kind = parse_enum(Kind, kind, "kind")
    return tuple(lay for lay in Layout if spec(lay).exists_for(kind))


def head_group_options(kind: Kind | str, layout: Layout | str, head_num: int, head_dim: int,
                       itemsize: int) -> tuple[int, ...]:
    """Every head_group_num a pool of this kind, layout and element may use."""
    kind = parse_enum(Kind, kind, "kind")
    s = spec(layout)
    counts = range(1, head_num + 1) if s.has_head_groups(kind) else (1,)
    return tuple(n for n in counts if head_num % n == 0
                 and (head_num // n * head_dim * itemsize) % s.row_alignment == 0)


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
    head_group_num: int = 1  # head groups of a layout that has them; 1 otherwise

    def __attrs_post_init__(self) -> None:
        check_combination(Op.WRITE_BACK, self.kind, self.layout)
        for name in ("num_layers", "size", "head_num", "head_dim", "page_size",
                     "head_group_num"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(name, "a positive int", repr(value))
        if self.kind is Kind.MLA and self.head_num != 1:
            raise InvalidArgument("head_num", "1 for an MLA pool", str(self.head_num))
        if self.size % self.page_size:
            raise InvalidArgument(
                "size", f"a multiple of page_size {self.page_size}", str(self.size)
            )
        s = spec(self.layout)
        if self.head_group_num != 1 and not s.has_head_groups(self.kind):
            raise InvalidGeometry(
                "head_group_num", f"1 for layout {self.layout.value} {self.kind.value} (its "
                "heads are not split into groups; set head_group_num=1)",
                str(self.head_group_num))
        if self.head_num % self.head_group_num:
            divisors = [n for n in range(1, self.head_num + 1) if self.head_num % n == 0]
            raise InvalidGeometry(
                "head_group_num", f"a divisor of head_num {self.head_num} for layout "
                f"{self.layout.value} (one of {', '.join(map(str, divisors))})",
                str(self.head_group_num))

    @property
    def num_pages(self) -> int:
        """Pages of the host pool (``size // page_size``)."""
        return self.size // self.page_size

    @property
    def kv_count(self) -> int:
        """2 for MHA (K and V), 1 for MLA."""
        return 2 if self.kind is Kind.MHA else 1

    @property
    def heads_per_group(self) -> int:
        """Heads in each of the ``head_group_num`` groups."""
        return self.head_num // self.head_group_num

    def extents(self) -> dict[str, int]:
        """The extent of every axis of :data:`AXES`."""
        return {"kv": self.kv_count, "layer": self.num_layers, "page": self.num_pages,
                "token": self.page_size, "group": self.head_group_num,
                "head": self.heads_per_group, "dim": self.head_dim}


def check_row_alignment(g: Geometry, itemsize: int) -> None:
    """Refuse (InvalidGeometry naming head_group_num) a head group whose token row is not a
    multiple of the layout's ``row_alignment`` bytes."""
    align = spec(g.layout).row_alignment
    row = g.heads_per_group * g.head_dim * itemsize
    if row % align == 0:
        return
    fits = head_group_options(g.kind, g.layout, g.head_num, g.head_dim, itemsize)
    change = (f"use head_group_num {' or '.join(map(str, fits))}" if fits else
              f"no head_group_num fits: head_num*head_dim*itemsize = "
              f"{g.head_num * g.head_dim * itemsize} B must be a multiple of {align}")
    raise InvalidGeometry(
        "head_group_num", f"a head group's token row (head_num/head_group_num*head_dim*itemsize"
        f" = {g.heads_per_group}*{g.head_dim}*{itemsize}) a multiple of {align} B for layout "
        f"{g.layout.value}; {change}", f"{g.head_group_num} (rows of {row} B)")


def host_shape(g: Geometry) -> tuple[int, ...]:
    """The host buffer shape (equal to SGLang's host pools), from the layout's record."""
    ext = g.extents()
    return tuple(_prod(ext[a] for a in d) for d in spec(g.layout).dims(g.kind))


def shape_names(kind: Kind, layout: Layout) -> str:
    """The axes of a host buffer of ``kind`` and ``layout``, as ``(page, layer, ...)``."""
    return "(" + ", ".join("*".join(d) for d in spec(layout).dims(kind)) + ")"


def size_from_shape(shape: Sequence[int], kind: Kind, layout: Layout, page_size: int) -> int:
    """The host tokens a buffer of ``shape`` holds (the inverse of :func:`host_shape`)."""
    dims = spec(layout).dims(kind)
    shape = tuple(int(x) for x in shape)
    if len(shape) != len(dims):
        raise InvalidArgument("buffer", f"a {len(dims)}-dimensional {kind.value} "
                              f"{spec(layout).layout.value} buffer {shape_names(kind, layout)}",
                              f"shape {shape}")
    (i, d), = ((i, d) for i, d in enumerate(dims) if "page" in d)
    return shape[i] if "token" in d else shape[i] * page_size


def canonical_view(buffer: torch.Tensor, g: Geometry) -> torch.Tensor:
    """View ``buffer`` as ``(kv, layer, page, token_in_page, head_group, head, dim)``, no copy.

    Writing through the view writes the buffer. ``kv`` has extent 1 for MLA, ``head_group``
    extent 1 unless the layout splits heads into groups; ``head`` is the head within its group
    (absolute head = head_group * heads_per_group + head). :func:`split_heads` and
    :func:`join_heads` convert between that and a device tensor's ``(..., head_num, head_dim)``.
    """
    expected = host_shape(g)
    if tuple(buffer.shape) != expected:
        raise InvalidArgument("host buffer", f"shape {expected}", str(tuple(buffer.shape)))
    ext = g.extents()
    placed = [a for d in spec(g.layout).dims(g.kind) for a in d]
    order = placed + [a for a in AXES if a not in placed]
    t = buffer.view(*(ext[a] for a in order))
    return t.permute(*(order.index(a) for a in AXES))


def split_heads(x: torch.Tensor, g: Geometry) -> torch.Tensor:
    """``(..., head_num, dim)`` -> ``(..., head_group, head, dim)`` as the canonical view has it."""
    return x.unflatten(-2, (g.head_group_num, g.heads_per_group))


def join_heads(x: torch.Tensor) -> torch.Tensor:
    """``(..., head_group, head, dim)`` -> ``(..., head_num, dim)`` (a device tensor's order)."""
    return x.flatten(-3, -2)


def locate(g: Geometry, kv: int, layer: int, token: int, head: int = 0) -> tuple[int, ...]:
    """The index into a host buffer of ``host_shape(g)`` where (kv, layer, token, head) lives.

    The scalar form of :func:`canonical_view`, for readers and property tests.
    """
    page, off = divmod(token, g.page_size)
    group, head_in = divmod(head, g.heads_per_group)
    at = {"kv": kv, "layer": layer, "page": page, "token": off, "group": group,
          "head": head_in}
    ext = g.extents()
    place = []
    for d in spec(g.layout).dims(g.kind):
        if d == ("dim",):
            continue
        index = 0
        for a in d:
            index = index * ext[a] + at.get(a, 0)
        place.append(index)
    return tuple(place)


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
    """Byte strides of every host layout, derived from :func:`canonical_view` (one rule).

    A token's element (all heads of one layer of K or V) is cut into chunks that are each one
    run of bytes on the host: the whole element where it is one run, else one chunk per head
    group where a group's heads are one run, else one chunk per head (a single group).
    Refuses (InvalidGeometry) a head group row the layout's row_alignment rules out.
    """
    check_row_alignment(g, itemsize)
    probe = torch.empty(host_shape(g), dtype=torch.uint8, device="meta")
    kv_s, layer_s, page_s, tok_s, group_s, head_s, dim_s = canonical_view(probe, g).stride()
    assert dim_s == 1
    hg, D, G = g.heads_per_group, g.head_dim, g.head_group_num
    row_run = hg == 1 or head_s == D  # one group's heads are one run
    if row_run and (G == 1 or group_s == hg * D):  # the whole element is one run
        chunk_elems, num_chunks, chunk_s = g.head_num * D, 1, g.head_num * D
    elif row_run:  # one chunk per head group
        chunk_elems, num_chunks, chunk_s = hg * D, G, group_s
    elif G == 1:  # one chunk per head
        chunk_elems, num_chunks, chunk_s = D, g.head_num, head_s
    else:
        raise UnsupportedCombination(
            f"layout {g.layout.value}: heads split both into groups and within a group are "
            "not expressible as chunks of one stride (docs/native-abi.md)")
    return ByteStrides(
        kv_stride=kv_s * itemsize,
        layer_stride=layer_s * itemsize,
        page_stride=page_s * itemsize,
        token_stride=tok_s * itemsize,
        chunk_stride=chunk_s * itemsize,
        page_size=g.page_size,
        chunk_bytes=chunk_elems * itemsize,
        num_chunks=num_chunks,
    )


def page_contiguous(g: Geometry) -> bool:
    """True when all layers of one page of K (or V) are one contiguous run of bytes."""
    s = byte_strides(g, 16)  # any itemsize the row alignment allows: contiguity is relative
    run = g.num_layers * g.page_size * g.head_num * g.head_dim * 16
    spans = (s.layer_stride * (g.num_layers - 1) + s.token_stride * (g.page_size - 1)
             + s.chunk_stride * (s.num_chunks - 1) + s.chunk_bytes)
    return spans == run and s.page_stride == run


def page_block_contiguous(g: Geometry) -> bool:
    """True when one page's K and V over all layers together are one contiguous run of bytes
    (page_unified MHA: K and V alternate inside a page, so neither alone is one run). MLA has
    no V: the same as :func:`page_contiguous`."""
    s = byte_strides(g, 16)
    run = g.kv_count * g.num_layers * g.page_size * g.head_num * g.head_dim * 16
    spans = (s.kv_stride * (g.kv_count - 1) + s.layer_stride * (g.num_layers - 1)
             + s.token_stride * (g.page_size - 1) + s.chunk_stride * (s.num_chunks - 1)
             + s.chunk_bytes)
    return spans == run and s.page_stride == run


def contiguous_page_layouts(kind: Kind, whole: bool = False) -> tuple[Layout, ...]:
    """The layouts of ``kind`` whose every page of K (or V) is one contiguous run, for any
    sizes (decided from the strides of a geometry whose every axis has extent 2); with
    ``whole``, those whose page of K and V together is one run (:func:`page_block_contiguous`)
    and that are not in the first set."""
    out = []
    for lay in layouts_for(kind):
        heads = 4 if kind is Kind.MHA else 1
        groups = 2 if spec(lay).has_head_groups(kind) and heads > 1 else 1
        probes = {Geometry(kind, lay, 2, 4, heads, 2, 2, groups),
                  Geometry(kind, lay, 2, 4, heads, 2, 2, 1)}
        per_kv = all(page_contiguous(p) for p in probes)
        if (not whole and per_kv) or (
                whole and not per_kv and all(page_block_contiguous(p) for p in probes)):
            out.append(lay)
    return tuple(out)


def byte_runs(g: Geometry, itemsize: int, pages: Iterable[int], head_group: int | None = None,
              layers: range | None = None) -> list[tuple[int, int]]:
    """The contiguous byte runs ``(offset, length)`` holding the given host pages.

    For each page in the order given: the runs (ascending, adjacent ones merged) of its bytes,
    K and V, every layer and head; or only those of one ``head_group`` and/or a ``layers``
    range. This is what an L3 store (NIXL, Mooncake) registers and moves; a layout whose
    (head group, layer range) chunk of a page is one run gives one run per page.
    """
    layers = range(g.num_layers) if layers is None else layers
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= g.num_layers:
        raise InvalidArgument("layers", f"a non-empty range within [0, {g.num_layers})",
                              str(layers))
    groups = range(g.head_group_num) if head_group is None else range(head_group,
                                                                      head_group + 1)
    if not 0 <= groups.start < groups.stop <= g.head_group_num:
        raise InvalidArgument("head_group", f"a head group in [0, {g.head_group_num})",
                              str(head_group))
    probe = torch.empty(host_shape(g), dtype=torch.uint8, device="meta")
    view = canonical_view(probe, g)
    runs: list[tuple[int, int]] = []
    for page in pages:
        if not 0 <= int(page) < g.num_pages:
            raise InvalidArgument("pages", f"pages in [0, {g.num_pages})", str(int(page)))
        part = view[:, layers.start:layers.stop, int(page), :, groups.start:groups.stop]
        runs += _runs(part, itemsize)
    return runs


def _runs(part: torch.Tensor, itemsize: int) -> list[tuple[int, int]]:
    """The byte runs of a strided (meta) view over a buffer of ``itemsize`` items."""
    dims = sorted((st, n) for st, n in zip(part.stride(), part.shape, strict=True) if n > 1)
    run = 1  # items of the innermost run: dims that tile it exactly merge into it
    while dims and dims[0][0] == run:
        run *= dims.pop(0)[1]
    base = int(part.storage_offset())
    offsets = sorted(base + sum(i * st for i, (st, _) in zip(idx, dims, strict=True))
                     for idx in itertools.product(*(range(n) for _, n in dims)))
    merged: list[tuple[int, int]] = []
    for off in offsets:
        if merged and merged[-1][0] + merged[-1][1] == off * itemsize:
            merged[-1] = (merged[-1][0], merged[-1][1] + run * itemsize)
        else:
            merged.append((off * itemsize, run * itemsize))
    return merged


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out
