"""One Triton kernel that copies whole tokens between a device layer and pinned host memory.

Host memory is addressed through its raw address (pinned memory is device-addressable at
its host address): an int64 kernel argument cast to a uint8 pointer. Elements are copied
as bytes, split into ``num_chunks`` runs of ``chunk_bytes`` on the host side, so every
host layout of kvcore.layout.byte_strides is one formula.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_tokens(device_layer, host_address, host_indices, device_indices, element_bytes,
                page_size, page_stride, token_stride, chunk_bytes, chunk_stride,
                TO_HOST: tl.constexpr, BLOCK: tl.constexpr):
    """Program t moves token t: device row device_indices[t] <-> host slot host_indices[t].

    ``host_address`` already points at this (kv, layer) of the host buffer.
    """
    t = tl.program_id(0)
    h = tl.load(host_indices + t).to(tl.int64)
    d = tl.load(device_indices + t).to(tl.int64)
    host = host_address.to(tl.int64).to(tl.pointer_type(tl.uint8))
    host_token = (h // page_size) * page_stride + (h % page_size) * token_stride
    device_token = d * element_bytes
    for start in range(0, element_bytes, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < element_bytes
        host_offset = host_token + (j // chunk_bytes) * chunk_stride + (j % chunk_bytes)
        if TO_HOST:
            v = tl.load(device_layer + device_token + j, mask=mask)
            tl.store(host + host_offset, v, mask=mask)
        else:
            v = tl.load(host + host_offset, mask=mask)
            tl.store(device_layer + device_token + j, v, mask=mask)
