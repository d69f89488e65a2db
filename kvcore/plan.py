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

from kvcore.backend import TransferBackend, TransferJob
from kvcore.capabilities import HostMemory, IndexSpec, OpSupport, Residency
from kvcore.errors import ContractViolation, NoBackend
from kvcore.layout import Kind, Layout, Op
from kvcore.signals import LayerSignals
from kvcore.validate import check_indices

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
class PlacedIndices:
    """Indices moved to where ``support`` wants them, plus the variant that will run."""

    support: OpSupport
    host: torch.Tensor
    device: torch.Tensor


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

    def place(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
              page_bytes: int) -> PlacedIndices:
        """Move both index tensors to the residency and dtype of the selected variant."""
        support = self.select(page_bytes)
        return PlacedIndices(
            support=support,
            host=_place(host_indices, support.host_index, self.request.device),
            device=_place(device_indices, support.device_index, self.request.device),
        )

    def transfer(self, device_pool: DevicePool, host_pool: HostPool,
                 host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None = None, stream: Any = None, check: bool = True) -> Any:
        """Validate, place and run. Index values are checked before any backend code runs.

        Returns what the backend's ``run`` returned: None, or a completion object whose
        ``check()`` raises if the transfer failed asynchronously.
        """
        if check:
            check_indices(self, device_pool, host_pool, host_indices, device_indices, layer)
        placed = self.place_for(host_pool, host_indices, device_indices)
        return self.run(placed, device_pool, host_pool, layer=layer, stream=stream)

    def place_for(self, host_pool: HostPool, host_indices: torch.Tensor,
                  device_indices: torch.Tensor) -> PlacedIndices:
        """:meth:`place` with the variant that serves ``host_pool``'s pages."""
        g = host_pool.geometry
        return self.place(host_indices, device_indices, self.page_bytes(g.page_size,
                                                                        g.num_layers))

    def run(self, placed: PlacedIndices, device_pool: DevicePool, host_pool: HostPool,
            layer: int | None = None, stream: Any = None, chained: bool = False) -> Any:
        """Hand the backend a job carrying the variant that placed the indices; ``chained``
        as :class:`~kvcore.backend.TransferJob` defines it (only a caller that enqueued the
        preceding job itself can promise it)."""
        backend: TransferBackend = self.instance()
        return backend.run(TransferJob(
            op=self.request.op, support=placed.support, device_pool=device_pool,
            host_buffer=host_pool.buffer, host_geometry=host_pool.geometry,
            host_strides=host_pool.strides, host_indices=placed.host,
            device_indices=placed.device, layer=layer, stream=stream, chained=chained))

    def run_signaled(self, placed: PlacedIndices, device_pool: DevicePool, host_pool: HostPool,
                     stream: Any = None) -> LayerSignals:
        """A per-layer load of every layer as one job, on a ``layer_signals`` variant; returns
        the backend's :class:`~kvcore.signals.LayerSignals` (ContractViolation if it returned
        anything else)."""
        signals = self.run(placed, device_pool, host_pool, layer=None, stream=stream)
        if not isinstance(signals, LayerSignals):
            raise ContractViolation(
                f"{self.context}: variant {placed.support.variant!r} declares layer_signals, "
                f"so a job for every layer must return LayerSignals (wait_layer, check); it "
                f"returned {type(signals).__name__}")
        return signals

    def run_layers(self, placed: PlacedIndices, device_pool: DevicePool, host_pool: HostPool,
                   stream: Any = None) -> list[Any]:
        """Run the whole op as the controller issues it: one call; for a per-layer load one
        call per layer with every call after the first ``chained``, or one call for every
        layer where the variant has ``layer_signals``. Returns the completions the backend
        returned (None ones left out; the LayerSignals of a signaled load)."""
        if self.request.op is Op.LOAD_LAYER and placed.support.layer_signals:
            return [self.run_signaled(placed, device_pool, host_pool, stream)]
        layers: list[int | None] = (list(range(host_pool.geometry.num_layers))
                                    if self.request.op is Op.LOAD_LAYER else [None])
        done = [self.run(placed, device_pool, host_pool, layer=layer, stream=stream,
                         chained=n > 0) for n, layer in enumerate(layers)]
        return [c for c in done if c is not None]

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


def residency_device(residency: Residency, device: torch.device) -> torch.device:
    """The torch device a residency means for a pool on ``device``."""
    return torch.device("cpu") if residency is Residency.HOST else device


def _place(indices: torch.Tensor, spec: IndexSpec, device: torch.device) -> torch.Tensor:
    target = residency_device(spec.residency, device)
    dtype = indices.dtype if indices.dtype in spec.dtypes else spec.dtypes[0]
    if indices.device == target and indices.dtype == dtype and indices.is_contiguous():
        return indices
    return indices.to(device=target, dtype=dtype).contiguous()
