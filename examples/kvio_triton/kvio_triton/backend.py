"""The Triton backend: one kernel launch per (K/V, layer), on the job's stream."""

from __future__ import annotations

import torch
import triton

from kvcore import Completion, HostMemory, Op, TransferJob
from kvcore.streams import on_stream
from kvio_triton.kernels import copy_tokens


class TritonBackend:
    """Implements kvcore.TransferBackend with :func:`kvio_triton.kernels.copy_tokens`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        return torch.empty(shape, dtype=dtype, pin_memory=True), HostMemory.PINNED

    def run(self, job: TransferJob) -> Completion | None:
        n = job.host_indices.numel()
        if n == 0:
            return None
        s = job.host_strides
        pool = job.device_pool
        element_bytes = pool.element_bytes
        block = min(1024, triton.next_power_of_2(element_bytes))
        base = job.host_buffer.data_ptr()
        with on_stream(job.stream), torch.cuda.device(self.device):
            for kv in range(job.host_geometry.kv_count):
                layers = pool.layers(kv)
                for layer in job.layers:
                    copy_tokens[(n,)](
                        layers[layer].view(torch.uint8),
                        base + kv * s.kv_stride + layer * s.layer_stride,
                        job.host_indices, job.device_indices, element_bytes,
                        s.page_size, s.page_stride, s.token_stride, s.chunk_bytes,
                        s.chunk_stride, TO_HOST=job.op is Op.WRITE_BACK, BLOCK=block)
        return None
