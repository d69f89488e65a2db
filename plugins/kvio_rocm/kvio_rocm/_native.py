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

__all__ = ["ABI_VERSION", "STICKY_ERRORS", "KvioBounds", "KvioLayout", "KvioReport",
           "NativeLibrary", "PROTOTYPES", "make_bounds", "make_layout", "unchecked_bounds"]

#: HIP runtime errors that leave the device unusable to the process: illegal address (700),
#: launch timeout (702), device assert (710), launch failure (719)
STICKY_ERRORS = frozenset({700, 702, 710, 719})


class NativeLibrary(native_abi.NativeLibrary):
    """The kvio_rocm library; status codes read ``hip error N``, sticky ones raise
    DeviceFault."""

    def __init__(self, path: Path | str | None = None, *, lib: Any = None) -> None:
        super().__init__(path, runtime="hip", name="kvio_rocm", lib=lib,
                         sticky_codes=STICKY_ERRORS)
