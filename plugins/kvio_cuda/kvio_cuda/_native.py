"""kvio_cuda's binding of the native ABI: :mod:`kvcore.native_abi` labelled for CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcore import native_abi
from kvcore.native_abi import ABI_VERSION, KvioLayout, make_layout

__all__ = ["ABI_VERSION", "STICKY_ERRORS", "KvioLayout", "NativeLibrary", "make_layout"]

#: CUDA runtime errors that leave the context unusable ("any further CUDA work will return the
#: same error"): illegal address (700), launch timeout (702), device assert (710), hardware
#: stack error (714), illegal instruction (715), misaligned address (716), invalid address
#: space (717), invalid PC (718), launch failure (719)
STICKY_ERRORS = frozenset({700, 702, 710, 714, 715, 716, 717, 718, 719})


class NativeLibrary(native_abi.NativeLibrary):
    """The kvio_cuda library; status codes read ``cuda error N``, sticky ones raise
    DeviceFault."""

    def __init__(self, path: Path | str | None = None, *, lib: Any = None) -> None:
        super().__init__(path, runtime="cuda", name="kvio_cuda", lib=lib,
                         sticky_codes=STICKY_ERRORS)
