"""The one ctypes binding of the native C ABI (docs/native-abi.md), shared by every native
plugin (kvio_cuda, kvio_rocm).

Vendor-neutral: it knows only the ABI. The runtime's label for error messages (``"cuda"``,
``"hip"``) and the library's display name (``"kvio_cuda"``) are constructor arguments of
:class:`NativeLibrary`. Pure marshalling, no torch: pointers, sizes and stream handles are plain
ints (0 or None is NULL), checked for range before they are narrowed to C types, and a nonzero
status becomes a :class:`~kvcore.errors.KernelError` carrying the runtime's message and code.
The library object can be replaced by any object with the same functions (tests use fakes).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from kvcore.errors import BuildError, DeviceFault, InvalidArgument, KernelError

__all__ = ["ABI_HEADER", "ABI_VERSION", "AFTER_WRITE_FUNCTIONS", "ASYNC_WRITE_FUNCTIONS",
           "DIRECT_AFTER_FUNCTIONS",
           "INCLUDE_DIR", "INLINE_GRID_BYTES", "INLINE_INDEX_PAGES", "INLINE_INDEX_TOKENS",
           "JOB_PENDING", "REPORT_BYTES", "KvioBounds", "KvioLayout", "KvioReport",
           "NativeLibrary", "OPTIONAL_PROTOTYPES", "PROTOTYPES", "inline_index_limit",
           "make_bounds", "make_layout", "unchecked_bounds"]

#: the ABI version this binding speaks (kvio_abi_version() must return it)
ABI_VERSION = 4
#: KVIO_INLINE_INDEX_TOKENS: the most host indices kvio_transfer_direct_inline and
#: kvio_load_layers_signaled_inline take one by one (CPU memory, carried in the launch)
INLINE_INDEX_TOKENS = 960
#: KVIO_INLINE_INDEX_PAGES: the most whole pages of a power-of-two page size they take (one
#: index per page in the launch)
INLINE_INDEX_PAGES = 960
#: an ``_inline`` call whose one grid moves this many bytes or more may be refused
INLINE_GRID_BYTES = 1 << 31


def inline_index_limit(page_size: int, grid_bytes_per_token: int) -> int:
    """The most CPU host indices one ``_inline`` call takes when they are whole pages of
    ``page_size`` (as a bound plan passes them) and its grid moves ``grid_bytes_per_token``
    bytes per token (a token's element, times 2 with V, times the layers of one grid):
    INLINE_INDEX_PAGES pages where ``page_size`` is a power of two, else INLINE_INDEX_TOKENS
    tokens, and under INLINE_GRID_BYTES either way (docs/native-abi.md)."""
    pow2 = page_size > 1 and page_size & (page_size - 1) == 0
    tokens = max(INLINE_INDEX_PAGES * page_size if pow2 else 0, INLINE_INDEX_TOKENS)
    return min(tokens, (INLINE_GRID_BYTES - 1) // max(1, grid_bytes_per_token))

#: the folder holding ``kvio_abi.h``, the ABI's C header (structs and prototypes): what a
#: native library builds against (``-I``); this module mirrors it for ctypes
INCLUDE_DIR = Path(__file__).resolve().parent / "include"
#: the header itself
ABI_HEADER = INCLUDE_DIR / "kvio_abi.h"

_LAYOUT_FIELDS = ("kv_stride", "layer_stride", "page_stride", "token_stride", "chunk_stride",
                  "page_size", "chunk_bytes", "num_chunks")

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT32 = (0, (1 << 32) - 1)
_UINT64 = (0, (1 << 64) - 1)
_COUNT = (0, (1 << 63) - 1)
_PTR = (0, (1 << 64) - 1)


class KvioLayout(ctypes.Structure):
    """Mirror of ``struct kvio_layout``: eight int64 fields, byte strides and sizes of the host
    buffer, passed by value."""

    _fields_ = [(name, ctypes.c_int64) for name in _LAYOUT_FIELDS]

    @classmethod
    def from_fields(cls, fields: Mapping[str, int] | None = None, /,
                    **kwargs: int) -> KvioLayout:
        """Build from a mapping and/or keyword arguments naming exactly the eight fields.

        ``KvioLayout.from_fields(kv_stride=..., ..., num_chunks=1)`` or
        ``KvioLayout.from_fields(layout_dict)``; a missing, unknown or out-of-range field
        raises InvalidArgument.
        """
        values: dict[str, Any] = dict(fields or {})
        values.update(kwargs)
        missing = [n for n in _LAYOUT_FIELDS if n not in values]
        unknown = sorted(set(values) - set(_LAYOUT_FIELDS))
        if missing or unknown:
            raise InvalidArgument("layout", f"exactly the fields {', '.join(_LAYOUT_FIELDS)}",
                                  f"missing {missing}, unknown {unknown}")
        return cls(**{n: _int(f"layout.{n}", values[n], _INT64) for n in _LAYOUT_FIELDS})

    def as_dict(self) -> dict[str, int]:
        """The fields as a plain dict."""
        return {name: int(getattr(self, name)) for name in _LAYOUT_FIELDS}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"KvioLayout({inner})"


def make_layout(layout: KvioLayout | Mapping[str, int]) -> KvioLayout:
    """A KvioLayout from a KvioLayout (returned as is) or a mapping of exactly its eight fields
    (e.g. :func:`kvcore.native.layout_fields`); anything else raises InvalidArgument."""
    if isinstance(layout, KvioLayout):
        return layout
    if isinstance(layout, Mapping):
        return KvioLayout.from_fields(layout)
    raise InvalidArgument("layout", "a KvioLayout or a mapping of its fields",
                          type(layout).__name__)


class KvioReport(ctypes.Structure):
    """Mirror of ``struct kvio_report`` (32 bytes): where the kernels record an out-of-range
    device-resident index. It lives in pinned host memory the kernels store to; the library
    writes a field pair (value first, then epoch) only on a violation, and Python reads it
    after the transfer's stream event has completed (docs/native-abi.md)."""

    _fields_ = [("host_epoch", ctypes.c_uint64), ("host_value", ctypes.c_int64),
                ("device_epoch", ctypes.c_uint64), ("device_value", ctypes.c_int64)]


#: bytes of one kvio_report, and the byte offsets of its fields
REPORT_BYTES = ctypes.sizeof(KvioReport)
REPORT_HOST_EPOCH = KvioReport.host_epoch.offset
REPORT_HOST_VALUE = KvioReport.host_value.offset
REPORT_DEVICE_EPOCH = KvioReport.device_epoch.offset
REPORT_DEVICE_VALUE = KvioReport.device_value.offset
assert REPORT_BYTES == 32 and REPORT_DEVICE_VALUE == 24


class KvioBounds(ctypes.Structure):
    """Mirror of ``struct kvio_bounds``, passed by pointer (read during the call only).

    Valid host indices are ``[0, host_tokens)``, valid device indices ``[0, device_tokens)``;
    ``report`` is the address of a :class:`KvioReport` in pinned host memory (never 0),
    ``epoch`` the value stored into its ``*_epoch`` field on a violation.
    """

    _fields_ = [("host_tokens", ctypes.c_int64), ("device_tokens", ctypes.c_int64),
                ("report", ctypes.c_uint64), ("epoch", ctypes.c_uint64)]

    def __repr__(self) -> str:
        return (f"KvioBounds(host_tokens={self.host_tokens}, device_tokens="
                f"{self.device_tokens}, report={self.report:#x}, epoch={self.epoch})")


def make_bounds(host_tokens: int, device_tokens: int, report: int, epoch: int) -> KvioBounds:
    """A KvioBounds from checked ints: token counts >= 0, a nonzero report address, a 64-bit
    unsigned epoch; anything else raises InvalidArgument."""
    bounds = KvioBounds(host_tokens=_int("bounds.host_tokens", host_tokens, _COUNT),
                        device_tokens=_int("bounds.device_tokens", device_tokens, _COUNT),
                        report=_int("bounds.report", report, _PTR),
                        epoch=_int("bounds.epoch", epoch, _UINT64))
    if bounds.report == 0:
        raise InvalidArgument("bounds.report", "the address of a kvio_report", "0 (NULL)")
    return bounds


# The report of the unchecked bounds: a buffer the binding owns for the life of the process.
# Nothing can store to it but a kernel that finds a negative index, which v1 callers (they
# validate index values on the CPU first) never pass.
_UNCHECKED_REPORT = KvioReport()
_UNCHECKED = KvioBounds(host_tokens=_INT64[1], device_tokens=_INT64[1],
                        report=ctypes.addressof(_UNCHECKED_REPORT), epoch=0)


def unchecked_bounds() -> KvioBounds:
    """The bounds a method passes when called with ``bounds=None``: every non-negative index
    is in range (INT64_MAX tokens on both sides), the report a static dummy the binding owns.
    For callers that have validated every index value on the CPU (the v1 contract)."""
    return _UNCHECKED


def _bounds(bounds: KvioBounds | None) -> KvioBounds:
    if bounds is None:
        return _UNCHECKED
    if not isinstance(bounds, KvioBounds):
        raise InvalidArgument("bounds", "a KvioBounds or None", type(bounds).__name__)
    if bounds.report == 0:
        raise InvalidArgument("bounds.report", "the address of a kvio_report", "0 (NULL)")
    return bounds


def _int(name: str, value: Any, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    if type(value) is int and lo <= value <= hi:  # the per-call common case, kept cheap
        return value
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgument(name, "an int", f"{type(value).__name__} {value!r}") from None
    if not lo <= v <= hi:
        raise InvalidArgument(name, f"an int in [{lo}, {hi}]", str(v))
    return v


# The transfer functions pass checked plain ints (None for NULL): the bound argtypes convert
# them exactly, since every value is range-checked first, and cheaper than ctypes objects.

def _ptr(name: str, value: Any) -> int | None:
    """A pointer or handle checked for the pointer range; None and 0 are NULL (None)."""
    if value is None:
        return None
    return _int(name, value, _PTR) or None


def _flag(name: str, value: Any) -> int:
    return 1 if _int(name, value, _INT64) else 0


def _staged_args(k_ptrs: int, v_ptrs: int | None, num_layers: int, host_base: int,
                 layout: KvioLayout | Mapping[str, int], host_idx_cpu: int, dev_idx: int,
                 dev_idx_64: int, n_tokens: int, staging: int, staging_bytes: int,
                 use_batched: int | bool, stream: int | None) -> tuple[Any, ...]:
    """The checked arguments the staged transfers share, up to their stream."""
    return (_ptr("k_ptrs", k_ptrs), _ptr("v_ptrs", v_ptrs),
            _int("num_layers", num_layers, _INT32), _ptr("host_base", host_base),
            make_layout(layout), _ptr("host_idx_cpu", host_idx_cpu), _ptr("dev_idx", dev_idx),
            _flag("dev_idx_64", dev_idx_64), _int("n_tokens", n_tokens, _INT64),
            _ptr("staging", staging), _int("staging_bytes", staging_bytes, _INT64),
            _flag("use_batched", use_batched), _ptr("stream", stream))


def _direction(direction: Any) -> int:
    if direction not in (0, 1):
        raise InvalidArgument("direction", "0 (device -> host) or 1 (host -> device)",
                              repr(direction))
    return int(direction)


def _direct_args(k_ptrs: int, v_ptrs: int | None, layer_begin: int, layer_count: int,
                 host_base: int, layout: KvioLayout | Mapping[str, int], host_idx: int,
                 host_idx_64: int, dev_idx: int, dev_idx_64: int,
                 n_tokens: int) -> tuple[Any, ...]:
    """The checked arguments the direct transfers share after their direction, up to
    n_tokens."""
    return (_ptr("k_ptrs", k_ptrs), _ptr("v_ptrs", v_ptrs),
            _int("layer_begin", layer_begin, _INT32), _int("layer_count", layer_count, _INT32),
            _ptr("host_base", host_base), make_layout(layout), _ptr("host_idx", host_idx),
            _flag("host_idx_64", host_idx_64), _ptr("dev_idx", dev_idx),
            _flag("dev_idx_64", dev_idx_64), _int("n_tokens", n_tokens, _INT64))


_c = ctypes
_BOUNDS_P = ctypes.POINTER(KvioBounds)
#: the host buffer and the index arguments of the kernels that read the indices on the device
_INDEXED = (
    _c.c_void_p,    # host_base
    KvioLayout,     # layout (by value)
    _c.c_void_p,    # host_idx
    _c.c_int,       # host_idx_64
    _c.c_void_p,    # dev_idx
    _c.c_int,       # dev_idx_64
    _c.c_int64,     # n_tokens
)
#: name -> (restype, argtypes) of every function the library exports
PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "kvio_abi_version": (_c.c_int, ()),
    "kvio_error_string": (_c.c_char_p, (_c.c_int,)),
    "kvio_has_batched_memcpy": (_c.c_int, ()),
    "kvio_transfer_direct": (_c.c_int, (
        _c.c_int,       # direction
        _c.c_void_p,    # k_ptrs
        _c.c_void_p,    # v_ptrs
        _c.c_int32,     # layer_begin
        _c.c_int32,     # layer_count
        *_INDEXED,
        _c.c_void_p,    # stream
        _BOUNDS_P,      # bounds (const kvio_bounds*, read during the call)
    )),
    "kvio_write_back_staged": (_c.c_int, (
        _c.c_void_p,    # k_ptrs
        _c.c_void_p,    # v_ptrs
        _c.c_int32,     # num_layers
        _c.c_void_p,    # host_base
        KvioLayout,     # layout (by value)
        _c.c_void_p,    # host_idx_cpu (int64, CPU memory)
        _c.c_void_p,    # dev_idx
        _c.c_int,       # dev_idx_64
        _c.c_int64,     # n_tokens
        _c.c_void_p,    # staging
        _c.c_int64,     # staging_bytes
        _c.c_int,       # use_batched
        _c.c_void_p,    # stream
        _BOUNDS_P,      # bounds (const kvio_bounds*, read during the call)
    )),
}

#: the staged write-back as a job (kvio_write_back_staged_async and _after): its arguments,
#: then the stream it follows, the bounds (copied by the call) and the job handle (out)
_STAGED_JOB = (_c.c_int, (
    *PROTOTYPES["kvio_write_back_staged"][1][:-1],
    _c.c_void_p,    # after_stream (the transfer follows its work so far; `stream`: none)
    _BOUNDS_P,      # bounds
    _c.POINTER(_c.c_void_p),  # job (out)
))

#: functions a library may export on top of PROTOTYPES (each has a ``has_...`` query)
OPTIONAL_PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    # kvio_transfer_direct's arguments; the caller vouches for the chained-load guarantee
    "kvio_transfer_direct_chained": PROTOTYPES["kvio_transfer_direct"],
    # the same, host_idx in CPU memory, read during the call and carried in the launch
    # (inline_index_limit says how many)
    "kvio_transfer_direct_inline": PROTOTYPES["kvio_transfer_direct"],
    # kvio_write_back_staged's arguments, the other direction
    "kvio_load_all_staged": PROTOTYPES["kvio_write_back_staged"],
    "kvio_load_layer_dma": (_c.c_int, (
        _c.c_void_p,    # k_dst (device address of the layer's K tensor)
        _c.c_void_p,    # v_dst (V tensor, NULL for MLA)
        _c.c_int32,     # layer
        _c.c_void_p,    # host_base
        KvioLayout,     # layout (by value)
        _c.c_void_p,    # host_idx_cpu (int64, CPU memory)
        _c.c_void_p,    # dev_idx_cpu (int64, CPU memory)
        _c.c_int64,     # n_tokens
        _c.c_int,       # use_batched
        _c.c_void_p,    # stream
        _BOUNDS_P,      # bounds (const kvio_bounds*, read during the call)
    )),
    # the signaled per-layer load: every layer in one launch, one ready flag per layer
    "kvio_has_layer_signals": (_c.c_int, ()),
    "kvio_load_layers_signaled": (_c.c_int, (
        _c.c_void_p,    # k_ptrs
        _c.c_void_p,    # v_ptrs
        _c.c_int32,     # num_layers
        *_INDEXED,
        _c.c_void_p,    # counters (uint32 x num_layers, device; zero, and left zero)
        _c.c_void_p,    # flags (uint32 x num_layers, device memory or pinned host memory)
        _c.c_uint32,    # epoch
        _c.c_void_p,    # stream
        _BOUNDS_P,      # bounds (const kvio_bounds*, read during the call)
    )),
    # the same with host_idx in CPU memory, read during the call and carried in the launch
    # (inline_index_limit says how many)
    "kvio_load_layers_signaled_inline": (_c.c_int, (
        _c.c_void_p,    # k_ptrs
        _c.c_void_p,    # v_ptrs
        _c.c_int32,     # num_layers
        *_INDEXED,      # (host_idx: CPU memory)
        _c.c_void_p,    # counters
        _c.c_void_p,    # flags
        _c.c_uint32,    # epoch
        _c.c_void_p,    # stream
        _BOUNDS_P,      # bounds
    )),
    "kvio_wait_layer_signal": (_c.c_int, (
        _c.c_void_p,    # flag (device-visible address of one uint32)
        _c.c_uint32,    # epoch
        _c.c_void_p,    # stream
    )),
    # how many consecutive layers of a signaled load land together (one wave of its grid)
    "kvio_signaled_layer_group": (_c.c_int, (
        _c.c_void_p,    # k_ptrs
        _c.c_void_p,    # v_ptrs
        _c.c_int32,     # num_layers
        _c.c_void_p,    # host_base
        KvioLayout,     # layout (by value)
        _c.c_int64,     # n_tokens
        _c.c_void_p,    # stream
        _c.POINTER(_c.c_int32),  # group (out)
    )),
    # one asynchronous copy of pinned host bytes to the device, on a stream
    "kvio_copy_to_device": (_c.c_int, (
        _c.c_void_p,    # dst (device memory)
        _c.c_void_p,    # src (pinned host memory)
        _c.c_int64,     # nbytes
        _c.c_void_p,    # stream
    )),
    # the staged write-back issued by a library thread (the caller only hands it over)
    "kvio_write_back_staged_async": _STAGED_JOB,
    # the same, issued by the caller before it returns (the host copy of a small one
    # overlaps the next one's gather)
    "kvio_write_back_staged_after": _STAGED_JOB,
    # kvio_transfer_direct's transfer of every layer given, after after_stream's work so far,
    # with a job for its completion (host_inline: host_idx in CPU memory, as the _inline form)
    "kvio_transfer_direct_after": (_c.c_int, (
        *PROTOTYPES["kvio_transfer_direct"][1][:-2],
        _c.c_int,       # host_inline
        _c.c_void_p,    # stream
        _c.c_void_p,    # after_stream
        _BOUNDS_P,      # bounds
        _c.POINTER(_c.c_void_p),  # job (out)
    )),
    "kvio_job_status": (_c.c_int, (_c.c_void_p,)),
    "kvio_job_wait": (_c.c_int, (_c.c_void_p,)),
    "kvio_job_release": (None, (_c.c_void_p,)),
    "kvio_jobs_flush": (None, ()),
}

#: the optional functions that together make the asynchronous staged write-back
ASYNC_WRITE_FUNCTIONS = frozenset({"kvio_write_back_staged_async", "kvio_job_status",
                                   "kvio_job_wait", "kvio_job_release", "kvio_jobs_flush"})
#: the optional functions that together make the overlapped staged write-back
AFTER_WRITE_FUNCTIONS = frozenset({"kvio_write_back_staged_after", "kvio_job_status",
                                   "kvio_job_wait", "kvio_job_release"})
#: the optional functions that together make the direct transfer with a job
DIRECT_AFTER_FUNCTIONS = frozenset({"kvio_transfer_direct_after", "kvio_job_status",
                                    "kvio_job_wait", "kvio_job_release"})
#: what kvio_job_status / kvio_job_wait return for a job not yet finished (KVIO_JOB_PENDING)
JOB_PENDING = -1

#: the optional functions that together make the signaled per-layer load
LAYER_SIGNAL_FUNCTIONS = frozenset({"kvio_has_layer_signals", "kvio_load_layers_signaled",
                                    "kvio_wait_layer_signal"})


class NativeLibrary:
    """A loaded library implementing the native ABI.

    ``NativeLibrary(path, runtime="cuda", name="kvio_cuda")`` loads ``path`` with ctypes,
    binds every function's prototype and checks the ABI version. ``runtime`` labels the status
    codes in error messages (``"cuda error 700"``), ``name`` names the library in load errors.
    ``sticky_codes``: the runtime's status codes after which the device context is lost (an
    illegal address, a kernel exception): :meth:`check` raises them as DeviceFault, which
    marks a controller unusable, and every other nonzero code as KernelError.
    ``lib=`` substitutes an already loaded or fake library object (tests): every function must
    be there; ctypes function pointers get the prototypes, Python stand-ins are called with the
    same checked plain values (ints, None for NULL, the KvioLayout, and last the KvioBounds,
    which ctypes passes to a real library by pointer).

    ABI version 2: every transfer method takes a final ``bounds`` (:class:`KvioBounds`): the
    kernels skip a vector whose device-resident index is out of range and record it in the
    report; the host code refuses an out-of-range CPU-resident index (KernelError, invalid
    value) before enqueueing. ``bounds=None``: :func:`unchecked_bounds`.
    """

    def __init__(self, path: Path | str | None = None, *, runtime: str, name: str,
                 lib: Any = None, sticky_codes: Collection[int] = ()) -> None:
        self.path = Path(path) if path is not None else None
        self.runtime = runtime
        self.name = name
        self.sticky_codes = frozenset(sticky_codes)
        if lib is None:
            if path is None:
                raise InvalidArgument("path", f"the path of the {name} library", "None")
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise BuildError(f"cannot load the {name} library {path}: {exc}") from exc
        self._lib = lib
        self._bind()
        version = self.abi_version()
        if version != ABI_VERSION:
            raise BuildError(f"{self._where()} implements native ABI version {version}, this "
                             f"binding speaks version {ABI_VERSION} (a stale build cache "
                             f"entry? rebuild the {name} library)")

    def _where(self) -> str:
        return str(self.path) if self.path is not None else repr(self._lib)

    def _bind(self) -> None:
        self.optional: frozenset[str] = frozenset(
            f for f in OPTIONAL_PROTOTYPES if hasattr(self._lib, f))
        # a CDLL's own foreign-function class (a stand-in's Python callables take no prototype)
        foreign: Any = getattr(self._lib, "_FuncPtr", None)
        for function, (restype, argtypes) in (*PROTOTYPES.items(),
                                              *OPTIONAL_PROTOTYPES.items()):
            try:
                fn = getattr(self._lib, function)
            except AttributeError:
                if function in OPTIONAL_PROTOTYPES:
                    continue
                raise BuildError(f"{self._where()} does not export {function} (a stale or "
                                 f"foreign library; rebuild the {self.name} library)") from None
            if foreign is not None and isinstance(fn, foreign):
                fn.restype = restype
                fn.argtypes = list(argtypes)

    def __repr__(self) -> str:
        return f"NativeLibrary({str(self.path)!r}, runtime={self.runtime!r})"

    # ------------------------------------------------------------------ queries

    def abi_version(self) -> int:
        """``kvio_abi_version()``."""
        return int(self._lib.kvio_abi_version())

    def has_batched_memcpy(self) -> bool:
        """Whether the loaded runtime (and driver) offer the batched async memcpy
        (cudaMemcpyBatchAsync / hipMemcpyBatchAsync)."""
        return bool(int(self._lib.kvio_has_batched_memcpy()))

    def has_transfer_direct_chained(self) -> bool:
        """Whether the library exports the optional ``kvio_transfer_direct_chained``."""
        return "kvio_transfer_direct_chained" in self.optional

    def has_load_all_staged(self) -> bool:
        """Whether the library exports the optional ``kvio_load_all_staged``."""
        return "kvio_load_all_staged" in self.optional

    def has_load_layer_dma(self) -> bool:
        """Whether the library exports the optional ``kvio_load_layer_dma``."""
        return "kvio_load_layer_dma" in self.optional

    def has_layer_signals(self) -> bool:
        """Whether the signaled per-layer load can run: the library exports its three
        functions and ``kvio_has_layer_signals()`` says the runtime can wait on a flag."""
        return (LAYER_SIGNAL_FUNCTIONS <= self.optional
                and bool(int(self._lib.kvio_has_layer_signals())))

    def has_async_write_back(self) -> bool:
        """Whether the library exports the asynchronous staged write-back and its job
        functions (:meth:`write_back_staged_async`)."""
        return ASYNC_WRITE_FUNCTIONS <= self.optional

    def has_overlapped_write_back(self) -> bool:
        """Whether the library exports the overlapped staged write-back and the job
        functions it reports through (:meth:`write_back_staged_after`)."""
        return AFTER_WRITE_FUNCTIONS <= self.optional

    def has_direct_after(self) -> bool:
        """Whether the library exports the direct transfer with a job and the job functions
        it reports through (:meth:`transfer_direct_after`)."""
        return DIRECT_AFTER_FUNCTIONS <= self.optional

    def error_string(self, code: int) -> str:
        """The runtime's message for status ``code``."""
        raw = self._lib.kvio_error_string(ctypes.c_int(_int("code", code, _INT32)))
        if raw is None:
            return "unknown error"
        if isinstance(raw, bytes):
            return raw.decode(errors="replace")
        return str(raw)

    def check(self, function: str, status: Any) -> None:
        """Raise for a nonzero ``status`` returned by ``function``: DeviceFault for one of
        :attr:`sticky_codes` (the process must be restarted to use the device again),
        KernelError for any other."""
        code = int(status)
        if code == 0:
            return
        message = f"{function}: {self.error_string(code)} ({self.runtime} error {code})"
        if code in self.sticky_codes:
            raise DeviceFault(f"{message}; a sticky fault: every later call on this device "
                              "fails the same way until the process restarts", code=code)
        raise KernelError(message, code=code)

    def unchecked(self, function: str,
                  last: Callable[[], Any] | None = None) -> Callable[..., None]:
        """``function`` called with its arguments exactly as the ctypes prototype takes them
        (ints, None for NULL, the KvioLayout, the KvioBounds), with none of the per-argument
        range checks of the methods below; raises KernelError for a nonzero status. For a
        caller that derived every argument from checked tensors once (a prepared runner,
        :meth:`kvcore.native.NativeBackend.prepare`): it saves microseconds per call.
        ``last``, where given, is called for the last argument on every call (the current
        stream's handle, looked up without another Python frame)."""
        fn = getattr(self._lib, function)
        check = self.check

        if last is None:
            def call(*args: Any) -> None:
                status = fn(*args)
                if status:
                    check(function, status)
        else:
            def call(*args: Any) -> None:
                status = fn(*args, last())
                if status:
                    check(function, status)

        return call

    # ------------------------------------------------------------------ transfers

    def transfer_direct(self, direction: int, k_ptrs: int, v_ptrs: int | None,
                        layer_begin: int, layer_count: int, host_base: int,
                        layout: KvioLayout | Mapping[str, int], host_idx: int,
                        host_idx_64: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                        stream: int | None, chained: bool = False,
                        bounds: KvioBounds | None = None, inline: bool = False) -> None:
        """``kvio_transfer_direct``: copy layers [layer_begin, layer_begin + layer_count) of
        ``n_tokens`` token pairs; direction 0 = device -> host, 1 = host -> device.

        Enqueued on ``stream`` (the runtime's raw stream handle; 0 = the default stream).
        ``chained`` calls ``kvio_transfer_direct_chained`` where the library has it (else the
        plain function, which is always correct): the caller vouches that the work just before
        this call on ``stream`` is an earlier call of the same transfer, writing nothing this
        one reads (docs/native-abi.md). ``bounds`` (a :class:`KvioBounds`) lets the kernels skip
        and report an out-of-range index; None: :func:`unchecked_bounds`. ``inline`` calls
        ``kvio_transfer_direct_inline``: ``host_idx`` is CPU memory, as many as
        :func:`inline_index_limit` allows, read during the call (BuildError where the
        library lacks it; ``chained`` is then ignored). Raises InvalidArgument before any call
        for an argument out of range, KernelError when the library returns a nonzero status.
        """
        direction = _direction(direction)
        if inline and "kvio_transfer_direct_inline" not in self.optional:
            raise BuildError(f"{self._where()} does not export kvio_transfer_direct_inline")
        name = ("kvio_transfer_direct_inline" if inline
                else "kvio_transfer_direct_chained"
                if chained and "kvio_transfer_direct_chained" in self.optional
                else "kvio_transfer_direct")
        status = getattr(self._lib, name)(
            direction, *_direct_args(k_ptrs, v_ptrs, layer_begin, layer_count, host_base,
                                     layout, host_idx, host_idx_64, dev_idx, dev_idx_64,
                                     n_tokens),
            _ptr("stream", stream), _bounds(bounds))
        self.check(name, status)

    def transfer_direct_after(self, direction: int, k_ptrs: int, v_ptrs: int | None,
                              layer_begin: int, layer_count: int, host_base: int,
                              layout: KvioLayout | Mapping[str, int], host_idx: int,
                              host_idx_64: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                              host_inline: int | bool, stream: int | None,
                              after_stream: int | None,
                              bounds: KvioBounds | None = None) -> int:
        """``kvio_transfer_direct_after`` (optional): :meth:`transfer_direct` on ``stream``
        after the work enqueued on ``after_stream`` until this call (equal to ``stream``:
        nothing more than stream order), ``host_idx`` in CPU memory where ``host_inline``
        (as ``inline``). Returns the job handle of its completion for :meth:`job_status` and
        :meth:`job_wait`, to be given back with :meth:`job_release`. Raises BuildError when
        the library lacks the functions, InvalidArgument and KernelError as
        :meth:`transfer_direct` (a refused call hands out no job).
        """
        direction = _direction(direction)
        function = "kvio_transfer_direct_after"
        if not self.has_direct_after():
            raise BuildError(f"{self._where()} does not export {function} and the job "
                             f"functions (rebuild the {self.name} library)")
        job = ctypes.c_void_p()
        self.check(function, self._lib.kvio_transfer_direct_after(
            direction, *_direct_args(k_ptrs, v_ptrs, layer_begin, layer_count, host_base,
                                     layout, host_idx, host_idx_64, dev_idx, dev_idx_64,
                                     n_tokens),
            _flag("host_inline", host_inline), _ptr("stream", stream),
            _ptr("after_stream", after_stream), _bounds(bounds), ctypes.byref(job)))
        return int(job.value or 0)

    def write_back_staged(self, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                          host_base: int, layout: KvioLayout | Mapping[str, int],
                          host_idx_cpu: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                          staging: int, staging_bytes: int, use_batched: int | bool,
                          stream: int | None, bounds: KvioBounds | None = None) -> None:
        """``kvio_write_back_staged``: all layers of whole pages, gathered into ``staging``
        (device, ``staging_bytes``) as the host page image and copied to the host page by page
        (batched when ``use_batched`` and the runtime has it).

        ``host_idx_cpu`` points to int64 indices in CPU memory (checked against
        ``bounds.host_tokens`` by the library before it enqueues anything), ``dev_idx`` to
        device indices (checked by the gather kernel). The staging buffer is in use until
        ``stream`` passes this call. Raises
        InvalidArgument before any call for an argument out of range, KernelError when the
        library returns a nonzero status.
        """
        self._staged("kvio_write_back_staged", k_ptrs, v_ptrs, num_layers, host_base, layout,
                     host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging, staging_bytes,
                     use_batched, stream, bounds)

    def write_back_staged_async(self, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                                host_base: int, layout: KvioLayout | Mapping[str, int],
                                host_idx_cpu: int, dev_idx: int, dev_idx_64: int,
                                n_tokens: int, staging: int, staging_bytes: int,
                                use_batched: int | bool, stream: int | None,
                                after_stream: int | None,
                                bounds: KvioBounds | None = None) -> int:
        """``kvio_write_back_staged_async`` (optional): :meth:`write_back_staged`, issued on
        ``stream`` by a library thread after the work enqueued on ``after_stream`` until this
        call (equal to ``stream``: nothing more than stream order). Checks its arguments as
        :meth:`write_back_staged` does, with the same errors, before handing anything over;
        returns the job handle for :meth:`job_status` and :meth:`job_wait`, to be given back
        with :meth:`job_release`.
        The host indices are copied; ``dev_idx``, ``staging`` and the pools must stay valid
        until the job finished. Raises BuildError when the library lacks the functions.
        """
        return self._staged_job("kvio_write_back_staged_async", self.has_async_write_back(),
                                k_ptrs, v_ptrs, num_layers, host_base, layout, host_idx_cpu,
                                dev_idx, dev_idx_64, n_tokens, staging, staging_bytes,
                                use_batched, stream, after_stream, bounds)

    def write_back_staged_after(self, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                                host_base: int, layout: KvioLayout | Mapping[str, int],
                                host_idx_cpu: int, dev_idx: int, dev_idx_64: int,
                                n_tokens: int, staging: int, staging_bytes: int,
                                use_batched: int | bool, stream: int | None,
                                after_stream: int | None,
                                bounds: KvioBounds | None = None) -> int:
        """``kvio_write_back_staged_after`` (optional): :meth:`write_back_staged_async`,
        issued before the call returns. One that fits half the staging buffer (and is below
        the pipelining size) copies to the host on the buffer's own copy stream, overlapping
        the next one's gather; the returned job completes after that copy. Raises BuildError
        when the library lacks the functions.
        """
        return self._staged_job("kvio_write_back_staged_after",
                                self.has_overlapped_write_back(), k_ptrs, v_ptrs, num_layers,
                                host_base, layout, host_idx_cpu, dev_idx, dev_idx_64, n_tokens,
                                staging, staging_bytes, use_batched, stream, after_stream,
                                bounds)

    def _staged_job(self, function: str, offered: bool, k_ptrs: int, v_ptrs: int | None,
                    num_layers: int, host_base: int, layout: KvioLayout | Mapping[str, int],
                    host_idx_cpu: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                    staging: int, staging_bytes: int, use_batched: int | bool,
                    stream: int | None, after_stream: int | None,
                    bounds: KvioBounds | None) -> int:
        if not offered:
            raise BuildError(f"{self._where()} does not export {function} and the job "
                             f"functions (rebuild the {self.name} library)")
        job = ctypes.c_void_p()
        self.check(function, getattr(self._lib, function)(
            *_staged_args(k_ptrs, v_ptrs, num_layers, host_base, layout, host_idx_cpu, dev_idx,
                          dev_idx_64, n_tokens, staging, staging_bytes, use_batched, stream),
            _ptr("after_stream", after_stream), _bounds(bounds), ctypes.byref(job)))
        return int(job.value or 0)

    def job_status(self, job: int) -> int:
        """``kvio_job_status``: :data:`JOB_PENDING` while the job is not issued or still
        running, 0 once everything it enqueued completed, else the error that failed it."""
        return int(self._lib.kvio_job_status(_ptr("job", job)))

    def job_wait(self, job: int) -> int:
        """``kvio_job_wait``: blocks until the job was issued and completed; its status."""
        return int(self._lib.kvio_job_wait(_ptr("job", job)))

    def job_release(self, job: int) -> None:
        """``kvio_job_release``: gives the handle back (a job not yet issued still is)."""
        self._lib.kvio_job_release(_ptr("job", job))

    def jobs_flush(self) -> None:
        """``kvio_jobs_flush``: blocks until every job handed over so far was issued."""
        self._lib.kvio_jobs_flush()

    def load_all_staged(self, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                        host_base: int, layout: KvioLayout | Mapping[str, int],
                        host_idx_cpu: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                        staging: int, staging_bytes: int, use_batched: int | bool,
                        stream: int | None, bounds: KvioBounds | None = None) -> None:
        """``kvio_load_all_staged`` (optional): :meth:`write_back_staged` the other way, whole
        host pages copied into ``staging`` (batched when ``use_batched`` and the runtime has
        it), then scattered into the device pool. Same arguments; raises BuildError when the
        library lacks the function.
        """
        if not self.has_load_all_staged():
            raise BuildError(f"{self._where()} does not export kvio_load_all_staged (a stale "
                             f"library; rebuild the {self.name} library)")
        self._staged("kvio_load_all_staged", k_ptrs, v_ptrs, num_layers, host_base, layout,
                     host_idx_cpu, dev_idx, dev_idx_64, n_tokens, staging, staging_bytes,
                     use_batched, stream, bounds)

    def _staged(self, function: str, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                host_base: int, layout: KvioLayout | Mapping[str, int], host_idx_cpu: int,
                dev_idx: int, dev_idx_64: int, n_tokens: int, staging: int,
                staging_bytes: int, use_batched: int | bool, stream: int | None,
                bounds: KvioBounds | None) -> None:
        status = getattr(self._lib, function)(
            *_staged_args(k_ptrs, v_ptrs, num_layers, host_base, layout, host_idx_cpu, dev_idx,
                          dev_idx_64, n_tokens, staging, staging_bytes, use_batched, stream),
            _bounds(bounds),
        )
        self.check(function, status)

    def load_layer_dma(self, k_dst: int, v_dst: int | None, layer: int, host_base: int,
                       layout: KvioLayout | Mapping[str, int], host_idx_cpu: int,
                       dev_idx_cpu: int, n_tokens: int, use_batched: int | bool,
                       stream: int | None, bounds: KvioBounds | None = None) -> None:
        """``kvio_load_layer_dma`` (optional): layer ``layer`` of ``n_tokens`` token pairs from
        the host buffer into the layer's device tensors ``k_dst``/``v_dst``, by the copy engine.

        Both index arrays are int64 in CPU memory, checked against ``bounds`` by the library
        before it enqueues anything; runs of consecutive slots become one copy each,
        submitted in one batch when ``use_batched`` and the runtime has it. Raises
        BuildError when the library lacks the function, InvalidArgument before any call for an
        argument out of range, KernelError when the library returns a nonzero status.
        """
        if not self.has_load_layer_dma():
            raise BuildError(f"{self._where()} does not export kvio_load_layer_dma (a stale "
                             f"library; rebuild the {self.name} library)")
        status = self._lib.kvio_load_layer_dma(
            _ptr("k_dst", k_dst),
            _ptr("v_dst", v_dst),
            _int("layer", layer, _INT32),
            _ptr("host_base", host_base),
            make_layout(layout),
            _ptr("host_idx_cpu", host_idx_cpu),
            _ptr("dev_idx_cpu", dev_idx_cpu),
            _int("n_tokens", n_tokens, _INT64),
            _flag("use_batched", use_batched),
            _ptr("stream", stream),
            _bounds(bounds),
        )
        self.check("kvio_load_layer_dma", status)

    def load_layers_signaled(self, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                             host_base: int, layout: KvioLayout | Mapping[str, int],
                             host_idx: int, host_idx_64: int, dev_idx: int, dev_idx_64: int,
                             n_tokens: int, counters: int, flags: int, epoch: int,
                             stream: int | None, bounds: KvioBounds | None = None,
                             inline: bool = False) -> None:
        """``kvio_load_layers_signaled`` (optional): a per-layer load of all ``num_layers``
        layers in one launch, layer after layer, in groups of consecutive layers
        (:meth:`signaled_layer_group`); ``flags[l]`` (uint32 the device stores to) becomes
        ``epoch`` once every layer of l's group has landed. ``counters`` (device uint32 x
        num_layers: one per group) must be zero at the first load; each load leaves them
        zero for the next on the stream. Indices and ``bounds`` as for :meth:`transfer_direct` (a
        skipped vector's tile still counts: every flag is set). ``inline`` calls
        ``kvio_load_layers_signaled_inline``: ``host_idx`` is CPU memory, as many as
        :func:`inline_index_limit` allows, read during the call (the caller may reuse them
        at once; one outside ``[0, bounds.host_tokens)`` is refused, KernelError, before
        anything is enqueued). Raises BuildError when the library lacks the function,
        InvalidArgument before any call for an argument out of range, KernelError when the
        library returns a nonzero status.
        """
        self._require_signals()
        name = "kvio_load_layers_signaled_inline" if inline else "kvio_load_layers_signaled"
        if name not in self.optional:
            raise BuildError(f"{self._where()} does not export {name}")
        status = getattr(self._lib, name)(
            _ptr("k_ptrs", k_ptrs), _ptr("v_ptrs", v_ptrs),
            _int("num_layers", num_layers, _INT32), _ptr("host_base", host_base),
            make_layout(layout), _ptr("host_idx", host_idx), _flag("host_idx_64", host_idx_64),
            _ptr("dev_idx", dev_idx), _flag("dev_idx_64", dev_idx_64),
            _int("n_tokens", n_tokens, _INT64), _ptr("counters", counters),
            _ptr("flags", flags), _int("epoch", epoch, _UINT32),
            _ptr("stream", stream),
            _bounds(bounds),
        )
        self.check(name, status)

    def wait_layer_signal(self, flag: int, epoch: int, stream: int | None) -> None:
        """``kvio_wait_layer_signal`` (optional): ``stream`` waits until the device uint32 at
        ``flag`` reaches ``epoch`` (cyclic: ``(int32)(*flag - epoch) >= 0``). Raises as
        :meth:`load_layers_signaled`."""
        self._require_signals()
        status = self._lib.kvio_wait_layer_signal(
            _ptr("flag", flag), _int("epoch", epoch, _UINT32), _ptr("stream", stream))
        self.check("kvio_wait_layer_signal", status)

    def signaled_layer_group(self, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                             host_base: int, layout: KvioLayout | Mapping[str, int],
                             n_tokens: int, stream: int | None) -> int:
        """``kvio_signaled_layer_group`` (optional): how many consecutive layers of
        :meth:`load_layers_signaled` with these arguments land together (1 to
        ``num_layers``); 1 where the library does not export it. Raises as
        :meth:`load_layers_signaled`."""
        if "kvio_signaled_layer_group" not in self.optional:
            return 1
        group = ctypes.c_int32(0)
        status = self._lib.kvio_signaled_layer_group(
            _ptr("k_ptrs", k_ptrs), _ptr("v_ptrs", v_ptrs),
            _int("num_layers", num_layers, _INT32), _ptr("host_base", host_base),
            make_layout(layout), _int("n_tokens", n_tokens, _INT64), _ptr("stream", stream),
            ctypes.byref(group))
        self.check("kvio_signaled_layer_group", status)
        return max(1, min(int(group.value), num_layers))

    def _require_signals(self) -> None:
        if missing := sorted(LAYER_SIGNAL_FUNCTIONS - self.optional):
            raise BuildError(f"{self._where()} does not export {', '.join(missing)} (a stale "
                             f"library; rebuild the {self.name} library)")
