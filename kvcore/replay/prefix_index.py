"""The prefix index: pages by key, where each one lives, and an LRU order per tier."""

from __future__ import annotations

import collections
from collections.abc import Container, Iterator

import attrs

NOWHERE = -1


@attrs.define(slots=True)
class PageEntry:
    """One cached page. ``device``/``host`` are page numbers in each pool, or NOWHERE.

    ``host`` is set only once the write-back that put the page there was acknowledged;
    ``write_id`` is the id of a write-back in flight (None when there is none).
    """

    key: int
    device: int = NOWHERE
    host: int = NOWHERE
    hits: int = 0
    write_id: int | None = None

    @property
    def writing(self) -> bool:
        return self.write_id is not None


class PrefixIndex:
    """Pages by chained key, with least-recently-used order on the device and host tiers."""

    def __init__(self) -> None:
        self.entries: dict[int, PageEntry] = {}
        self._device_lru: collections.OrderedDict[int, PageEntry] = collections.OrderedDict()
        self._host_lru: collections.OrderedDict[int, PageEntry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, key: int) -> PageEntry:
        """The entry of ``key``, created (resident nowhere) if it is new."""
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = PageEntry(key)
        return e

    def place_on_device(self, e: PageEntry, page: int) -> None:
        e.device = page
        self._device_lru[e.key] = e

    def place_on_host(self, e: PageEntry, page: int) -> None:
        e.host = page
        self._host_lru[e.key] = e

    def touch(self, e: PageEntry) -> None:
        """Mark ``e`` most recently used in the tiers it lives in."""
        if e.device != NOWHERE:
            self._device_lru.move_to_end(e.key)
        if e.host != NOWHERE:
            self._host_lru.move_to_end(e.key)

    def device_victims(self, pinned: Container[int]) -> Iterator[PageEntry]:
        """Device-resident entries from least recently used, skipping ``pinned`` keys."""
        return (e for k, e in list(self._device_lru.items()) if k not in pinned)

    def host_victims(self, pinned: Container[int]) -> Iterator[PageEntry]:
        """Host-resident entries from least recently used, skipping ``pinned`` keys."""
        return (e for k, e in list(self._host_lru.items()) if k not in pinned)

    def leave_device(self, e: PageEntry) -> int:
        """Remove ``e`` from the device tier; return the page it held."""
        page, e.device = e.device, NOWHERE
        del self._device_lru[e.key]
        self._forget_if_gone(e)
        return page

    def leave_host(self, e: PageEntry) -> int:
        """Remove ``e`` from the host tier; return the page it held."""
        page, e.host = e.host, NOWHERE
        del self._host_lru[e.key]
        self._forget_if_gone(e)
        return page

    def _forget_if_gone(self, e: PageEntry) -> None:
        if e.device == NOWHERE and e.host == NOWHERE and not e.writing:
            self.entries.pop(e.key, None)
