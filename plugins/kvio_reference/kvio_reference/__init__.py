"""kvio_reference: the pure-torch oracle backend. Every op, kind and layout, on any device.

This module holds only the static registration; the implementation is in
:mod:`kvio_reference.backend` and is imported when a plan first needs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import kvcore
from kvcore.backend import TransferBackend
from kvcore.capabilities import (
    API_VERSION,
    Available,
    BackendSpec,
    Capabilities,
    HostMemory,
    Residency,
    op_support,
)
from kvcore.layout import Kind, Layout, Op

__version__ = "0.1.0"


def _probe() -> Available:
    return Available(f"pure torch {torch.__version__}")


def _ops() -> tuple:
    # Host indices index the host view on the CPU; device indices index the device tensors.
    return tuple(
        op_support(op, (Kind.MHA, Kind.MLA), tuple(Layout), Residency.HOST, Residency.DEVICE)
        for op in Op
    )


CAPABILITIES = Capabilities(
    name="reference",
    version=__version__,
    api_version=API_VERSION,
    platform="any",
    priority=0,
    probe=_probe,
    ops=_ops(),
    host_memory=HostMemory.PLAIN,
    device_types=None,
    description="pure torch oracle: simple, obviously right, any device",
)


def _factory(device: torch.device) -> TransferBackend:
    from kvio_reference.backend import ReferenceBackend

    return ReferenceBackend(device)


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(capabilities=CAPABILITIES, factory=_factory))
