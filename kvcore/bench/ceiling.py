"""The ceiling: one contiguous copy of a row's byte count between the same two memories.

On an accelerator it copies between a device tensor and a host tensor from the reference
backend's allocator (pinned there): device to host for write-back rows, host to device for
loads. On the CPU both tensors are plain host memory (a memcpy). Results are cached per
(direction, bytes), so each size is measured once per run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcore.bench.timing import Clock, Timing
from kvcore.streams import has_streams

#: the ceiling is timed over this many times the rows' repetitions
CEILING_REPEAT_FACTOR = 3

#: allocate_host(shape, dtype) -> (tensor, memory), as a backend instance provides it
HostAllocator = Callable[[tuple[int, ...], torch.dtype], tuple[torch.Tensor, object]]


class Ceiling:
    """Measures and caches contiguous-copy times; see the module docstring."""

    def __init__(self, clock: Clock, allocate_host: HostAllocator) -> None:
        self.clock = clock
        self.allocate_host = allocate_host
        self._cache: dict[tuple[str, int], Timing] = {}

    def label(self, direction: str) -> str:
        """What the copy is: ``d2h``/``h2d`` on an accelerator, ``memcpy`` on the CPU."""
        return direction if has_streams(self.clock.device) else "memcpy"

    def measure(self, direction: str, nbytes: int, sets: int = 1) -> Timing:
        """Time of one copy of ``nbytes`` (rotating among ``sets`` buffer pairs), cached."""
        key = (self.label(direction), nbytes)
        if key not in self._cache:
            self._cache[key] = self._measure(direction, nbytes, max(1, sets))
        return self._cache[key]

    def _measure(self, direction: str, nbytes: int, sets: int) -> Timing:
        device = self.clock.device
        host = [self.allocate_host((nbytes,), torch.uint8)[0] for _ in range(sets)]
        dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(sets)]
        for t in host + dev:
            t.fill_(0x5A)
        src, dst = (dev, host) if direction == "d2h" else (host, dev)
        asynchronous = has_streams(device)

        def copy(i: int) -> None:
            dst[i % sets].copy_(src[i % sets], non_blocking=asynchronous)

        # the ceiling is cheap and every row's ratio divides by it: time it over more calls
        steady = Clock(device, self.clock.warmup + 1, self.clock.repeat * CEILING_REPEAT_FACTOR)
        timing = steady.measure(copy)
        del host, dev
        return timing
