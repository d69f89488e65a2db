"""kvio_rocm's binding of the native ABI: :mod:`kvcore.native_abi` labelled for HIP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcore import native_abi
from kvcore.native_abi import (
    ABI_VERSION,
    PROTOTYPES,
    KvioBounds,
    KvioLayout,
    KvioReport,
    make_bounds,
    make_layout,
    unchecked_bounds,
)

__all__ = ["ABI_VERSION", "KvioBounds", "KvioLayout", "KvioReport", "NativeLibrary",
           "PROTOTYPES", "make_bounds", "make_layout", "unchecked_bounds"]


class NativeLibrary(native_abi.NativeLibrary):
    """The kvio_rocm library; status codes read ``hip error N``."""

    def __init__(self, path: Path | str | None = None, *, lib: Any = None) -> None:
        super().__init__(path, runtime="hip", name="kvio_rocm", lib=lib)
