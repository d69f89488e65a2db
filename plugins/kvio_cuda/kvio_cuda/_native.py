"""kvio_cuda's binding of the native ABI: :mod:`kvcore.native_abi` labelled for CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcore import native_abi
from kvcore.native_abi import ABI_VERSION, KvioLayout, make_layout

__all__ = ["ABI_VERSION", "KvioLayout", "NativeLibrary", "make_layout"]


class NativeLibrary(native_abi.NativeLibrary):
    """The kvio_cuda library; status codes read ``cuda error N``."""

    def __init__(self, path: Path | str | None = None, *, lib: Any = None) -> None:
        super().__init__(path, runtime="cuda", name="kvio_cuda", lib=lib)
