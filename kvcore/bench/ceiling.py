"""The ceiling: one contiguous copy of a row's byte count between the same two memories.

On an accelerator it copies between a device tensor and a host tensor from the reference
backend's allocator (pinned there): device to host for write-back rows, host to device for
loads. On the CPU both tensors are plain host memory (a memcpy).

The ceiling stands for what the hardware can do, so it is the fastest measurement of a size
in the run: the runner measures it again for every case (between its backends and after
them) and a slower measurement never replaces a faster one. A transient slowdown of the
host (seen on a shared machine as dips of 20 % for seconds) then lowers the rows timed
during it, never the yardstick of every row of that size.
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

    def measure(self, direction: str, nbytes: int, sets: int = 1, again: bool = False) -> Timing:
        """Time of one copy of ``nbytes`` (rotating among ``sets`` buffer pairs): the cached
        one, or with ``again`` (or none cached) a new measurement if it is the faster."""
        if again or (self.label(direction), nbytes) not in self._cache:
            self.sample(direction, nbytes, sets)
        return self._cache[(self.label(direction), nbytes)]

    def sample(self, direction: str, nbytes: int, sets: int = 1) -> Timing:
        """A new measurement, which also becomes the ceiling if it is the fastest so far."""
        key = (self.label(direction), nbytes)
        new = self._measure(direction, nbytes, max(1, sets))
        cached = self._cache.get(key)
        if cached is None or new.median_ms < cached.median_ms:
            self._cache[key] = new
        return new

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
        timing = steady.measure(copy, sets)
        del host, dev
        return timing
