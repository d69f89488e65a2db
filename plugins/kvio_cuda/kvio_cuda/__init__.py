"""kvio_cuda: NVIDIA write-back and load kernels (nvcc-built, plain C ABI, loaded by ctypes).

This module is the static registration only: capabilities and an availability probe that
loads no native code. The kernels come prebuilt in the wheel, or are built on first use (see
:mod:`kvio_cuda.build`).
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
from kvcore.layout import Layout
from kvcore.native import native_ops

__version__ = "0.1.0"

#: oldest compute capability the kernels are built and tested for
MIN_COMPUTE_CAPABILITY = (8, 0)


def check_availability() -> Availability:
    """Available when torch is a CUDA build, an NVIDIA GPU is visible and there is a library
    for it: the wheel's prebuilt one when it holds code for the GPU (no nvcc needed), else nvcc
    to build one on first use. The detail names the library (prebuilt or built, path, sha256,
    architectures). Loads no native code and never raises."""
    if torch.version.cuda is None or getattr(torch.version, "hip", None):
        return Unavailable(f"torch {torch.__version__} is not a CUDA build "
                           f"(torch.version.cuda is {torch.version.cuda!r})")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return Unavailable("no NVIDIA GPU visible (torch.cuda.is_available() is False)")
    cc = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()} (sm_{cc[0]}{cc[1]})"
    if cc < MIN_COMPUTE_CAPABILITY:
        return Unavailable(f"GPU {torch.cuda.get_device_name()} has compute capability "
                           f"{cc[0]}.{cc[1]}; kvio_cuda needs "
                           f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} or newer")
    from kvio_cuda import build

    choice = build.choose_library(cc[0], cc[1], torch.version.cuda)
    if choice.prebuilt is not None:
        return Available(f"{gpu}, CUDA {torch.version.cuda}: {choice.describe()}")
    try:
        nvcc = build.find_nvcc()
        built = build.describe_built(cc[0], cc[1])
    except kvcore.KVCoreError as exc:
        return Unavailable(f"no prebuilt library for {gpu} ({choice.reason}), and {exc}")
    return Available(f"{gpu}, CUDA {torch.version.cuda}: {built} with nvcc {nvcc}; not "
                     f"prebuilt: {choice.reason}")


#: host layouts whose per-layer loads use the copy engine (the ``dma`` variant) for page
#: slices of DMA_MIN_SLICE_BYTES and more: layer_first and page_first_direct keep a page's
#: layer slice contiguous. On the H200 it reaches 0.97-0.99 of the ceiling there at 128 KiB
#: slices and more, against 0.91-0.92 for the signaled kernel.
DMA_LOAD_LAYOUTS: tuple[Layout, ...] = (Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT)

#: smallest page slice the copy engine gets. At 64 KiB slices it usually reaches 0.95-0.98,
#: but single rows fell to 0.81-0.90 from run to run (CPU-bound: one copy per slice), while
#: the signaled kernel held 0.90-0.91 there in every row (docs/benchmarks/h200-2026-12-03d/).
DMA_MIN_SLICE_BYTES = 128 << 10

#: all-layer loads of contiguous host pages (page_first, page_first_direct, page_head) go
#: through the staged variant: copy-engine copies of whole pages into the staging buffer, then
#: a device scatter. On the H200 it reaches 0.92-0.99 of the ceiling there, against 0.92-0.93
#: for the zero-copy kernel (docs/benchmarks/h200-2026-12-03c/).
STAGED_LOAD = True

#: per-layer loads outside the copy engine's window go as one launch for every layer, layer
#: after layer, each raising a ready flag the consumer's stream waits on
#: (cuStreamWaitValue32): the launch gaps between per-layer kernels cost up to 10 % of the
#: ceiling at 2 MiB per layer, while one launch over every layer held 0.92 on the H200
#: (the all-layer load, docs/benchmarks/h200-2026-12-03c/).
SIGNALED_LOAD = True

#: staged write-backs and all-layer loads also take MHA page_unified pages, where K and V
#: alternate inside one run: the library stages and copies whole pages (K and V together)
WHOLE_PAGE_STAGED = True

CAPABILITIES = Capabilities(
    name="cuda",
    version=__version__,
    api_version=API_VERSION,
    platform="cuda",
    priority=100,
    probe=check_availability,
    # per-layer loads from layouts that keep a layer's tokens back to back go through the copy
    # engine (contiguous DMA beats SMs reading pinned memory); the rest use the direct kernel.
    # All-layer loads of contiguous host pages are staged, as write-backs are.
    ops=native_ops(dma_load_layouts=DMA_LOAD_LAYOUTS, dma_min_page_bytes=DMA_MIN_SLICE_BYTES,
                   staged_load=STAGED_LOAD, signaled_load=SIGNALED_LOAD,
                   whole_page_staged=WHOLE_PAGE_STAGED),
    host_memory=HostMemory.PINNED,
    device_types=frozenset({"cuda"}),
    description="NVIDIA kernels: staged batched-memcpy and direct non-temporal write-back, "
                "zero-copy loads" + (", staged all-layer loads" if STAGED_LOAD else "")
                + (", per-layer loads in one launch with per-layer flags"
                   if SIGNALED_LOAD else "")
                + (", copy-engine per-layer loads where a layer is contiguous"
                   if DMA_LOAD_LAYOUTS else ""),
)


def _factory(device: torch.device) -> TransferBackend:
    from kvio_cuda.backend import CudaBackend

    return CudaBackend(device)


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(capabilities=CAPABILITIES, factory=_factory))
