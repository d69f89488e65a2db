"""TransferPlan: the one object that both places indices and runs the operation.

A plan is what :meth:`kvcore.registry.Registry.resolve` returns for a request. For each call
it selects one declared :class:`~kvcore.capabilities.OpSupport` variant, moves the index
tensors to the residency and dtype that variant declares, and hands the backend a job
carrying that same variant. Placement and execution therefore cannot disagree: there is no
second place that decides where indices live.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kvcore.bound import BoundPlan, Submission
from kvcore.capabilities import HostMemory, OpSupport
from kvcore.errors import NoBackend
from kvcore.layout import Kind, Layout, Op

if TYPE_CHECKING:
    from kvcore.pools import DevicePool, HostPool


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class TransferRequest:
    """What a caller wants to move: the key of resolution."""

    op: Op
    kind: Kind
    layout: Layout
    dtype: torch.dtype
    element_bytes: int
    device: torch.device

    def __str__(self) -> str:
        return (f"{self.op.value} {self.kind.value}/{self.layout.value} "
                f"{dtype_name(self.dtype)} element {self.element_bytes} B on {self.device}")


@attrs.frozen
class TransferPlan:
    """A resolved backend for one request; see the module docstring."""

    request: TransferRequest
    backend_name: str
    backend_version: str
    host_memory: HostMemory
    variants: tuple[OpSupport, ...]
    instance: Callable[[], Any] = attrs.field(eq=False, repr=False)

    @property
    def context(self) -> str:
        """``backend/layout op``, for error messages."""
        r = self.request
        return f"{self.backend_name}/{r.layout.value} {r.op.value}"

    def page_bytes(self, page_size: int, num_layers: int) -> int:
        """Bytes of one page of K (or V) over the layers this op moves."""
        layers = 1 if self.request.op is Op.LOAD_LAYER else num_layers
        return page_size * self.request.element_bytes * layers

    def select(self, page_bytes: int) -> OpSupport:
        """The variant that serves pages of ``page_bytes`` (first declared that fits)."""
        for v in self.variants:
            if v.fits_page(page_bytes):
                return v
        windows = ", ".join(f"{v.variant}: [{v.min_page_bytes}, {v.max_page_bytes})"
                            for v in self.variants)
        raise NoBackend(f"{self.request} with pages of {page_bytes} B",
                        {self.backend_name: f"no variant's page window fits ({windows})"})

    def bind(self, device_pool: DevicePool, host_pool: HostPool) -> BoundPlan:
        """This plan bound to one pool pair: everything about the pools is checked here, once,
        and the variant that will run is fixed (see :class:`BoundPlan`)."""
        return BoundPlan(self, device_pool, host_pool)

    def transfer(self, device_pool: DevicePool, host_pool: HostPool,
                 host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None = None, stream: Any = None) -> Submission:
        """Bind to the pools and submit once: ``self.bind(...).submit(...)``. A caller that
        moves more than once between the same pools keeps the bound plan instead."""
        return self.bind(device_pool, host_pool).submit(host_indices, device_indices,
                                                        layer=layer, stream=stream)

    def describe(self) -> dict[str, object]:
        """Plain facts about the plan, for agreement checks across ranks and for reports."""
        from kvcore.capabilities import API_VERSION

        return {
            "backend": self.backend_name,
            "backend_version": self.backend_version,
            "api_version": API_VERSION,
            "op": self.request.op.value,
            "kind": self.request.kind.value,
            "layout": self.request.layout.value,
            "dtype": dtype_name(self.request.dtype),
            "element_bytes": self.request.element_bytes,
            "variants": [
                {"variant": v.variant,
                 "host_index": f"{v.host_index.residency.value}:"
                               f"{dtype_name(v.host_index.dtypes[0])}",
                 "device_index": f"{v.device_index.residency.value}:"
                                 f"{dtype_name(v.device_index.dtypes[0])}",
                 "staging_bytes": v.staging_bytes,
                 "layer_signals": v.layer_signals,
                 "page_window": [v.min_page_bytes, v.max_page_bytes]}
                for v in self.variants
            ],
        }
