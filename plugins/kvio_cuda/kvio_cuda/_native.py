"""ctypes binding of the kvio_cuda library: the C ABI of docs/native-abi.md.

Pure marshalling, no torch: pointers, sizes and stream handles are plain ints (0 or None is
NULL), checked for range before they are narrowed to C types, and a nonzero status becomes a
:class:`~kvcore.errors.KernelError` carrying the runtime's message and code. The library
object can be replaced by any object with the same functions (the CPU tests use a fake).
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcore.errors import BuildError, InvalidArgument, KernelError

__all__ = ["ABI_VERSION", "KvioLayout", "NativeLibrary"]

#: the ABI version this binding speaks (kvio_abi_version() must return it)
ABI_VERSION = 1

_LAYOUT_FIELDS = ("kv_stride", "layer_stride", "page_stride", "token_stride", "chunk_stride",
                  "page_size", "chunk_bytes", "num_chunks")

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_PTR = (0, (1 << 64) - 1)


class KvioLayout(ctypes.Structure):
    """Mirror of ``struct kvio_layout``: eight int64 fields, byte strides and sizes."""

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


def _int(name: str, value: Any, bounds: tuple[int, int]) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgument(name, "an int", f"{type(value).__name__} {value!r}") from None
    lo, hi = bounds
    if not lo <= v <= hi:
        raise InvalidArgument(name, f"an int in [{lo}, {hi}]", str(v))
    return v


def _ptr(name: str, value: Any) -> ctypes.c_void_p:
    """A pointer or handle as c_void_p; None and 0 are NULL."""
    if value is None:
        return ctypes.c_void_p(None)
    return ctypes.c_void_p(_int(name, value, _PTR) or None)


def _flag(name: str, value: Any) -> ctypes.c_int:
    return ctypes.c_int(1 if _int(name, value, _INT64) else 0)


def _layout(value: KvioLayout | Mapping[str, int]) -> KvioLayout:
    if isinstance(value, KvioLayout):
        return value
    if isinstance(value, Mapping):
        return KvioLayout.from_fields(value)
    raise InvalidArgument("layout", "a KvioLayout or a mapping of its fields",
                          type(value).__name__)


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_i32, c_i64, c_p = ctypes.c_int, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "kvio_abi_version": (c_int, []),
        "kvio_error_string": (ctypes.c_char_p, [c_int]),
        "kvio_has_batched_memcpy": (c_int, []),
        "kvio_transfer_direct": (c_int, [c_int, c_p, c_p, c_i32, c_i32, c_p, KvioLayout, c_p,
                                         c_int, c_p, c_int, c_i64, c_p]),
        "kvio_write_back_staged": (c_int, [c_p, c_p, c_i32, c_p, KvioLayout, c_p, c_p, c_int,
                                           c_i64, c_p, c_i64, c_int, c_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise BuildError(f"{lib._name}: missing symbol {name} (a stale or foreign library; "
                             "remove it from the kvcore build cache)") from None
        fn.restype = restype
        fn.argtypes = argtypes


class NativeLibrary:
    """The loaded kernel library.

    ``NativeLibrary(path)`` loads ``path`` with ctypes and checks its ABI version;
    ``lib=`` substitutes an already loaded or fake library object (tests).
    """

    def __init__(self, path: Path | str | None, *, lib: Any = None) -> None:
        self.path = Path(path) if path is not None else None
        if lib is None:
            if path is None:
                raise InvalidArgument("path", "the path of the kvio_cuda library", "None")
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise BuildError(f"cannot load the kvio_cuda library {path}: {exc}") from exc
            _declare(lib)
        self._lib = lib
        version = self.abi_version()
        if version != ABI_VERSION:
            raise BuildError(f"{path}: native ABI version {version}, this binding speaks "
                             f"version {ABI_VERSION} (stale build cache entry?)")

    def __repr__(self) -> str:
        return f"NativeLibrary({str(self.path)!r})"

    # ------------------------------------------------------------------ queries

    def abi_version(self) -> int:
        """``kvio_abi_version()``."""
        return int(self._lib.kvio_abi_version())

    def has_batched_memcpy(self) -> bool:
        """Whether the loaded runtime (and driver) offer cudaMemcpyBatchAsync."""
        return bool(int(self._lib.kvio_has_batched_memcpy()))

    def error_string(self, code: int) -> str:
        """The runtime's message for status ``code``."""
        raw = self._lib.kvio_error_string(ctypes.c_int(_int("code", code, _INT32)))
        if raw is None:
            return "unknown error"
        if isinstance(raw, bytes):
            return raw.decode(errors="replace")
        return str(raw)

    def _check(self, function: str, status: Any) -> None:
        code = int(status)
        if code != 0:
            raise KernelError(f"{function}: {self.error_string(code)} (cuda error {code})",
                              code=code)

    # ------------------------------------------------------------------ transfers

    def transfer_direct(self, direction: int, k_ptrs: int, v_ptrs: int | None,
                        layer_begin: int, layer_count: int, host_base: int,
                        layout: KvioLayout | Mapping[str, int], host_idx: int,
                        host_idx_64: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                        stream: int | None) -> None:
        """``kvio_transfer_direct``: copy layers [layer_begin, layer_begin + layer_count) of
        ``n_tokens`` token pairs; direction 0 = device -> host, 1 = host -> device.

        Enqueued on ``stream`` (a raw cudaStream_t; 0 = the legacy default stream). Raises
        KernelError when the library returns a nonzero status.
        """
        if direction not in (0, 1):
            raise InvalidArgument("direction", "0 (device -> host) or 1 (host -> device)",
                                  repr(direction))
        status = self._lib.kvio_transfer_direct(
            ctypes.c_int(direction),
            _ptr("k_ptrs", k_ptrs),
            _ptr("v_ptrs", v_ptrs),
            ctypes.c_int32(_int("layer_begin", layer_begin, _INT32)),
            ctypes.c_int32(_int("layer_count", layer_count, _INT32)),
            _ptr("host_base", host_base),
            _layout(layout),
            _ptr("host_idx", host_idx),
            _flag("host_idx_64", host_idx_64),
            _ptr("dev_idx", dev_idx),
            _flag("dev_idx_64", dev_idx_64),
            ctypes.c_int64(_int("n_tokens", n_tokens, _INT64)),
            _ptr("stream", stream),
        )
        self._check("kvio_transfer_direct", status)

    def write_back_staged(self, k_ptrs: int, v_ptrs: int | None, num_layers: int,
                          host_base: int, layout: KvioLayout | Mapping[str, int],
                          host_idx_cpu: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                          staging: int, staging_bytes: int, use_batched: int | bool,
                          stream: int | None) -> None:
        """``kvio_write_back_staged``: all layers of whole pages, gathered into ``staging``
        (device, ``staging_bytes``) and copied to the host page by page.

        ``host_idx_cpu`` points to int64 indices in CPU memory, ``dev_idx`` to device
        indices. The staging buffer is in use until ``stream`` passes this call. Raises
        KernelError when the library returns a nonzero status.
        """
        status = self._lib.kvio_write_back_staged(
            _ptr("k_ptrs", k_ptrs),
            _ptr("v_ptrs", v_ptrs),
            ctypes.c_int32(_int("num_layers", num_layers, _INT32)),
            _ptr("host_base", host_base),
            _layout(layout),
            _ptr("host_idx_cpu", host_idx_cpu),
            _ptr("dev_idx", dev_idx),
            _flag("dev_idx_64", dev_idx_64),
            ctypes.c_int64(_int("n_tokens", n_tokens, _INT64)),
            _ptr("staging", staging),
            ctypes.c_int64(_int("staging_bytes", staging_bytes, _INT64)),
            _flag("use_batched", use_batched),
            _ptr("stream", stream),
        )
        self._check("kvio_write_back_staged", status)
