"""The ROCm backend object: builds/loads the HIP kernel library and runs jobs through it."""

from __future__ import annotations

import torch

from kvcore.buildcache import load_library
from kvcore.native import NativeBackend


class RocmBackend(NativeBackend):
    """Runs kvcore jobs with the kernels of csrc/kvio_rocm.hip on one AMD GPU."""

    def __init__(self, device: torch.device) -> None:
        from kvio_rocm._native import NativeLibrary
        from kvio_rocm.build import build_library, detect_gfx_arch

        index = device.index if device.index is not None else torch.cuda.current_device()
        path = build_library(detect_gfx_arch(index))
        # loaded through the descriptor the build cache verified, not by path again
        super().__init__(device, NativeLibrary(path, lib=load_library(path)))
