"""``kvio replay``: drive a controller with a synthetic multi-turn, prefix-reusing workload.

Sessions share system prompts and grow turn by turn, many in flight at once; a small prefix
index (pages keyed by a chained hash of their tokens) gives the write policies real hits; a
limited device pool and host pool force evictions in both tiers; write-backs and loads
overlap. Every page loaded back is checked, on the device, against the checksum recorded
when it was written.

Modules: :mod:`~kvcore.replay.workload` (sessions and requests),
:mod:`~kvcore.replay.prefix_index` (the page index and its two LRU tiers),
:mod:`~kvcore.replay.pages` (key-derived page data and checksums),
:mod:`~kvcore.replay.runner` (the replay loop), :mod:`~kvcore.replay.report` (results).
"""

from kvcore.replay.report import ReplayStats
from kvcore.replay.runner import Replay, ReplayConfig, run_replay
from kvcore.replay.workload import Workload, WorkloadConfig

__all__ = ["Replay", "ReplayConfig", "ReplayStats", "Workload", "WorkloadConfig", "run_replay"]
