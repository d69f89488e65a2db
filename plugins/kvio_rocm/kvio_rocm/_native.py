"""ctypes binding of the kvio_rocm library (the C ABI of docs/native-abi.md).

Torch-free: every pointer is a plain int (``tensor.data_ptr()``), the stream is the raw
``hipStream_t`` as an int (0: the default stream). A nonzero status becomes
:class:`kvcore.errors.KernelError` carrying the HIP error code and the runtime's message.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcore.errors import BuildError, KernelError

__all__ = ["ABI_VERSION", "KvioLayout", "NativeLibrary", "PROTOTYPES", "make_layout"]

#: the ABI version this binding speaks (kvio_abi_version() of the library)
ABI_VERSION = 1


class KvioLayout(ctypes.Structure):
    """``struct kvio_layout``: byte strides and sizes of the host buffer, passed by value."""

    _fields_ = [
        ("kv_stride", ctypes.c_int64),
        ("layer_stride", ctypes.c_int64),
        ("page_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("chunk_stride", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("chunk_bytes", ctypes.c_int64),
        ("num_chunks", ctypes.c_int64),
    ]

    def as_dict(self) -> dict[str, int]:
        """The fields as a plain dict."""
        return {name: int(getattr(self, name)) for name, _ in self._fields_}


def make_layout(layout: KvioLayout | Mapping[str, int] | Any) -> KvioLayout:
    """A KvioLayout from a KvioLayout, a mapping of its fields, or any object with the eight
    attributes (e.g. kvcore.layout.ByteStrides)."""
    if isinstance(layout, KvioLayout):
        return layout
    names = [name for name, _ in KvioLayout._fields_]
    if isinstance(layout, Mapping):
        missing = [n for n in names if n not in layout]
        if missing:
            raise TypeError(f"layout: missing fields {missing}")
        return KvioLayout(**{n: int(layout[n]) for n in names})
    try:
        return KvioLayout(**{n: int(getattr(layout, n)) for n in names})
    except AttributeError as exc:
        raise TypeError(f"layout: expected KvioLayout, a mapping or an object with the fields "
                        f"{names}, got {type(layout).__name__}") from exc


_c = ctypes
#: name -> (restype, argtypes) of every exported function
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
        _c.c_void_p,    # host_base
        KvioLayout,     # layout (by value)
        _c.c_void_p,    # host_idx
        _c.c_int,       # host_idx_64
        _c.c_void_p,    # dev_idx
        _c.c_int,       # dev_idx_64
        _c.c_int64,     # n_tokens
        _c.c_void_p,    # stream
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
    )),
}


def _ptr(value: int | None) -> int | None:
    """NULL for 0/None, else the address (ctypes c_void_p wants None for NULL)."""
    return int(value) if value else None


class NativeLibrary:
    """The loaded kvio_rocm library.

    ``NativeLibrary(path)`` loads it with ctypes, binds every function's prototype and checks
    the ABI version. ``lib`` replaces the loaded library with any object that has the same
    function attributes (tests pass fakes).
    """

    def __init__(self, path: str | Path | None = None, *, lib: Any = None) -> None:
        if lib is None:
            if path is None:
                raise TypeError("NativeLibrary needs a path or lib=")
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise BuildError(f"cannot load the kvio_rocm library {path}: {exc}") from exc
        self.path = Path(path) if path is not None else None
        self._lib = lib
        for name, (restype, argtypes) in PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise BuildError(f"{path or lib!r} does not export {name}; rebuild the "
                                 "kvio_rocm library") from exc
            fn.restype = restype
            fn.argtypes = list(argtypes)
        version = self.abi_version()
        if version != ABI_VERSION:
            raise BuildError(f"{path or lib!r} implements native ABI version {version}, this "
                             f"binding speaks version {ABI_VERSION}; rebuild the library")

    def abi_version(self) -> int:
        """kvio_abi_version() of the library."""
        return int(self._lib.kvio_abi_version())

    def has_batched_memcpy(self) -> bool:
        """True when the loaded HIP runtime exports hipMemcpyBatchAsync."""
        return bool(self._lib.kvio_has_batched_memcpy())

    def error_string(self, code: int) -> str:
        """The HIP runtime's message for error ``code``."""
        raw = self._lib.kvio_error_string(int(code))
        if raw is None:
            return "unknown error"
        return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)

    def check(self, fn: str, status: int) -> None:
        """Raise KernelError for a nonzero status of function ``fn``."""
        status = int(status)
        if status != 0:
            raise KernelError(f"{fn}: {self.error_string(status)} (hip error {status})",
                              code=status)

    def transfer_direct(self, direction: int, k_ptrs: int, v_ptrs: int, layer_begin: int,
                        layer_count: int, host_base: int, layout: Any, host_idx: int,
                        host_idx_64: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                        stream: int) -> None:
        """kvio_transfer_direct: copy layers [layer_begin, layer_begin + layer_count) of
        ``n_tokens`` token pairs; direction 0 = device -> host, 1 = host -> device.
        Enqueued on ``stream``; raises KernelError on a nonzero status."""
        status = self._lib.kvio_transfer_direct(
            int(direction), _ptr(k_ptrs), _ptr(v_ptrs), int(layer_begin), int(layer_count),
            _ptr(host_base), make_layout(layout), _ptr(host_idx), int(bool(host_idx_64)),
            _ptr(dev_idx), int(bool(dev_idx_64)), int(n_tokens), _ptr(stream))
        self.check("kvio_transfer_direct", status)

    def write_back_staged(self, k_ptrs: int, v_ptrs: int, num_layers: int, host_base: int,
                          layout: Any, host_idx_cpu: int, dev_idx: int, dev_idx_64: int,
                          n_tokens: int, staging: int, staging_bytes: int, use_batched: int,
                          stream: int) -> None:
        """kvio_write_back_staged: gather whole pages into ``staging`` as the host page image,
        then copy them to the host (batched when ``use_batched`` and the runtime has it).
        Enqueued on ``stream``; raises KernelError on a nonzero status."""
        status = self._lib.kvio_write_back_staged(
            _ptr(k_ptrs), _ptr(v_ptrs), int(num_layers), _ptr(host_base), make_layout(layout),
            _ptr(host_idx_cpu), _ptr(dev_idx), int(bool(dev_idx_64)), int(n_tokens),
            _ptr(staging), int(staging_bytes), int(bool(use_batched)), _ptr(stream))
        self.check("kvio_write_back_staged", status)
