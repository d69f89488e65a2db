"""Page data derived from page keys, and page checksums, computed with torch ops on the device.

Each (layer, K/V) plane of a page is filled with words of a counter-based hash of the page's
key, so a page's bytes are a function of its key alone. A page's checksum is, per plane, a
weighted wrapping sum of its words (the weights are random odd numbers, so swapped or
shifted words change it). Checksums are recorded per host page when a write-back is issued
and compared with the checksums of the pages loaded back; mismatches are counted on the
device and read only when the count is asked for.
"""

from __future__ import annotations

import torch

from kvcore.errors import InvalidArgument
from kvcore.pools import DevicePool

# odd 63-bit constants of a splitmix-style mixer (they fit a signed int64)
_GOLDEN = 0x1E3779B97F4A7C15
_MIX1 = 0x3F58476D1CE4E5B9
_MIX2 = 0x14D049BB133111EB


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 30)
    x = x * _MIX1
    x = x ^ (x >> 27)
    x = x * _MIX2
    return x ^ (x >> 31)


class PageCodec:
    """Fills device pages from keys and checks loaded pages against recorded checksums.

    Args:
        pool: the device pool whose pages are filled and checked.
        host_pages: pages of the host pool (rows of the recorded-checksum table).
    """

    def __init__(self, pool: DevicePool, host_pages: int) -> None:
        self.pool = pool
        plane_bytes = pool.page_size * pool.element_bytes
        if plane_bytes % 8 == 0:
            self.word = torch.int64
        elif plane_bytes % 4 == 0:
            self.word = torch.int32
        else:
            raise InvalidArgument("page_size", "a page size whose bytes per layer (page_size x "
                                  f"{pool.element_bytes} B per token) are a multiple of 4",
                                  f"{pool.page_size} ({plane_bytes} B)")
        n_pages = pool.size // pool.page_size
        # plane views: (pages, words) over each layer's K, then each layer's V
        self.planes = [t.view(n_pages, -1).view(self.word) for t in pool.all_buffers()]
        words = self.planes[0].shape[1]
        dev = pool.device
        gen = torch.Generator().manual_seed(0x6B7669)
        self._weights = (torch.randint(1, 1 << 62, (words,), generator=gen) | 1).to(dev)
        self._ramp = (torch.arange(words, dtype=torch.int64) * _GOLDEN).to(dev)
        self.recorded = torch.zeros((host_pages, len(self.planes)), dtype=torch.int64,
                                    device=dev)
        self._mismatches = torch.zeros((), dtype=torch.int64, device=dev)

    def _plane_columns(self, layer: int | None) -> list[int]:
        if layer is None:
            return list(range(len(self.planes)))
        n = self.pool.num_layers
        return [layer + kv * n for kv in range(len(self.planes) // n)]

    def fill(self, pages: torch.Tensor, keys: torch.Tensor) -> None:
        """Write each page's key-derived data into every plane of ``pages`` (device tensors)."""
        for j, plane in enumerate(self.planes):
            seed = _mix(keys * _MIX2 + j)
            plane[pages] = _mix(seed[:, None] + self._ramp).to(self.word)

    def checksums(self, pages: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """(len(pages), planes) int64 checksums of ``pages`` (one layer's planes, or all)."""
        cols = [(self.planes[c][pages].to(torch.int64) * self._weights).sum(-1)
                for c in self._plane_columns(layer)]
        return torch.stack(cols, dim=1)

    def record(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        """Record the checksums of ``device_pages`` as those of the host pages written."""
        self.recorded[host_pages] = self.checksums(device_pages)

    def verify(self, host_pages: torch.Tensor, device_pages: torch.Tensor,
               layer: int | None = None) -> None:
        """Count pages of ``device_pages`` (loaded from ``host_pages``) whose checksum differs."""
        got = self.checksums(device_pages, layer)
        expected = self.recorded[host_pages][:, self._plane_columns(layer)]
        self._mismatches += (got != expected).any(dim=1).sum()

    def mismatches(self) -> int:
        """Pages (per verified layer) that did not match so far (synchronises the device)."""
        return int(self._mismatches)
