"""Write policies: when a page is backed up from the device to the host tier."""

from __future__ import annotations

import enum


class WritePolicy(str, enum.Enum):
    """When a page is backed up to the host."""

    WRITE_THROUGH = "write_through"  # on first insert
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # on the second hit
    WRITE_BACK = "write_back"  # on eviction from the device


class CacheEvent(str, enum.Enum):
    """What happened to a page in the radix cache (``HiCacheController.on_cache_event``)."""

    INSERT = "insert"
    HIT = "hit"
    EVICT = "evict"


def should_back_up(policy: WritePolicy, event: CacheEvent, hits: int,
                   selective_threshold: int = 2) -> bool:
    """The write policy's rule, in one place."""
    if policy is WritePolicy.WRITE_THROUGH:
        return event is CacheEvent.INSERT
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        return event is CacheEvent.HIT and hits == selective_threshold
    return event is CacheEvent.EVICT
