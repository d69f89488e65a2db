"""kvio_rocm: AMD write-back and load kernels (HIP, plain C ABI, loaded by ctypes).

Static registration only: capabilities and an availability probe that loads no native code.
torch exposes AMD GPUs under the device type "cuda" on ROCm builds; the probe tells the two
vendors apart (torch.version.hip), so the registry never needs a platform check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import kvcore
from kvcore.backend import TransferBackend
from kvcore.capabilities import (
    API_VERSION,
    Availability,
    Available,
    BackendSpec,
    Capabilities,
    HostMemory,
    Unavailable,
)
from kvcore.native import native_ops

__version__ = "0.1.0"


def check_availability() -> Availability:
    """Available on a ROCm build of torch with a visible AMD GPU and a compiler for its gfx."""
    from kvio_rocm.probe import probe as rocm_probe

    ok, reason = rocm_probe()
    return Available(reason) if ok else Unavailable(reason)


CAPABILITIES = Capabilities(
    name="rocm",
    version=__version__,
    api_version=API_VERSION,
    platform="rocm",
    priority=100,
    probe=check_availability,
    # all-layer loads of contiguous pages staged as on kvio_cuda, where the copy engine beat
    # the zero-copy kernel (0.92-0.99 against 0.92-0.93 on an H200); not measured on AMD.
    # page_unified MHA pages (K and V alternating inside one run) are staged whole: checked
    # bit for bit in the CPU emulation (tests/rocm/test_rocm_emulated.py)
    ops=native_ops(staged_load=True, whole_page_staged=True),
    host_memory=HostMemory.PINNED,  # hipHostMalloc / torch pinned: device address == host
    device_types=frozenset({"cuda"}),  # torch's device type for HIP devices
    description="AMD kernels: wave64, single nt dwordx4 accesses, staged hipMemcpyBatchAsync "
                "write-back and all-layer load, zero-copy loads",
)


def _factory(device: torch.device) -> TransferBackend:
    from kvio_rocm.backend import RocmBackend

    return RocmBackend(device)


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(capabilities=CAPABILITIES, factory=_factory))
