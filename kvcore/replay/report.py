"""What a replay did: counters, rates, and their table and JSON forms."""

from __future__ import annotations

from typing import Any

import attrs

_GIB = float(1 << 30)


@attrs.define
class ReplayStats:
    """Counters of one replay. ``errors`` must be 0 for the run to pass."""

    requests: int = 0
    pages_requested: int = 0
    device_hits: int = 0
    host_hits: int = 0
    misses: int = 0
    pages_written: int = 0
    pages_loaded: int = 0
    device_evicted: int = 0
    host_evicted: int = 0
    checksum_mismatches: int = 0
    transfer_errors: int = 0
    error_messages: list[str] = attrs.Factory(list)
    page_bytes: int = 0
    wall_s: float = 0.0
    backend: str = ""
    device: str = ""
    write_policy: str = ""
    stopped_by: str = ""

    @property
    def transfers(self) -> int:
        """Page transfers: pages written back plus pages loaded."""
        return self.pages_written + self.pages_loaded

    @property
    def errors(self) -> int:
        return self.checksum_mismatches + self.transfer_errors

    @property
    def hit_rate(self) -> float:
        hits = self.device_hits + self.host_hits
        return hits / self.pages_requested if self.pages_requested else 0.0

    def _gib_s(self, pages: int) -> float:
        return pages * self.page_bytes / _GIB / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data (what ``--json`` prints)."""
        return {
            "backend": self.backend, "device": self.device, "write_policy": self.write_policy,
            "requests": self.requests, "pages_requested": self.pages_requested,
            "device_hits": self.device_hits, "host_hits": self.host_hits,
            "misses": self.misses, "hit_rate": round(self.hit_rate, 6),
            "pages_written": self.pages_written, "pages_loaded": self.pages_loaded,
            "transfers": self.transfers,
            "device_evicted": self.device_evicted, "host_evicted": self.host_evicted,
            "page_bytes": self.page_bytes,
            "bytes_device_to_host": self.pages_written * self.page_bytes,
            "bytes_host_to_device": self.pages_loaded * self.page_bytes,
            "gib_s_device_to_host": round(self._gib_s(self.pages_written), 3),
            "gib_s_host_to_device": round(self._gib_s(self.pages_loaded), 3),
            "wall_s": round(self.wall_s, 3),
            "checksum_mismatches": self.checksum_mismatches,
            "transfer_errors": self.transfer_errors, "errors": self.errors,
            "error_messages": list(self.error_messages), "stopped_by": self.stopped_by,
        }

    def table(self) -> str:
        """A two-column text table of the results."""
        d = self.as_dict()
        rows = [
            ("backend / device", f"{self.backend} on {self.device}"),
            ("write policy", self.write_policy),
            ("requests", f"{self.requests}"),
            ("pages requested", f"{self.pages_requested}"),
            ("hit rate", f"{self.hit_rate:.1%} (device {self.device_hits}, "
                         f"host {self.host_hits}, miss {self.misses})"),
            ("pages written (D->H)", f"{self.pages_written}  "
                                     f"{d['bytes_device_to_host'] / _GIB:.3f} GiB  "
                                     f"{d['gib_s_device_to_host']:.2f} GiB/s"),
            ("pages loaded (H->D)", f"{self.pages_loaded}  "
                                    f"{d['bytes_host_to_device'] / _GIB:.3f} GiB  "
                                    f"{d['gib_s_host_to_device']:.2f} GiB/s"),
            ("page transfers", f"{self.transfers}"),
            ("evicted (device / host)", f"{self.device_evicted} / {self.host_evicted}"),
            ("wall time", f"{self.wall_s:.2f} s (stopped by {self.stopped_by})"),
            ("checksum mismatches", f"{self.checksum_mismatches}"),
            ("transfer errors", f"{self.transfer_errors}"),
            ("ERRORS" if self.errors else "errors", f"{self.errors}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"  error: {m}" for m in self.error_messages]
        return "\n".join(lines)
