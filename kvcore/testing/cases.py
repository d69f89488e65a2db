"""The conformance cases: what one case moves, and which cases a backend's claims call for.

A :class:`Case` is plain data (op, kind, layout, sizes, dtypes, index order, seed), so a
failure can print everything needed to reproduce it. :func:`generate` turns a backend's
static :class:`~kvcore.capabilities.Capabilities` and a :class:`Profile` into the cases of one
family; a case the backend does not claim is still generated and carries ``unclaimed``, the
reason it is skipped, so reports show what was not claimed instead of silently dropping it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import attrs
import torch

from kvcore.capabilities import Capabilities, OpSupport
from kvcore.layout import Kind, Layout, Op, head_group_options, layouts_for
from kvcore.plan import dtype_name

#: element sizes (bytes of one token of one layer of K or V) the suite sweeps; 72 B is run
#: only where a variant's element_alignment claims it
ELEMENT_BYTES = (144, 512, 1152, 4096)
ODD_ELEMENT_BYTES = (72,)

#: (heads, head_dim) of an MHA element of 2-byte items, by element bytes; MLA uses (1, bytes/2)
_MHA_HEADS = {72: (1, 36), 144: (3, 24), 512: (4, 64), 1152: (9, 64), 4096: (16, 128)}

#: default element bytes per kind (1152 B = MLA 576 x bf16)
DEFAULT_ELEMENT = {Kind.MHA: 512, Kind.MLA: 1152}

#: the bad inputs every row must refuse, and the op they apply to (None: every op)
BAD_INPUTS: dict[str, Op | None] = {
    "host_out_of_range": None,
    "device_out_of_range": None,
    "misaligned_page": None,
    "length_mismatch": None,
    "duplicate_destination": None,
    "float_indices": None,
    "two_dim_indices": None,
    "layer_out_of_range": Op.LOAD_LAYER,
    "controller_host_full": Op.WRITE_BACK,
    "controller_bad_device_index": Op.WRITE_BACK,
}

#: host page orders: ascending pages 1..n, reversed n..1, or a random subset in random order
ORDERS = ("ascending", "reversed", "scattered")


@attrs.frozen
class Profile:
    """How big the cases are. ``full`` is for accelerators, ``quick`` for CPU runs in CI."""

    name: str
    page_size: int
    page_counts: tuple[int, ...]
    num_layers: int
    dtype_pages: int  # pages of the dtype/index/order family
    element_pages: int  # pages of the element-size family
    max_examples: int  # hypothesis examples per row
    max_host_bytes: int  # cap on a case's host buffer (staging-edge counts beyond are dropped)


QUICK = Profile("quick", page_size=4, page_counts=(1, 3, 4, 5), num_layers=2, dtype_pages=3,
                element_pages=2, max_examples=6, max_host_bytes=8 << 20)
FULL = Profile("full", page_size=64, page_counts=(1, 63, 64, 65, 67, 128, 129), num_layers=4,
               dtype_pages=7, element_pages=5, max_examples=25, max_host_bytes=1 << 30)
PROFILES = {p.name: p for p in (QUICK, FULL)}


@attrs.frozen
class Case:
    """One transfer (or one refusal) the suite checks. Everything needed to reproduce it."""

    family: str
    op: Op
    kind: Kind
    layout: Layout
    variant: str  # the variant the geometry selects, "-" when the row is not claimed
    dtype: torch.dtype
    page_size: int
    n_pages: int
    num_layers: int
    head_num: int
    head_dim: int
    host_index_dtype: torch.dtype = torch.int64
    device_index_dtype: torch.dtype = torch.int64
    order: str = "scattered"
    swapped: bool = False  # pass host indices on the device and device indices on the cpu
    bad: str | None = None  # the bad input of the bad_input family
    then: Op | None = None  # the load of a round trip
    unclaimed: str | None = None  # why the backend does not claim this case
    head_group_num: int = 1  # head groups of the host pool (layouts that split heads)
    #: the test id of the case a randomised example was drawn from (what ``-k`` selects)
    drawn_from: str | None = attrs.field(default=None, eq=False)

    @property
    def element_bytes(self) -> int:
        return self.head_num * self.head_dim * self.dtype.itemsize

    @property
    def row(self) -> str:
        """The report row: op kind layout variant."""
        op = "round_trip" if self.then is not None else self.op.value
        return f"{op} {self.kind.value} {self.layout.value} {self.variant}"

    @property
    def id(self) -> str:
        parts = [self.op.value if self.then is None else f"round_trip_{self.then.value}",
                 self.kind.value, self.layout.value, self.variant, self.family]
        if self.bad:
            parts.append(self.bad)
        else:
            parts += [f"p{self.n_pages}", f"e{self.element_bytes}", f"L{self.num_layers}",
                      *([f"g{self.head_group_num}"] if self.head_group_num > 1 else []),
                      dtype_name(self.dtype), f"h{dtype_name(self.host_index_dtype)[3:]}",
                      f"d{dtype_name(self.device_index_dtype)[3:]}", self.order]
            if self.swapped:
                parts.append("swapped")
        return "-".join(parts)

    @property
    def seed(self) -> int:
        """A stable seed derived from the case id (so a reproduction needs only the id)."""
        return zlib.crc32(self.id.encode())

    def describe(self) -> str:
        """The case's facts on one line, for reproductions."""
        return (f"op={self.op.value}" + (f" then={self.then.value}" if self.then else "")
                + f" kind={self.kind.value} layout={self.layout.value} variant={self.variant}"
                f" dtype={dtype_name(self.dtype)} page_size={self.page_size}"
                f" n_pages={self.n_pages} num_layers={self.num_layers} heads={self.head_num}"
                f" head_dim={self.head_dim} head_group_num={self.head_group_num}"
                f" element_bytes={self.element_bytes}"
                f" host_index={dtype_name(self.host_index_dtype)}"
                f" device_index={dtype_name(self.device_index_dtype)} order={self.order}"
                f" swapped={self.swapped} seed={self.seed}")


def heads_for(kind: Kind, element_bytes: int, itemsize: int = 2) -> tuple[int, int]:
    """(head_num, head_dim) giving ``element_bytes`` with items of ``itemsize`` bytes."""
    if kind is Kind.MLA:
        return 1, element_bytes // itemsize
    heads, dim = _MHA_HEADS[element_bytes]
    return heads, dim * 2 // itemsize


def page_bytes(op: Op, page_size: int, element_bytes: int, num_layers: int) -> int:
    """Bytes of one page of K (or V) over the layers ``op`` moves (as the plan computes it)."""
    return page_size * element_bytes * (1 if op is Op.LOAD_LAYER else num_layers)


def fitting(caps: Capabilities, op: Op, kind: Kind, layout: Layout, dtype: torch.dtype,
            element_bytes: int) -> tuple[tuple[OpSupport, ...], str | None]:
    """The variants that serve the request, or () and why none does ("not claimed: ...")."""
    covering = caps.variants(op, kind, layout)
    if not covering:
        return (), (f"not claimed: {caps.name} declares no {op.value} for "
                    f"{kind.value}/{layout.value}")
    fits = tuple(v for v in covering if v.refusal(dtype, element_bytes) is None)
    if not fits:
        return (), f"not claimed: {covering[0].refusal(dtype, element_bytes)}"
    return fits, None


def selected(variants: tuple[OpSupport, ...], pb: int) -> OpSupport | None:
    """The variant a plan selects for pages of ``pb`` bytes (first declared that fits)."""
    return next((v for v in variants if v.fits_page(pb)), None)


def layers_for(variants: tuple[OpSupport, ...], target: OpSupport, op: Op, page_size: int,
               element_bytes: int, preferred: int) -> int | None:
    """A layer count whose page bytes make the plan select ``target`` (None: unreachable)."""
    for layers in (preferred, 1, 2, 4, 8, 16, 32, 64):
        if selected(variants, page_bytes(op, page_size, element_bytes, layers)) is target:
            return layers
    return None


def rows(caps: Capabilities) -> Iterator[tuple[Op, Kind, Layout]]:
    """Every (op, kind, layout) that exists, claimed or not."""
    for op in Op:
        for kind in Kind:
            for layout in layouts_for(kind):
                yield op, kind, layout


def _variant_cases(caps: Capabilities, profile: Profile, op: Op, kind: Kind, layout: Layout,
                   dtype: torch.dtype, element_bytes: int,
                   layers_pref: int) -> Iterator[tuple[str, int, str | None]]:
    """(variant name, num_layers, unclaimed) for each variant this geometry can reach."""
    variants, why = fitting(caps, op, kind, layout, dtype, element_bytes)
    if why is not None:
        yield "-", layers_pref, why
        return
    for v in variants:
        layers = layers_for(variants, v, op, profile.page_size, element_bytes, layers_pref)
        if layers is not None:
            yield v.variant, layers, None


def _host_bytes(case: Case) -> int:
    kv = 2 if case.kind is Kind.MHA else 1
    return kv * case.num_layers * case.n_pages * case.page_size * case.element_bytes


def generate(family: str, caps: Capabilities, profile: Profile) -> list[Case]:
    """The cases of ``family`` for a backend declaring ``caps``, sized by ``profile``."""
    makers = {"pages": _pages, "elements": _elements, "dtypes": _dtypes,
              "bad_input": _bad_inputs, "round_trip": _round_trips, "random": _random_rows}
    return [c for case in makers[family](caps, profile) for c in _with_head_groups(case)]


#: the most head groups a case is split into (where its layout splits heads)
MAX_HEAD_GROUPS = 4


def _with_head_groups(case: Case) -> Iterator[Case]:
    """``case``, and where its layout splits heads into groups, the same case with the most
    head groups (up to MAX_HEAD_GROUPS) its element allows: one chunk per group then."""
    options = head_group_options(case.kind, case.layout, case.head_num, case.head_dim,
                                 case.dtype.itemsize)
    if 1 not in options:  # the layout refuses this element (its row alignment)
        yield attrs.evolve(case, unclaimed=case.unclaimed or (
            f"not applicable: {case.layout.value} refuses elements of {case.element_bytes} B "
            f"(see kvcore.layout.check_row_alignment)"))
        return
    yield case
    grouped = [n for n in options if 1 < n <= MAX_HEAD_GROUPS]
    if grouped:
        yield attrs.evolve(case, head_group_num=grouped[-1])


def _base(family: str, op: Op, kind: Kind, layout: Layout, variant: str, layers: int,
          profile: Profile, element_bytes: int, n_pages: int, unclaimed: str | None,
          dtype: torch.dtype = torch.bfloat16, **kw: object) -> Case:
    heads, dim = heads_for(kind, element_bytes, dtype.itemsize)
    return Case(family=family, op=op, kind=kind, layout=layout, variant=variant, dtype=dtype,
                page_size=profile.page_size, n_pages=n_pages, num_layers=layers,
                head_num=heads, head_dim=dim, unclaimed=unclaimed, **kw)  # type: ignore[arg-type]


def _pages(caps: Capabilities, profile: Profile) -> Iterator[Case]:
    for op, kind, layout in rows(caps):
        elem = DEFAULT_ELEMENT[kind]
        for variant, layers, why in _variant_cases(caps, profile, op, kind, layout,
                                                   torch.bfloat16, elem, profile.num_layers):
            counts = set(profile.page_counts)
            support = next((v for v in caps.ops if v.variant == variant and v.op is op), None)
            if support is not None and support.staged and support.staging_bytes:
                pb = page_bytes(op, profile.page_size, elem, layers)
                for per_chunk in (support.staging_bytes // pb,
                                  support.staging_bytes // (2 * pb)):
                    counts |= {c for c in (per_chunk - 1, per_chunk, per_chunk + 1) if c > 0}
            for n in sorted(counts):
                case = _base("pages", op, kind, layout, variant, layers, profile, elem, n, why)
                if _host_bytes(case) <= profile.max_host_bytes:
                    yield case


def _elements(caps: Capabilities, profile: Profile) -> Iterator[Case]:
    for op, kind, layout in rows(caps):
        for elem in ELEMENT_BYTES + ODD_ELEMENT_BYTES:
            for variant, layers, why in _variant_cases(caps, profile, op, kind, layout,
                                                       torch.float16, elem,
                                                       profile.num_layers):
                yield _base("elements", op, kind, layout, variant, layers, profile, elem,
                            profile.element_pages, why, dtype=torch.float16, order="reversed",
                            device_index_dtype=torch.int32)


def _dtypes(caps: Capabilities, profile: Profile) -> Iterator[Case]:
    for op, kind, layout in rows(caps):
        elem = DEFAULT_ELEMENT[kind]
        for dtype in (torch.bfloat16, torch.float16):
            for variant, layers, why in _variant_cases(caps, profile, op, kind, layout, dtype,
                                                       elem, profile.num_layers):
                for idx in (torch.int32, torch.int64):
                    for order in ("reversed", "scattered"):
                        yield _base("dtypes", op, kind, layout, variant, layers, profile,
                                    elem, profile.dtype_pages, why, dtype=dtype, order=order,
                                    host_index_dtype=idx, device_index_dtype=idx,
                                    swapped=order == "scattered")


def _bad_inputs(caps: Capabilities, profile: Profile) -> Iterator[Case]:
    for op, kind, layout in rows(caps):
        elem = DEFAULT_ELEMENT[kind]
        for variant, layers, why in _variant_cases(caps, profile, op, kind, layout,
                                                   torch.bfloat16, elem, profile.num_layers):
            for bad, only in BAD_INPUTS.items():
                if only is None or only is op:
                    yield _base("bad_input", op, kind, layout, variant, layers, profile, elem,
                                2, why, bad=bad)


def _round_trips(caps: Capabilities, profile: Profile) -> Iterator[Case]:
    for kind in Kind:
        for layout in layouts_for(kind):
            elem = DEFAULT_ELEMENT[kind]
            for load in (Op.LOAD_LAYER, Op.LOAD_ALL):
                why = None
                for op in (Op.WRITE_BACK, load):
                    why = why or fitting(caps, op, kind, layout, torch.bfloat16, elem)[1]
                yield _base("round_trip", Op.WRITE_BACK, kind, layout, "-", profile.num_layers,
                            profile, elem, profile.dtype_pages, why, then=load)


def _random_rows(caps: Capabilities, profile: Profile) -> Iterator[Case]:
    """One template case per claimed row; hypothesis varies its shape and indices."""
    for op, kind, layout in rows(caps):
        elem = DEFAULT_ELEMENT[kind]
        for variant, layers, why in _variant_cases(caps, profile, op, kind, layout,
                                                   torch.bfloat16, elem, profile.num_layers):
            yield _base("random", op, kind, layout, variant, layers, profile, elem, 1, why)
