"""The CUDA backend object: builds/loads the kernel library and runs jobs through it."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.buildcache import load_library
from kvcore.native import NativeBackend


class CudaBackend(NativeBackend):
    """Runs kvcore jobs with the kernels of csrc/kvio_cuda.cu on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        from kvio_cuda._native import NativeLibrary
        from kvio_cuda.build import build_library

        major, minor = torch.cuda.get_device_capability(device)
        path = build_library(major, minor)
        # loaded through the descriptor the build cache verified, not by path again
        super().__init__(device, NativeLibrary(path, lib=load_library(path)))

    def raw_stream(self, stream: Any) -> int:
        return int(stream.cuda_stream)
