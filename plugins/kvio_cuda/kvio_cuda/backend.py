"""The CUDA backend object: builds/loads the kernel library and runs jobs through it."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.capabilities import HostMemory
from kvcore.native import NativeBackend


class CudaBackend(NativeBackend):
    """Runs kvcore jobs with the kernels of csrc/kvio_cuda.cu on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        from kvio_cuda._native import KvioLayout, NativeLibrary
        from kvio_cuda.build import build_library

        major, minor = torch.cuda.get_device_capability(device)
        library = NativeLibrary(build_library(major, minor))
        super().__init__(device, library, KvioLayout.from_fields)

    def stream_handle(self, stream: Any) -> int:
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return int(stream.cuda_stream)

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        # cudaHostAlloc'd memory (torch's pinned allocator) is mapped at the same address on
        # the device (UVA), which is what the direct kernels dereference.
        return torch.empty(shape, dtype=dtype, pin_memory=True), HostMemory.PINNED
