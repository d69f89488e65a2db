"""The hook bodies: SGLang's host-pool transfer methods, routed through kvcore.

Nothing here imports SGLang. A host pool is read by its attributes (SGLang 0.5.23's
``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost``), so the same functions run under
SGLang's plugin hooks (:mod:`kvcore_sglang.plugin`) and in ``scripts/gpu_sglang_check.py`` on a
machine without SGLang.

For each host pool the first call decides, once, whether kvcore models it. If it does, kvcore
pools are built around SGLang's own tensors (no copy), one plan per operation is resolved
through kvcore's registry (so the installed vendor backend wins) and every later call is one
call into kvcore (:func:`_transfer`). If it does not, every call goes to SGLang's original
method, and the reason is logged once. Decline, never guess.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch

from kvcore import DevicePool, HostMemory, HostPool, Kind, Layout, Op
from kvcore.errors import InvalidArgument, KVCoreError
from kvcore.layout import layouts_for
from kvcore.plan import BoundPlan, TransferPlan
from kvcore.registry import default_registry, make_request
from kvcore.streams import current_stream
from kvcore.validate import as_layer

logger = logging.getLogger("kvcore_sglang")

#: SGLang sets this attribute on host buffers it registered with cudaHostRegister
#: (``pool_host/common.py``: ``_CUDA_HOST_REGISTERED_RANGES_ATTR``); non-empty means registered.
SGLANG_REGISTERED_RANGES_ATTR = "_sglang_cuda_host_registered_ranges"

@attrs.frozen
class Decline:
    """kvcore does not model this pool or call; SGLang's original method runs."""

    reason: str
    #: how loudly it is logged: WARNING where the user asked for something that did not
    #: happen (a KVCORE_BACKEND that cannot serve the pool), else INFO
    level: int = logging.INFO


@attrs.frozen
class Routed:
    """kvcore pools around one SGLang host pool's tensors, and one plan per operation."""

    kind: Kind
    device_pool: DevicePool
    host_pool: HostPool
    plans: dict[Op, TransferPlan] = attrs.field(eq=False)
    bound: dict[Op, BoundPlan] = attrs.field(eq=False)

    def describe(self) -> str:
        g = self.host_pool.geometry
        ops = ", ".join(f"{op.value} -> {p.backend_name}" for op, p in self.plans.items())
        return (f"{g.kind.value}/{g.layout.value}, {g.num_layers} layers, page {g.page_size}, "
                f"{str(self.host_pool.dtype).removeprefix('torch.')}, host "
                f"{self.host_pool.memory.value} memory, device {self.device_pool.device}: {ops}")


# -- the one call into kvcore -------------------------------------------------------------------


def _transfer(routed: Routed, op: Op, host_indices: torch.Tensor, device_indices: torch.Tensor,
              layer: int | None = None) -> None:
    """Move one batch through kvcore on the stream SGLang made current: the plan bound to this
    pool pair checks what is on the CPU, places the indices where its variant wants them and
    enqueues, never waiting for the device. The only call into kvcore's transfer API in this
    package."""
    routed.bound[op].submit(host_indices, device_indices, layer=layer,
                            stream=current_stream(routed.device_pool.device))


# -- deciding, once per host pool ---------------------------------------------------------------

#: (id(host pool), kind) -> (weak reference to it, decision); keyed by identity, so a pool
#: class that defines __eq__ without __hash__ is cached too, and an entry leaves with its pool
_cache: dict[tuple[int, Kind], tuple[weakref.ref[Any], Routed | Decline]] = {}
_cache_lock = threading.Lock()
_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message in _logged:
        return
    _logged.add(message)
    logger.log(level, message)


def reset() -> None:
    """Forget every decision and logged message (tests)."""
    with _cache_lock:
        _cache.clear()
        _logged.clear()


def route_for(host: Any, kind: Kind) -> Routed | Decline:
    """The cached decision for ``host`` (an SGLang MHA or MLA host pool) as ``kind``. A
    decision to route holds while the pool keeps the host buffer it wrapped: once
    ``kv_buffer`` is another tensor or None (``destroy()``), the pool is decided again and
    no transfer goes to the buffer it let go."""
    key = (id(host), kind)
    with _cache_lock:
        entry = _cache.get(key)
        if entry is not None and entry[0]() is host:
            found = entry[1]
            if (not isinstance(found, Routed)
                    or getattr(host, "kv_buffer", None) is found.host_pool.buffer):
                return found
        found = _decide(host, kind)

        def forget(ref: weakref.ref[Any], key: tuple[int, Kind] = key) -> None:
            _forget(key, ref)
        try:
            ref = weakref.ref(host, forget)
        except TypeError:  # (a stand-in without __weakref__: its id could be reused)
            return Decline(f"{type(host).__name__} cannot be weakly referenced, and kvcore "
                           "caches its decision per pool only while the pool lives")
        _cache[key] = (ref, found)
        if isinstance(found, Routed):
            _log_once(logging.INFO, f"kvcore-sglang: {type(host).__name__} routed through "
                                    f"kvcore ({found.describe()})")
        return found


def _forget(key: tuple[int, Kind], ref: weakref.ref[Any]) -> None:
    # a GC callback: no lock (it may run while this thread holds it); dict ops are atomic
    entry = _cache.get(key)
    if entry is not None and entry[0] is ref:
        del _cache[key]


def _decide(host: Any, kind: Kind) -> Routed | Decline:
    try:
        why = _pool_refusal(host, kind)
        if why is not None:
            return Decline(why)
        device_pool, host_pool = _wrap(host, kind)
    except AttributeError as exc:  # another SGLang than the 0.5.23 this reads
        return Decline(f"{type(host).__name__} is not shaped as SGLang 0.5.23's: {exc}")
    except KVCoreError as exc:
        return Decline(f"kvcore cannot wrap the pool: {exc}")
    try:
        plans = _resolve(device_pool, host_pool)
    except KVCoreError as exc:
        forced = os.environ.get("KVCORE_BACKEND")
        if forced:
            return Decline(f"KVCORE_BACKEND={forced} cannot serve it: {exc}", logging.WARNING)
        if not default_registry().runnable(device_pool.device):  # on, yet moving nothing
            return Decline(f"no kvcore backend can run on {device_pool.device} (kvio backends "
                           f"says why): {exc}", logging.WARNING)
        return Decline(f"no kvcore backend serves it: {exc}")
    bound = {}
    for op, plan in plans.items():
        try:  # kvcore checks the pool pair once here: memory, alignment, contiguous pages
            bound[op] = plan.bind(device_pool, host_pool)
        except KVCoreError as exc:
            return Decline(f"backend {plan.backend_name!r} ({op.value}) refuses the pool: {exc}")
    return Routed(kind, device_pool, host_pool, plans, bound)


def _resolve(device_pool: DevicePool, host_pool: HostPool) -> dict[Op, TransferPlan]:
    """One plan per operation the hooks run, resolved through the registry."""
    g = host_pool.geometry
    reg = default_registry()
    plans = {}
    for op in (Op.WRITE_BACK, Op.LOAD_LAYER):
        req = make_request(op, g.kind, g.layout, host_pool.dtype, device_pool.element_bytes,
                           device_pool.device)
        plan = reg.resolve(req)
        plan.select(plan.page_bytes(g.page_size, g.num_layers))  # NoBackend if no window fits
        plans[op] = plan
    return plans


def _host_memory(buffer: torch.Tensor) -> HostMemory:
    """What SGLang's allocator made: registered after allocation (cudaHostRegister, marked by
    SGLang on the tensor), page-locked by torch, or plain pageable memory."""
    if getattr(buffer, SGLANG_REGISTERED_RANGES_ATTR, None):
        return HostMemory.REGISTERED
    return HostMemory.PINNED if buffer.is_pinned() else HostMemory.PLAIN


def _layout(host: Any, kind: Kind) -> Layout | str:
    """The kvcore layout of the pool, or why there is none for SGLang's ``kernel`` path."""
    name = getattr(host, "layout", None)
    # SGLang's kernel io path has no page_first_direct branch (it raises); the direct path
    # serves that layout, and io_backend 'direct' is declined before this. page_unified is
    # kvcore's, but its head groups are not read from SGLang's pool yet: not routed.
    unrouted = {Layout.PAGE_FIRST_DIRECT.value, Layout.PAGE_UNIFIED.value}
    known = {lay.value: lay for lay in layouts_for(kind) if lay.value not in unrouted}
    if name not in known:
        return f"host layout {name!r} (kvcore routes {kind.value} {', '.join(known)})"
    return known[name]


def _pool_refusal(host: Any, kind: Kind) -> str | None:
    """Why kvcore does not model this host pool (None when it does)."""
    name = type(host).__name__
    if getattr(host, "dcp_size", 1) != 1:
        return f"{name}: decode-context parallelism (dcp_size {host.dcp_size})"
    if getattr(host, "kv_buffer", None) is None:
        return f"{name}: no host buffer (allocator-only pool)"
    if not getattr(host, "device_rows_packed", True):
        return (f"{name}: strided device rows ({host.device_row_stride_bytes} B apart, rows "
                f"of {host.token_stride_size} B)")
    if host.layer_num != host.target_layer_num:
        return (f"{name}: packed draft layers ({host.layer_num - host.target_layer_num} "
                f"after {host.target_layer_num} target layers)")
    lay = _layout(host, kind)
    if not isinstance(lay, Layout):  # Layout is a str enum: test for it, not for str
        return f"{name}: {lay}"
    return _mha_refusal(host) if kind is Kind.MHA else _mla_refusal(host)


def _mha_refusal(host: Any) -> str | None:
    name = type(host).__name__
    if host.v_head_dim != host.head_dim:
        return f"{name}: K and V head dims differ ({host.head_dim} and {host.v_head_dim})"
    for info in getattr(host, "_buffer_infos", ()):
        if info.scales is not None:
            return f"{name}: KV scale buffers ({info.scales.layout.value})"
        if info.transfer_buffers is not None:
            return f"{name}: relocatable device buffers (transfer_buffers)"
        layout = getattr(info.buffers.layout, "value", info.buffers.layout)
        if layout != "nhd":
            return f"{name}: device KV buffer layout {layout!r} (kvcore models nhd rows)"
    return _device_rows(name, (*host.device_k_buffers, *host.device_v_buffers),
                        (host.head_num, host.head_dim), host.dtype, host.page_size)


def _mla_refusal(host: Any) -> str | None:
    name = type(host).__name__
    if getattr(host, "_native_buffers", None) is not None:
        return f"{name}: split native device buffers (MLASplitBuffers)"
    if getattr(host, "_layer_shard_enabled", False):
        return f"{name}: layer-sharded device pool"
    targets = tuple(getattr(host, "_target_layer_indices", ()))
    slots = getattr(host, "_device_layer_num", None)
    if targets != tuple(range(host.target_layer_num)) or slots != host.target_layer_num:
        return (f"{name}: device layer slots {targets} of {slots} are not the host's layers "
                f"0..{host.target_layer_num - 1}")
    return _device_rows(name, host.device_kv_buffers, (1, host.kv_cache_dim), host.dtype,
                        host.page_size)


def _device_rows(name: str, buffers: tuple[torch.Tensor, ...], row: tuple[int, int],
                 dtype: torch.dtype, page_size: int) -> str | None:
    if not buffers:
        return f"{name}: no device buffers"
    for i, t in enumerate(buffers):
        if t.dim() != 3 or tuple(t.shape[1:]) != row or t.dtype != dtype:
            return (f"{name}: device buffer {i} is {str(t.dtype).removeprefix('torch.')} "
                    f"{tuple(t.shape)}, the host pool expects rows {row} of "
                    f"{str(dtype).removeprefix('torch.')}")
        if not t.is_contiguous():
            return f"{name}: device buffer {i} is not contiguous (strides {t.stride()})"
        if t.shape[0] % page_size:
            return (f"{name}: device buffer {i} has {t.shape[0]} rows, not a whole number of "
                    f"pages of {page_size}")
    return None


def _wrap(host: Any, kind: Kind) -> tuple[DevicePool, HostPool]:
    """kvcore pools around SGLang's tensors, without copying."""
    layout = host.layout
    if kind is Kind.MHA:
        device_pool = DevicePool.wrap(Kind.MHA, list(host.device_k_buffers),
                                      list(host.device_v_buffers), page_size=host.page_size)
        head_num, head_dim = host.head_num, host.head_dim
    else:
        device_pool = DevicePool.wrap(Kind.MLA, list(host.device_kv_buffers),
                                      page_size=host.page_size)
        head_num, head_dim = 1, host.kv_cache_dim
    buffer = host.kv_buffer
    host_pool = HostPool.wrap(buffer, kind, layout, num_layers=host.layer_num,
                              head_num=head_num, head_dim=head_dim, page_size=host.page_size,
                              memory=_host_memory(buffer))
    return device_pool, host_pool


# -- the hook bodies ----------------------------------------------------------------------------


def backup_from_device_all_layer(original: Callable[..., Any], kind: Kind, host: Any,
                                 device_pool: Any, host_indices: torch.Tensor,
                                 device_indices: torch.Tensor, io_backend: str) -> Any:
    """SGLang's ``backup_from_device_all_layer`` (device -> host, every layer)."""
    route = _call_route(host, kind, io_backend)
    if isinstance(route, Decline):
        _log_once(route.level, f"kvcore-sglang: backup_from_device_all_layer runs SGLang's own "
                               f"kernel: {route.reason}")
        return original(host, device_pool, host_indices, device_indices, io_backend)
    _transfer(route, Op.WRITE_BACK, host_indices, device_indices)
    return None


def load_to_device_per_layer(original: Callable[..., Any], kind: Kind, host: Any,
                             device_pool: Any, host_indices: torch.Tensor,
                             device_indices: torch.Tensor, layer_id: int, io_backend: str,
                             *, is_draft: bool = False) -> Any:
    """SGLang's ``load_to_device_per_layer`` (host -> device, one layer). ``layer_id`` is an
    integer (a NumPy one or a 0-d tensor counts), else InvalidArgument naming it."""
    if type(layer_id) is not int:
        try:
            layer_id = as_layer(layer_id)
        except InvalidArgument:
            raise InvalidArgument("layer_id", "an int (a layer of the pool)",
                                  repr(layer_id)) from None
    route = _call_route(host, kind, io_backend)
    if isinstance(route, Decline) or is_draft or not _owns_layer(route, layer_id):
        level = logging.INFO
        if isinstance(route, Decline):
            reason, level = route.reason, route.level
        elif is_draft:
            reason = "draft layer load (is_draft=True)"
        else:
            reason = (f"layer {layer_id} is not one of the pool's layers [0, "
                      f"{route.host_pool.geometry.num_layers}) (SGLang skips it)")
        _log_once(level, f"kvcore-sglang: load_to_device_per_layer runs SGLang's own "
                         f"kernel: {reason}")
        return original(host, device_pool, host_indices, device_indices, layer_id, io_backend,
                        is_draft=is_draft)
    _transfer(route, Op.LOAD_LAYER, host_indices, device_indices, layer=layer_id)
    return None


def _call_route(host: Any, kind: Kind, io_backend: str) -> Routed | Decline:
    if io_backend != "kernel":
        return Decline(f"io_backend {io_backend!r} (kvcore routes 'kernel')")
    return route_for(host, kind)


def _owns_layer(route: Routed, layer_id: int) -> bool:
    return 0 <= layer_id < route.host_pool.geometry.num_layers
