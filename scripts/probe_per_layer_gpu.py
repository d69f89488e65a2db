"""What one per-layer submit costs the caller on a GPU, with the index tensors on the CPU
(SGLang's "direct" io backend) and on the device (its "kernel" backend): 32
``BoundPlan.submit(h, d, layer=i)`` of the same tensors per load, as kvcore-sglang's hooks make
them, on a side stream (MHA, 32 layers, 8 x 128 bf16, 64-token pages, page_first host pool);
median over 55 loads of the mean us per submit, the device idle before each load. The
null-device form of the same rows: ``scripts/probe_null_device.py --per-layer``.

    python scripts/probe_per_layer_gpu.py
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcore import DevicePool, HiCacheController
from kvcore.layout import Op
from kvcore.registry import allocate_host_pool

P, LAYERS = 64, 32


def main() -> None:
    for pages in (1, 4, 16):
        n = pages * P
        dev = DevicePool.allocate("mha", LAYERS, 4 * n, 8, 128, torch.bfloat16, "cuda", P)
        host = allocate_host_pool("mha", "page_first", LAYERS, 4 * n, 8, 128, torch.bfloat16,
                                  P, "cuda")
        bound = HiCacheController(dev, host).bound[(0, Op.LOAD_LAYER)]
        stream = torch.cuda.Stream()
        for on in ("cpu", "cuda"):
            per_submit = []
            for _ in range(60):  # a new pair of tensors per load, as an engine makes them
                h = torch.arange(n, device=on)
                d = torch.arange(n, 2 * n, device=on)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for layer in range(LAYERS):
                    bound.submit(h, d, layer=layer, stream=stream)
                per_submit.append((time.perf_counter() - t0) / LAYERS)
                torch.cuda.synchronize()
            us = 1e6 * statistics.median(per_submit[5:])
            print(f"pages {pages:3d} indices on {on:4s}: one submit(layer=i) {us:6.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
