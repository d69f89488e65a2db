"""The ROCm backend object: builds/loads the HIP kernel library and runs jobs through it."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.capabilities import HostMemory
from kvcore.native import NativeBackend


class RocmBackend(NativeBackend):
    """Runs kvcore jobs with the kernels of csrc/kvio_rocm.hip on one AMD GPU."""

    def __init__(self, device: torch.device) -> None:
        from kvio_rocm._native import NativeLibrary, make_layout
        from kvio_rocm.build import build_library, detect_gfx_arch

        index = device.index if device.index is not None else torch.cuda.current_device()
        library = NativeLibrary(build_library(detect_gfx_arch(index)))
        super().__init__(device, library, make_layout)

    def stream_handle(self, stream: Any) -> int:
        # torch exposes HIP streams through its cuda namespace on ROCm builds
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return int(stream.cuda_stream)

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        # torch's pinned allocator uses hipHostMalloc on ROCm: the device address equals the
        # host address, which is what the kernels dereference. Memory registered with
        # hipHostRegister would need hipHostGetDevicePointer instead, so it is never used here.
        return torch.empty(shape, dtype=dtype, pin_memory=True), HostMemory.PINNED
