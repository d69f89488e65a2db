"""kvio_triton: an out-of-tree kvcore backend with Triton kernels (NVIDIA and AMD GPUs).

Static registration only: importing this module loads neither Triton nor a GPU context; the
probe runs when asked and the kernels compile on first use. It claims a subset of the
layouts (no page_head), which ``kvio check triton`` reports as "not claimed".
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

import kvcore
from kvcore.capabilities import (
    API_VERSION,
    Availability,
    Available,
    BackendSpec,
    Capabilities,
    HostMemory,
    Residency,
    Unavailable,
    op_support,
)
from kvcore.layout import Kind, Layout, Op

__version__ = "0.1.0"

LAYOUTS = (Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)


def probe() -> Availability:
    """Available when Triton is installed and torch sees a GPU (CUDA or ROCm). Never raises."""
    if importlib.util.find_spec("triton") is None:
        return Unavailable("the triton package is not installed")
    if not torch.cuda.is_available():
        return Unavailable("no GPU visible to torch (torch.cuda.is_available() is False); "
                           "the Triton kernels need an NVIDIA or AMD GPU")
    import triton

    return Available(f"triton {triton.__version__} on {torch.cuda.get_device_name()}")


CAPABILITIES = Capabilities(
    name="triton",
    version=__version__,
    api_version=API_VERSION,
    platform="gpu",
    priority=20,
    probe=probe,
    # Both index tensors are read by the kernels, so both live on the device.
    ops=tuple(op_support(op, (Kind.MHA, Kind.MLA), LAYOUTS, Residency.DEVICE, Residency.DEVICE)
              for op in Op),
    # The kernels dereference host buffers, so they must be pinned (device-addressable).
    host_memory=HostMemory.PINNED,
    device_types=frozenset({"cuda"}),  # torch's device type on both NVIDIA and ROCm builds
    description="Triton byte-copy kernels storing to / loading from pinned host memory",
)


def _factory(device: torch.device) -> kvcore.TransferBackend:
    from kvio_triton.backend import TritonBackend  # imported late: registration stays light

    return TritonBackend(device)


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(capabilities=CAPABILITIES, factory=_factory))
