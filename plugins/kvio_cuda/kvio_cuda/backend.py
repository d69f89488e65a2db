"""The CUDA backend object: loads the prebuilt kernel library (or builds one) and runs jobs
through it."""

from __future__ import annotations

import functools

import torch

from kvcore.buildcache import load_library
from kvcore.native import NativeBackend


class CudaBackend(NativeBackend):
    """Runs kvcore jobs with the kernels of csrc/kvio_cuda.cu on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        from kvio_cuda._native import NativeLibrary
        from kvio_cuda.build import library_path

        major, minor = torch.cuda.get_device_capability(device)
        # the wheel's prebuilt library when it holds code for this GPU (sha256 checked before
        # it is loaded), else a build on first use; loaded through the descriptor that was
        # verified, not by path again
        self.library_choice, path = library_path(major, minor, torch.version.cuda)
        prebuilt = self.library_choice.prebuilt
        lib = load_library(path, prebuilt.sha256 if prebuilt is not None else None)
        super().__init__(device, NativeLibrary(path, lib=lib))
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        raw_current = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw_current is not None:
            # torch's own lookup of the current stream's handle, without building a stream
            # object or a Python frame (on every wait_layer)
            self.current_raw_stream = functools.partial(  # type: ignore[method-assign]
                raw_current, self._index)
            self.current_stream_handle = self.current_raw_stream
