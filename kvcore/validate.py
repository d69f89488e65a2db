"""Checks on index tensors and pools, run before any backend code sees them.

Every check raises a typed error naming the argument, what was expected and what came, and
changes nothing. Index values are checked on a CPU copy, so an out-of-range index never
reaches a kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcore.capabilities import INDEX_DTYPES
from kvcore.errors import InvalidArgument, InvalidIndices, TensorMismatch
from kvcore.layout import Op

if TYPE_CHECKING:
    from kvcore.plan import TransferPlan
    from kvcore.pools import DevicePool, HostPool


def describe_tensor(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on {t.device}"


def check_index_tensor(name: str, t: object, context: str = "") -> torch.Tensor:
    """A 1-D int32/int64 tensor, or TensorMismatch."""
    if not isinstance(t, torch.Tensor):
        raise TensorMismatch(name, "a 1-D int32 or int64 torch.Tensor", type(t).__name__, context)
    if t.dtype not in INDEX_DTYPES:
        raise TensorMismatch(name, "dtype int32 or int64", describe_tensor(t), context)
    if t.dim() != 1:
        raise TensorMismatch(name, "a 1-D tensor", describe_tensor(t), context)
    return t


def check_range(name: str, values: torch.Tensor, size: int, context: str = "") -> None:
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        raise InvalidIndices(name, f"values in [0, {size})", f"{bad}", context)


def check_pages(name: str, values: torch.Tensor, page_size: int, context: str = "") -> None:
    """Whole pages: each run of page_size starts at a multiple of it and counts up by one."""
    if values.numel() % page_size:
        raise InvalidIndices(name, f"a length that is a multiple of page_size {page_size}",
                             f"{values.numel()} entries", context)
    pages = values.view(-1, page_size)
    starts = pages[:, 0]
    misaligned = torch.nonzero(starts % page_size).flatten()
    if misaligned.numel():
        i = int(misaligned[0])
        raise InvalidIndices(name, f"page starts that are multiples of page_size {page_size}",
                             f"{int(starts[i])} at position {i * page_size}", context)
    offsets = pages - starts[:, None]
    ramp = torch.arange(page_size, dtype=values.dtype)
    broken = torch.nonzero((offsets != ramp).any(dim=1)).flatten()
    if broken.numel():
        i = int(broken[0])
        raise InvalidIndices(name, "consecutive tokens within each page",
                             f"page at position {i * page_size} = "
                             f"{pages[i, :4].tolist()}...", context)


def check_unique(name: str, values: torch.Tensor, context: str = "") -> None:
    if values.numel() < 2:
        return
    ordered = torch.sort(values).values
    dup = torch.nonzero(ordered[1:] == ordered[:-1]).flatten()
    if dup.numel():
        raise InvalidIndices(name, "no duplicate destination indices",
                             f"{int(ordered[int(dup[0])])} more than once", context)


def check_indices(plan: TransferPlan, device_pool: DevicePool, host_pool: HostPool,
                  host_indices: object, device_indices: object, layer: int | None) -> None:
    """Everything about a transfer's indices that can be wrong, checked before it runs."""
    ctx = plan.context
    h = check_index_tensor("host_indices", host_indices, ctx)
    d = check_index_tensor("device_indices", device_indices, ctx)
    for name, t in (("host_indices", h), ("device_indices", d)):
        if t.device.type != "cpu" and t.device != device_pool.device:
            raise TensorMismatch(name, f"a tensor on cpu or {device_pool.device}",
                                 describe_tensor(t), ctx)
    if h.numel() != d.numel():
        raise InvalidIndices("device_indices", f"{h.numel()} entries (as many as host_indices)",
                             f"{d.numel()}", ctx)
    op = plan.request.op
    if op is Op.LOAD_LAYER:
        n = host_pool.geometry.num_layers
        if not isinstance(layer, int) or not 0 <= layer < n:
            raise InvalidArgument("layer", f"an int in [0, {n})", repr(layer), ctx)
    hc, dc = h.cpu(), d.cpu()
    check_range("host_indices", hc, host_pool.geometry.size, ctx)
    check_range("device_indices", dc, device_pool.size, ctx)
    check_pages("host_indices", hc, host_pool.geometry.page_size, ctx)
    if op is Op.WRITE_BACK:
        check_unique("host_indices", hc, ctx)
    else:
        check_unique("device_indices", dc, ctx)
