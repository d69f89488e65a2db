"""kvcore: a pluggable backend registry for moving paged KV-cache data between GPU and host.

The public API lives here; see README.md for a tour and docs/writing-a-backend.md for the
plugin contract.
"""

from kvcore.backend import Completion, TransferBackend, TransferJob
from kvcore.capabilities import (
    API_VERSION,
    Available,
    BackendSpec,
    Capabilities,
    HostMemory,
    IndexSpec,
    OpSupport,
    Residency,
    Unavailable,
    op_support,
)
from kvcore.controller import CacheEvent, HiCacheController, LoadHandle, WriteAck, WritePolicy
from kvcore.errors import KVCoreError
from kvcore.hookspecs import hookimpl
from kvcore.layout import Geometry, Kind, Layout, Op
from kvcore.plan import BoundPlan, Submission, TransferPlan, TransferRequest
from kvcore.pools import DevicePool, HostPool, SlotAllocator
from kvcore.registry import Registry, allocate_host_pool, default_registry, make_request

__version__ = "0.1.0"

__all__ = [
    "API_VERSION",
    "Available",
    "BackendSpec",
    "BoundPlan",
    "CacheEvent",
    "Capabilities",
    "Completion",
    "DevicePool",
    "Geometry",
    "HiCacheController",
    "HostMemory",
    "HostPool",
    "IndexSpec",
    "KVCoreError",
    "Kind",
    "Layout",
    "LoadHandle",
    "Op",
    "OpSupport",
    "Registry",
    "Residency",
    "SlotAllocator",
    "Submission",
    "TransferBackend",
    "TransferJob",
    "TransferPlan",
    "TransferRequest",
    "Unavailable",
    "WriteAck",
    "WritePolicy",
    "allocate_host_pool",
    "default_registry",
    "hookimpl",
    "make_request",
    "op_support",
]
