"""What a backend declares about itself, readable without loading its native code.

A plugin registers a :class:`BackendSpec`: a frozen :class:`Capabilities` record (identity,
availability probe, one :class:`OpSupport` per operation variant, host memory) and a factory
that builds the backend only when a plan needs it. The controller derives index placement
from these records and nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch

from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout, Op, layouts_for, parse_enum

E = TypeVar("E", bound=enum.Enum)

#: The kvcore API version this core implements. A backend built for another is refused.
API_VERSION = 1


class Residency(str, enum.Enum):
    """Where an index tensor must live when the kernel runs."""

    HOST = "host"  # CPU memory
    DEVICE = "device"  # the device pool's device


class HostMemory(str, enum.Enum):
    """How host buffers are allocated so the backend's kernels can use them."""

    PINNED = "pinned"  # page-locked, device address == host address (cudaHostAlloc, hipHostMalloc)
    REGISTERED = "registered"  # registered after allocation; kernels get the mapped pointer
    PLAIN = "plain"  # pageable memory; only for backends that never dereference it on a device


@attrs.frozen
class Available:
    """The backend can run here."""

    detail: str = ""

    def __bool__(self) -> bool:
        return True


@attrs.frozen
class Unavailable:
    """The backend cannot run here, and why (concrete: what is missing, what was found)."""

    reason: str

    def __bool__(self) -> bool:
        return False


Availability = Available | Unavailable

INDEX_DTYPES = frozenset({torch.int32, torch.int64})


def residency_device(residency: Residency, device: torch.device) -> torch.device:
    """The torch device a residency means for a pool on ``device``."""
    return torch.device("cpu") if residency is Residency.HOST else device


def _members(cls: type[E], argument: str, value: object) -> frozenset[E]:
    """One member (or value) of ``cls`` or an iterable of them, as a non-empty frozenset of
    members (a single string is one value, not its letters); InvalidArgument naming
    ``argument`` for anything else."""
    items = [value] if isinstance(value, (str, cls)) else list(value)  # type: ignore[call-overload]
    members = frozenset(parse_enum(cls, v, argument) for v in items)
    if not members:
        allowed = ", ".join(str(m.value) for m in cls)
        raise InvalidArgument(argument, f"at least one of {allowed}", "none")
    return members


# attrs converters: a plugin may write an enum's value ("mha", "device") for its member


def _to_op(value: object) -> Op:
    return parse_enum(Op, value, "op")


def _to_kinds(value: object) -> frozenset[Kind]:
    return _members(Kind, "kinds", value)


def _to_layouts(value: object) -> frozenset[Layout]:
    return _members(Layout, "layouts", value)


def _to_residency(value: object) -> Residency:
    return parse_enum(Residency, value, "residency")


def _to_host_memory(value: object) -> HostMemory:
    return parse_enum(HostMemory, value, "host_memory")


def _dtype(value: object, argument: str) -> torch.dtype:
    """A torch dtype, or its name (``"bfloat16"``, ``"torch.int64"``), as the dtype;
    InvalidArgument naming ``argument`` for anything else."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise InvalidArgument(argument, "torch dtypes (torch.bfloat16) or their names "
                          "('bfloat16')", f"{type(value).__name__} {value!r}")


def _dtype_items(value: object, argument: str) -> list[torch.dtype]:
    if isinstance(value, (str, torch.dtype)):
        return [_dtype(value, argument)]
    try:
        items = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(argument, "a torch dtype or an iterable of them",
                              f"{type(value).__name__} {value!r}") from None
    return [_dtype(v, argument) for v in items]


def _to_index_dtypes(value: object) -> tuple[torch.dtype, ...]:
    dtypes = tuple(dict.fromkeys(_dtype_items(value, "dtypes")))  # (order kept: first preferred)
    if not dtypes or not set(dtypes) <= INDEX_DTYPES:
        raise InvalidArgument("dtypes", "index dtypes torch.int64 and/or torch.int32, the "
                              "preferred first", repr(value))
    return dtypes


def _to_element_dtypes(value: object) -> frozenset[torch.dtype] | None:
    if value is None:
        return None
    dtypes = frozenset(_dtype_items(value, "dtypes"))
    if not dtypes:
        raise InvalidArgument("dtypes", "None (any dtype) or at least one torch dtype",
                              "none")
    return dtypes


def _power_of_two(_: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise InvalidArgument(attribute.name, "a power of two, in bytes", repr(value))


@attrs.frozen
class IndexSpec:
    """Residency and accepted dtypes of one index tensor. ``dtypes[0]`` is preferred."""

    residency: Residency = attrs.field(converter=_to_residency)
    dtypes: tuple[torch.dtype, ...] = attrs.field(default=(torch.int64, torch.int32),
                                                  converter=_to_index_dtypes)


@attrs.frozen
class OpSupport:
    """One implementation variant of one operation.

    A backend may declare several variants for the same (op, kind, layout), for example a
    staged write-back for large pages and a direct one for small pages; the plan picks one per
    call by ``page_bytes`` (bytes of one page of K or V over the layers the op moves) using the
    half-open window [min_page_bytes, max_page_bytes), and then places indices and runs with
    that same variant.
    """

    op: Op = attrs.field(converter=_to_op)
    kinds: frozenset[Kind] = attrs.field(converter=_to_kinds)
    layouts: frozenset[Layout] = attrs.field(converter=_to_layouts)
    host_index: IndexSpec
    device_index: IndexSpec
    variant: str = "default"
    #: element dtypes served (torch dtypes or their names); None: any dtype
    dtypes: frozenset[torch.dtype] | None = attrs.field(default=None,
                                                        converter=_to_element_dtypes)
    #: element bytes must be a multiple of this (a power of two)
    element_alignment: int = attrs.field(default=1, validator=_power_of_two)
    contiguous_pages: bool = False  # needs each host page (per K/V) to be one contiguous run
    whole_pages: bool = False  # with contiguous_pages: or the page's K and V together one run
    staged: bool = False
    staging_bytes: int = 0  # device staging memory the variant holds (0 when not staged)
    batched_memcpy: bool = False  # uses a batched memcpy entry point when the runtime has it
    min_page_bytes: int = 0
    max_page_bytes: int | None = None
    #: LOAD_LAYER only: a job whose ``layer`` is None moves every layer in one submission and
    #: returns a :class:`~kvcore.signals.LayerSignals` (single-layer jobs work as usual)
    layer_signals: bool = False

    def __attrs_post_init__(self) -> None:
        if self.layer_signals and self.op is not Op.LOAD_LAYER:
            raise InvalidArgument("layer_signals", f"False for {self.op.value} (only "
                                  "load_layer takes one job for every layer with signals)",
                                  "True")
        # (a layout one of the kinds lacks is allowed: it is simply never asked for)
        if not any(layout in layouts_for(kind) for kind in self.kinds
                   for layout in self.layouts):
            kinds = ", ".join(sorted(k.value for k in self.kinds))
            raise InvalidArgument("layouts", f"at least one layout that exists for {kinds}",
                                  ", ".join(sorted(lay.value for lay in self.layouts)))

    def covers(self, op: Op, kind: Kind, layout: Layout) -> bool:
        """Whether this variant serves ``op`` for ``kind`` and ``layout``."""
        return op is self.op and kind in self.kinds and layout in self.layouts

    def refusal(self, dtype: torch.dtype, element_bytes: int) -> str | None:
        """Why this variant cannot serve the dtype/element size, or None when it can."""
        if self.dtypes is not None and dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            return f"dtype {str(dtype).removeprefix('torch.')} not in ({names})"
        if element_bytes % self.element_alignment:
            return (f"element of {element_bytes} B is not a multiple of "
                    f"{self.element_alignment} B")
        return None

    def fits_page(self, page_bytes: int) -> bool:
        """Whether ``page_bytes`` is in the variant's window
        ``[min_page_bytes, max_page_bytes)``."""
        upper = self.max_page_bytes is None or page_bytes < self.max_page_bytes
        return self.min_page_bytes <= page_bytes and upper


def op_support(op: Op | str, kinds: object, layouts: object, host: Residency | str,
               device: Residency | str, **kw: object) -> OpSupport:
    """Shorthand for declaring an :class:`OpSupport`. ``kinds``/``layouts``: one value or an
    iterable of them; enum members or their names (``"mha"``, ``"page_first"``). A value
    that is none of them raises InvalidArgument naming the argument."""
    return OpSupport(op=op, kinds=kinds, layouts=layouts, host_index=IndexSpec(host),
                     device_index=IndexSpec(device), **kw)  # type: ignore[arg-type]


@attrs.frozen
class Capabilities:
    """Static description of a backend. Constructing it must not load native code."""

    name: str
    version: str
    api_version: int
    platform: str  # "cuda", "rocm", "cpu", "any", or another label
    priority: int
    probe: Callable[[], Availability] = attrs.field(eq=False, repr=False)
    ops: tuple[OpSupport, ...]
    host_memory: HostMemory = attrs.field(converter=_to_host_memory)
    device_types: frozenset[str] | None = None  # torch device types it runs on; None: any
    description: str = ""

    def supports_device(self, device: torch.device) -> bool:
        """Whether the backend runs on ``device``'s type (``device_types`` None: any)."""
        return self.device_types is None or device.type in self.device_types

    def variants(self, op: Op, kind: Kind, layout: Layout) -> tuple[OpSupport, ...]:
        """The variants that serve ``op`` for ``kind`` and ``layout``, in declaration order."""
        return tuple(s for s in self.ops if s.covers(op, kind, layout))


@attrs.frozen
class BackendSpec:
    """What a plugin registers: capabilities plus a factory called only when a plan needs it.

    ``factory(device)`` returns a :class:`kvcore.backend.TransferBackend` (typed ``Any`` here:
    capabilities are static metadata, read below the runtime contract they describe).
    """

    capabilities: Capabilities
    factory: Callable[[torch.device], Any] = attrs.field(eq=False, repr=False)

    @property
    def name(self) -> str:
        """The backend's name (its capabilities' ``name``)."""
        return self.capabilities.name


def safe_probe(caps: Capabilities) -> Availability:
    """Run a probe; a probe that raises is reported as Unavailable, never propagated."""
    try:
        result = caps.probe()
    except Exception as exc:  # noqa: BLE001 - probing never raises, by contract
        return Unavailable(f"availability probe raised {type(exc).__name__}: {exc}")
    if not isinstance(result, (Available, Unavailable)):
        return Unavailable(f"availability probe returned {result!r}, not Available/Unavailable")
    return result
