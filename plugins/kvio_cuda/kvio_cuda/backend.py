"""The CUDA backend object: builds/loads the kernel library and runs jobs through it."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.native import NativeBackend


class CudaBackend(NativeBackend):
    """Runs kvcore jobs with the kernels of csrc/kvio_cuda.cu on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        from kvio_cuda._native import NativeLibrary
        from kvio_cuda.build import build_library

        major, minor = torch.cuda.get_device_capability(device)
        super().__init__(device, NativeLibrary(build_library(major, minor)))

    def raw_stream(self, stream: Any) -> int:
        return int(stream.cuda_stream)
