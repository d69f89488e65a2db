"""What ``kvio bench`` measures: presets, the sweep's axes and the cases they expand to.

A :class:`Case` is one shape of one operation. Its byte count follows the seed table: K and V
for MHA, the one latent buffer for MLA, over every layer the operation moves (per-layer load
counts all layers, because it is timed as the sum of one call per layer).
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch

from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout, Op, head_group_options, layouts_for, parse_enum
from kvcore.plan import dtype_name

#: head_dim of an MHA case whose element_dim is a multiple of it (else one head of element_dim)
MHA_HEAD_DIM = 128


@attrs.frozen
class Case:
    """One measured shape: an operation on pools of one geometry, moving one batch of pages."""

    op: Op
    kind: Kind
    layout: Layout
    dtype: torch.dtype
    page_size: int
    batch_pages: int
    total_pages: int
    num_layers: int
    element_dim: int
    head_group_num: int = 1  # head groups of the host pool (layouts that split heads)

    def __attrs_post_init__(self) -> None:
        for name in ("page_size", "batch_pages", "total_pages", "num_layers", "element_dim",
                     "head_group_num"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(name, "a positive int", repr(value))
        if self.total_pages < self.batch_pages:
            raise InvalidArgument("total_pages", f"at least batch_pages ({self.batch_pages})",
                                  str(self.total_pages))

    @property
    def head_num(self) -> int:
        """MHA: element_dim / 128 heads of 128 where that divides, else one head; MLA: one."""
        if self.kind is Kind.MHA and self.element_dim % MHA_HEAD_DIM == 0:
            return self.element_dim // MHA_HEAD_DIM
        return 1

    @property
    def head_dim(self) -> int:
        return self.element_dim // self.head_num

    @property
    def element_bytes(self) -> int:
        """Bytes of one token of one layer of K (or of the latent)."""
        return self.element_dim * self.dtype.itemsize

    @property
    def kv_count(self) -> int:
        return 2 if self.kind is Kind.MHA else 1

    @property
    def tokens(self) -> int:
        """Tokens moved per measured call (one batch)."""
        return self.batch_pages * self.page_size

    @property
    def pool_tokens(self) -> int:
        """Tokens in each pool (device and host): total_pages pages."""
        return self.total_pages * self.page_size

    @property
    def index_sets(self) -> int:
        """How many disjoint batches the repetitions rotate through."""
        return self.total_pages // self.batch_pages

    @property
    def bytes_moved(self) -> int:
        """Bytes one measured call moves (per-layer load: all its per-layer calls together)."""
        return bytes_moved(self.kv_count, self.num_layers, self.batch_pages, self.page_size,
                           self.element_bytes)

    @property
    def direction(self) -> str:
        """``d2h`` for write-back, ``h2d`` for loads: the direction of the ceiling copy."""
        return "d2h" if self.op is Op.WRITE_BACK else "h2d"

    def key(self) -> tuple[object, ...]:
        """The case's identity without the backend (rows of one key compare side by side)."""
        return (self.op.value, self.kind.value, self.layout.value, dtype_name(self.dtype),
                self.page_size, self.batch_pages, self.total_pages, self.num_layers,
                self.element_dim, self.head_group_num)

    def pool_key(self) -> tuple[object, ...]:
        """The pools' geometry: cases with equal pool keys can share pools."""
        return self.key()[1:]

    def facts(self) -> dict[str, object]:
        """JSON-able description of the case."""
        return {"op": self.op.value, "kind": self.kind.value, "layout": self.layout.value,
                "dtype": dtype_name(self.dtype), "page_size": self.page_size,
                "batch_pages": self.batch_pages, "total_pages": self.total_pages,
                "num_layers": self.num_layers, "element_dim": self.element_dim,
                "head_num": self.head_num, "head_dim": self.head_dim,
                "head_group_num": self.head_group_num,
                "element_bytes": self.element_bytes, "bytes": self.bytes_moved}


def bytes_moved(kv_count: int, num_layers: int, batch_pages: int, page_size: int,
                element_bytes: int) -> int:
    """kv_count * num_layers * batch_pages * page_size * element_bytes (the seed's rule)."""
    return kv_count * num_layers * batch_pages * page_size * element_bytes


@attrs.frozen
class Sweep:
    """The axes of a benchmark; :func:`expand` takes their product."""

    ops: tuple[Op, ...]
    kinds: tuple[Kind, ...]
    layouts: tuple[Layout, ...]
    dtypes: tuple[torch.dtype, ...]
    page_sizes: tuple[int, ...]
    batch_pages: tuple[int, ...]
    total_pages: tuple[int, ...]
    num_layers: tuple[int, ...]
    element_dims: tuple[int, ...]
    head_group_nums: tuple[int, ...] = (1,)


ALL_OPS = (Op.WRITE_BACK, Op.LOAD_LAYER, Op.LOAD_ALL)

PRESETS: dict[str, Sweep] = {
    # small enough for a 2-core CPU with the reference backend in well under a minute
    "default": Sweep(ops=ALL_OPS, kinds=(Kind.MHA, Kind.MLA),
                     layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST), dtypes=(torch.bfloat16,),
                     page_sizes=(16,), batch_pages=(16,), total_pages=(32,),
                     num_layers=(4, 32), element_dims=(256, 1024)),
    # the seed table: bf16, 64-token pages, batches of 64 of 128 pages, 16..80 layers; page_first
    # and SGLang 0.5.23's page_unified (one head group; --layout page_unified for its rows)
    "seed": Sweep(ops=ALL_OPS, kinds=(Kind.MHA, Kind.MLA),
                  layouts=(Layout.PAGE_FIRST, Layout.PAGE_UNIFIED),
                  dtypes=(torch.bfloat16,), page_sizes=(64,), batch_pages=(64,),
                  total_pages=(128,), num_layers=tuple(range(16, 81, 8)),
                  element_dims=(256, 512, 1024, 2048)),
    # one page of 64 tokens written back, against one copy of the same bytes: latency
    "single-page": Sweep(ops=(Op.WRITE_BACK,), kinds=(Kind.MHA, Kind.MLA),
                         layouts=(Layout.PAGE_FIRST,), dtypes=(torch.bfloat16,),
                         page_sizes=(64,), batch_pages=(1,), total_pages=(8,),
                         num_layers=(32,), element_dims=(512, 1024)),
}


def expand(sweep: Sweep) -> list[Case]:
    """Every case of the sweep, skipping (kind, layout) pairs that do not exist and head group
    counts the layout does not take for the element (kvcore.layout.head_group_options).

    The op varies fastest, so the cases of one pool geometry are consecutive and the runner
    can reuse that geometry's pools for every op.
    """
    cases = []
    for kind, layout, dtype, ps, bp, tp, nl, ed, groups, op in itertools.product(
            sweep.kinds, sweep.layouts, sweep.dtypes, sweep.page_sizes, sweep.batch_pages,
            sweep.total_pages, sweep.num_layers, sweep.element_dims, sweep.head_group_nums,
            sweep.ops):
        if layout not in layouts_for(kind):
            continue
        case = Case(op, kind, layout, dtype, ps, bp, tp, nl, ed, groups)
        if groups in head_group_options(kind, layout, case.head_num, case.head_dim,
                                        dtype.itemsize):
            cases.append(case)
    return cases


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its name (``bfloat16``, ``torch.float16``)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument("dtype", "a torch dtype name such as bfloat16", repr(name))
    return dtype


def override(sweep: Sweep, **axes: list[str] | None) -> Sweep:
    """The sweep with each given axis (a list of strings) replacing the preset's values."""
    parsers = {
        "ops": lambda v: parse_enum(Op, v, "op"),
        "kinds": lambda v: parse_enum(Kind, v, "kind"),
        "layouts": lambda v: parse_enum(Layout, v, "layout"),
        "dtypes": parse_dtype,
    }
    changes: dict[str, Any] = {}
    for axis, values in axes.items():
        if not values:
            continue
        parse = parsers.get(axis, lambda v, a=axis: _positive_int(a, v))
        changes[axis] = tuple(parse(v) for v in values)
    return attrs.evolve(sweep, **changes)


#: sweep axis -> the option (``--page-size``) and argument name it comes from
_OPTION = {"page_sizes": "page_size", "element_dims": "element_dim"}


def _positive_int(axis: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        option = _OPTION.get(axis, axis)  # the name the caller typed: page_size, not page_sizes
        raise InvalidArgument(option, "positive integers", repr(value))
    return n
