"""HiCacheController: queues write-backs and per-layer loads between a device and a host pool.

Plans are resolved and checked against the real tensors at construction, so a wrong
combination fails at start-up, not at the first prefill. Transfers run on a dedicated write
stream and load stream where the device has streams (synchronously on CPU). A write is
acknowledged only after it completed; a failed transfer raises a typed error, releases the
host pages it took and is never acknowledged.

Write policies live in :mod:`kvcore.policy`, acks and load handles in :mod:`kvcore.handles`,
the queue of write-backs until their acknowledgement (across ranks too) in
:mod:`kvcore.write_queue`.

Example::

    ctl = HiCacheController(device_pool, host_pool)          # resolves the best backend
    w = ctl.write(device_indices)                            # host pages allocated here
    ctl.wait_acks()                                          # -> [WriteAck(...)]
    h = ctl.load(w.host_indices, new_device_indices)
    h.wait_layer(0)                                          # current stream waits for layer 0
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from kvcore.errors import (
    AllocatorError,
    ControllerUnusable,
    InvalidArgument,
    InvalidIndices,
    TensorMismatch,
    TransferFailed,
)
from kvcore.handles import LoadHandle, WriteAck
from kvcore.layout import Op, parse_enum
from kvcore.plan import (
    BoundPlan,
    Submission,
    TransferPlan,
    check_pool_pair,
    issue_layers_across,
)
from kvcore.policy import CacheEvent, WritePolicy, should_back_up
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import Registry, default_registry, make_request
from kvcore.streams import CurrentStream, new_stream, synchronize_quietly
from kvcore.validate import CheckedTensors, check_index_tensor, check_instance, is_int
from kvcore.write_queue import Health, WriteQueue


@attrs.frozen
class PoolPair:
    """One member of a pool group: a device pool and the host pool that backs it."""

    device: DevicePool
    host: HostPool


def _failing_together(init: Callable[..., None]) -> Callable[..., None]:
    """With a process group, an error before the plan exchange is published to the peers."""

    @functools.wraps(init)
    def wrapped(self: HiCacheController, *args: Any, **kwargs: Any) -> None:
        group = kwargs.get("process_group")
        if group is None:
            return init(self, *args, **kwargs)
        process_group_type = getattr(torch.distributed, "ProcessGroup", None)
        if process_group_type is not None and not isinstance(group, process_group_type):
            raise InvalidArgument("process_group", "a torch.distributed ProcessGroup or None",
                                  type(group).__name__)
        from kvcore.distributed import failing_together

        with failing_together(kwargs["process_group"]):
            return init(self, *args, **kwargs)

    return wrapped


class HiCacheController:
    """Moves KV pages between device pools and host pools with resolved transfer plans.

    Args:
        device_pool: the device pool (or the first member of a group, see ``members``).
        host_pool: the host pool backing it.
        write_policy: write_through, write_through_selective or write_back.
        backend: force a backend by name (else KVCORE_BACKEND, else priority order).
        members: extra (device_pool, host_pool) pairs of a pool group; each resolves its own
            plans and all share the first host pool's slot allocator.
        verify: run a one-page round trip against the reference backend at construction.
        process_group: a torch.distributed group whose ranks must resolve identical plans
            and acknowledge only writes completed on every rank (every rank must then call
            poll_acks() or wait_acks() in step).
        agreement_timeout_s: how long construction waits for the slowest rank's plans.
        ack_timeout_s: how long an acknowledgement round waits for the other ranks; a rank
            that does not take part in time fails it with RanksFailed naming that rank.
        registry: the registry to resolve in (default: the process-wide one).
    """

    @_failing_together
    def __init__(self, device_pool: DevicePool, host_pool: HostPool,
                 write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
                 backend: str | None = None, *,
                 members: Sequence[tuple[DevicePool, HostPool]] = (),
                 verify: bool = False, selective_threshold: int = 2,
                 process_group: Any = None, agreement_timeout_s: float = 60.0,
                 ack_timeout_s: float = 10.0, registry: Registry | None = None) -> None:
        self.write_policy = parse_enum(WritePolicy, write_policy, "write_policy")
        if not is_int(selective_threshold) or selective_threshold < 1:
            raise InvalidArgument("selective_threshold", "an int of at least 1",
                                  repr(selective_threshold))
        self.selective_threshold = int(selective_threshold)
        self.members = [_pair("", device_pool, host_pool), *_group(members)]
        check_instance("registry", registry, (Registry, type(None)), "a Registry or None")
        check_instance("backend", backend, (str, type(None)), "a backend name or None")
        self.registry = registry or default_registry()
        self.device = device_pool.device
        for i, m in enumerate(self.members):
            _check_pair(i, m, self.members[0])
        if len(self.members) > 1:
            _check_members_apart(self.members)
        self.plans: dict[tuple[int, Op], TransferPlan] = {}
        self.bound: dict[tuple[int, Op], BoundPlan] = {}
        for i, m in enumerate(self.members):
            for op in Op:
                plan = self.registry.resolve(make_request(
                    op, m.host.geometry.kind, m.host.geometry.layout, m.device.dtype,
                    m.device.element_bytes, m.device.device), backend)
                self.plans[(i, op)] = plan
                self.bound[(i, op)] = plan.bind(m.device, m.host)
        # member 0's plans of each call, looked up without hashing an Op (a Python call)
        self._write_plan = self.bound[(0, Op.WRITE_BACK)]
        self._load_plans = (self.bound[(0, Op.LOAD_LAYER)], self.bound[(0, Op.LOAD_ALL)])
        # the caller's stream on every submit, through the backend's handle lookup where it
        # has one (every member's plans run on this device)
        self._callers_stream = CurrentStream(self.device, getattr(
            self._write_plan.backend, "current_stream_handle", None))
        self.allocator = host_pool.allocator
        self.process_group = process_group
        if verify:
            from kvcore.verify import verify_plans

            verify_plans([(m.device, m.host) for m in self.members], self.plans,
                         self.registry)
        rounds = None
        if process_group is not None:
            from kvcore.distributed import AckAgreement, agree_on_plans

            agree_on_plans(self.plan_facts(), process_group, agreement_timeout_s)
            rounds = AckAgreement(process_group, ack_timeout_s)
        self.write_stream = new_stream(self.device)
        self.load_stream = new_stream(self.device)
        # host index tensors this controller's allocator made (an ack's) since pages were last
        # freed through any other tensor: handed back to load() or free_host() still holding
        # those values, their pages are allocated (no two of them share a page) and need no
        # check again
        self._issued = CheckedTensors()
        # what _issued held before that free: values still vouched for, but their pages may
        # have been freed and handed to a later ack, so they are checked on every use, and a
        # free through one of them may free a later ack's page
        self._issued_before = CheckedTensors()
        self._health = Health()
        self._writes = WriteQueue(self.allocator, self.write_stream, self._health, rounds)
        # one caller at a time: the allocator, the queue of pending writes and the streams'
        # order are shared state (threads may call in; each call holds this for microseconds)
        self._lock = threading.RLock()
        # dropped with transfers in flight, the pools' memory (and the plans' index rings) go
        # back to torch's allocators at once, ordered only on the streams they were made on:
        # a later tensor could get it while a transfer on our streams still reads or writes
        # it (a pointer table read back as another tensor's values: an illegal address)
        self._release = weakref.finalize(self, _quiesce, self._writes,
                                         (self.write_stream, self.load_stream))
        self._release.atexit = False  # (at exit the process drops the device as a whole)

    # -- introspection ---------------------------------------------------------------------

    def plan(self, op: Op | str, member: int = 0) -> TransferPlan:
        """The plan that runs ``op`` for pool-group member ``member``."""
        parsed = parse_enum(Op, op, "op")
        if not is_int(member) or not 0 <= member < len(self.members):
            raise InvalidArgument("member", f"an int in [0, {len(self.members)})",
                                  repr(member))
        return self.plans[(int(member), parsed)]

    def plan_facts(self) -> list[dict[str, object]]:
        """Every member's plans as plain data (what tensor-parallel ranks must agree on)."""
        return [dict(member=i, **p.describe()) for (i, _), p in sorted(
            self.plans.items(), key=lambda kv: (kv[0][0], kv[0][1].value))]

    @property
    def usable(self) -> bool:
        """False once a device fault or a lost process group made the controller unusable."""
        return self._health.lost is None

    @property
    def completed_writes(self) -> int:
        """Write-backs acknowledged so far."""
        return self._writes.completed

    # -- write-back ------------------------------------------------------------------------

    def write(self, device_indices: torch.Tensor,
              host_indices: torch.Tensor | None = None) -> WriteAck:
        """Queue a write-back of all layers of ``device_indices``; returns its pending ack.

        Host pages are allocated here unless ``host_indices`` is given: pages the caller
        took from :attr:`allocator` (a page that is not allocated is refused). The returned record
        is a promise: pages count as backed up only once :meth:`poll_acks` or
        :meth:`wait_acks` returns it.

        The copy reads the device pages as the caller's current stream leaves them at this
        call; the caller must not overwrite them before the acknowledgement. A backend may
        issue large write-backs from a thread of its own (kvio_cuda: 16 MiB and more), so a
        device synchronize does not mean the write completed: :meth:`wait_acks` does.
        """
        with self._lock:
            self._health.check()
            d = check_index_tensor("device_indices", device_indices, "write")
            owns = host_indices is None
            page_size = self.allocator.page_size
            if owns and d.numel() % page_size:
                raise InvalidIndices("device_indices", f"a length that is a multiple of "
                                     f"page_size {page_size} (host slots are allocated in "
                                     "whole pages)", f"{d.numel()} entries", "write")
            values = None
            if host_indices is not None:
                h = host_indices
                self._write_plan.check(h, d)
                self._check_allocated(h)
            else:
                try:
                    h, values = self.allocator.alloc_values(d.numel())
                except AllocatorError:
                    # a mistake in the call is named before a full pool (freeing pages would
                    # only lead to it): the device indices against slots that need no check
                    self._write_plan.check(
                        torch.zeros(d.numel(), dtype=torch.int64), d, host_trusted=True)
                    raise
                try:  # (our own host indices need no check: device ones on the CPU do)
                    if d.is_cpu:
                        self._write_plan.check(h, d, host_trusted=True)
                    else:
                        self._write_plan.check_where("device_indices", d)
                except BaseException:
                    self.allocator.free(h)
                    raise
            try:
                subs = self._submit(self._write_plan, self.write_stream, h, d)
            except BaseException as exc:
                if owns:
                    # an earlier pool-group member's copy may still be writing these slots
                    synchronize_quietly(self.write_stream)
                    self.allocator.free(h)
                raise self._failure("write-back", exc) from exc
            if values is not None:
                self._issued.add(h, values)
            return self._writes.add(h, d, subs[-1].event, subs, owns)

    def on_cache_event(self, event: CacheEvent | str, device_indices: torch.Tensor,
                       hits: int = 0) -> WriteAck | None:
        """Apply the write policy to a radix-cache event; queue a write-back if it says so."""
        ev = parse_enum(CacheEvent, event, "event")
        check_index_tensor("device_indices", device_indices, "on_cache_event")
        if not is_int(hits) or hits < 0:
            raise InvalidArgument("hits", "a non-negative int", repr(hits))
        if should_back_up(self.write_policy, ev, hits, self.selective_threshold):
            return self.write(device_indices)
        return None

    def poll_acks(self) -> list[WriteAck]:
        """Completed write-backs, in submission order, without blocking (see
        :mod:`kvcore.write_queue`; with a process group, every rank must call it in step)."""
        with self._lock:
            return self._writes.drain(block=False)

    def wait_acks(self) -> list[WriteAck]:
        """Block until every queued write-back completed; return their acks."""
        with self._lock:
            return self._writes.drain(block=True)

    @property
    def pending_writes(self) -> int:
        """Write-backs queued and not yet acknowledged."""
        return len(self._writes)

    def free_host(self, host_indices: torch.Tensor) -> None:
        """Release host pages (eviction from the host tier). An ack's ``host_indices``, still
        holding the values this controller's allocator gave them, are not value-checked again;
        any other tensor is (whole pages, in range, each once). A page that is not allocated,
        or that a write-back not yet acknowledged writes, is refused with AllocatorError and
        nothing freed. Pages freed through another tensor than the ack's (a copy, a
        concatenation, or an earlier ack's whose pages were freed that way and may since
        belong to a later ack) may be any ack's: from then on, loads of every earlier ack check
        its pages."""
        with self._lock:
            current = host_indices in self._issued
            # values the allocator made (it still refuses pages that are free)
            vouched = current or host_indices in self._issued_before
            self.allocator.free(host_indices, checked=vouched, name="host_indices",
                                in_use=self._writes.holding if len(self._writes) else None)
            if current:  # freed pages may be handed out again: its loads are checked again
                self._issued.discard(host_indices)
            else:  # the pages of any ack's tensor may be among them (this one's set is dropped)
                self._issued_before, self._issued = self._issued, CheckedTensors()

    # -- load ------------------------------------------------------------------------------

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
             all_layers: bool = False) -> LoadHandle:
        """Queue a load of host pages into ``device_indices``, layer by layer.

        Returns a handle whose ``wait_layer(i)`` orders the current stream after layer i.
        ``all_layers=True`` uses the all-layer (prefetch) operation: one event for all. Host
        pages that are not allocated (freed, or never handed out) are refused.
        """
        with self._lock:
            self._health.check()
            if type(all_layers) is not bool:
                raise InvalidArgument("all_layers", "a bool", repr(all_layers))
            issued = host_indices in self._issued
            # made by the allocator before another tensor freed pages: its values hold, but
            # its pages are checked (they may have been freed and handed to a later ack, so
            # it is never vouched for again: a free through it could free that ack's pages)
            before = not issued and host_indices in self._issued_before
            first = self._load_plans[all_layers]
            h, d = first.check(host_indices, device_indices, host_trusted=issued or before)
            if not issued:
                self._check_allocated(h)
            try:
                subs = self._submit(first, self.load_stream, h, d)
            except BaseException as exc:
                raise self._failure("load", exc) from exc
            return LoadHandle(subs, self.members[0].host.geometry.num_layers, self.device,
                              self._health.record)

    # -- internals -------------------------------------------------------------------------

    def _check_allocated(self, h: torch.Tensor) -> None:
        """Host indices (value-checked) name allocated pages only, else InvalidIndices. On
        the device their values are not read: that would wait for it."""
        if h.is_cpu:
            page = self.allocator.first_free_page(h, checked=True, name="host_indices")
            if page is not None:
                raise InvalidIndices("host_indices", "pages allocated from the host pool's "
                                     "allocator", f"{self.allocator.describe_page(page)}, "
                                     "which is free")

    def _submit(self, first: BoundPlan, stream: Any, h: torch.Tensor, d: torch.Tensor,
                ) -> list[Submission]:
        """Submit the op of ``first`` (member 0's plan) for every pool-group member on
        ``stream``, ordered after the caller's stream (indices already checked). Each
        member's bound plan decides how its layers go (one job, layer by layer, or
        signaled)."""
        op = first.op
        caller = None
        if stream is not None:
            caller = self._callers_stream()
            # the index tensors were made on the caller's stream and are used on ours: their
            # memory must not be reused before our work is done. A write's ack holds both
            # until its completion was seen (record_stream would cost a microsecond here and
            # an event at their free); a load's handle may be dropped at once.
            if op is not Op.WRITE_BACK:
                for t in (h, d):
                    if not t.is_cpu:
                        t.record_stream(stream)
        if len(self.members) == 1:
            return [first._issue(h, d, None, stream, after=caller)]
        members = range(len(self.members))
        if op is not Op.LOAD_LAYER:
            # each member's submit orders its transfer after the caller's stream (after its
            # index upload; a transfer a library thread issues records the point itself)
            subs: list[Submission] = []
            try:
                for i in members:
                    subs.append(self.bound[(i, op)]._issue(h, d, None, stream, after=caller))
            except BaseException:
                for sub in subs:  # what an earlier member queued must not outlive the call
                    synchronize_quietly(sub)
                raise
            return subs
        # a group's per-layer load goes layer by layer across members, its indices placed
        # once for all layers
        return issue_layers_across([self.bound[(i, op)] for i in members], h, d, stream,
                                   caller)

    def _failure(self, what: str, exc: BaseException) -> BaseException:
        if isinstance(exc, (InvalidArgument, ControllerUnusable)) or not isinstance(
                exc, Exception):
            return exc  # refused before anything ran, or not ours to wrap
        self._health.record(exc)
        if isinstance(exc, TransferFailed):
            return exc
        return TransferFailed(f"{what} failed: {type(exc).__name__}: {exc}", exc)


def _quiesce(writes: WriteQueue, streams: tuple[Any, ...]) -> None:
    """A dropped controller's release: return once nothing it queued still runs (its
    write-backs, a library thread's included, and whatever is on its streams). A fault
    while waiting is not raised: the controller is gone, and the next call on the device
    reports it."""
    writes.quiesce()
    for stream in streams:
        synchronize_quietly(stream)


def _pair(name: str, device_pool: object, host_pool: object) -> PoolPair:
    """A pool pair, or InvalidArgument naming the one that is not a pool (``name``: the
    member's prefix, "" for the constructor's own arguments)."""
    check_instance(f"{name}device_pool", device_pool, DevicePool, "a DevicePool")
    check_instance(f"{name}host_pool", host_pool, HostPool, "a HostPool")
    return PoolPair(device_pool, host_pool)  # type: ignore[arg-type]


def _group(members: object) -> list[PoolPair]:
    """The extra members, each a (DevicePool, HostPool) pair, named ``members[i]`` as the
    controller counts them (the first pair is member 0)."""
    if isinstance(members, (str, bytes)) or not isinstance(members, Sequence):
        raise InvalidArgument("members", "a sequence of (DevicePool, HostPool) pairs",
                              type(members).__name__)
    pairs = []
    for i, m in enumerate(members, start=1):
        if not isinstance(m, (tuple, list)) or len(m) != 2:
            raise InvalidArgument(f"members[{i}]", "a (DevicePool, HostPool) pair",
                                  type(m).__name__ if not isinstance(m, (tuple, list))
                                  else f"{len(m)} items")
        pairs.append(_pair(f"members[{i}].", *m))
    return pairs


def _check_pair(i: int, m: PoolPair, first: PoolPair) -> None:
    g, d = m.host.geometry, m.device
    check_pool_pair(d, m.host, f"members[{i}]" if i else "host_pool")
    if i:
        f = first.host.geometry
        if g.num_layers != f.num_layers:
            raise TensorMismatch(f"members[{i}].num_layers", f"{f.num_layers} (as the first "
                                 "member's: a per-layer load waits for layer i of every member)",
                                 str(g.num_layers))
        if (g.size, g.page_size) != (f.size, f.page_size) or d.size != first.device.size:
            raise TensorMismatch(f"members[{i}]", "host size, page size and device size equal "
                                 "to the first member's (they share one allocator)",
                                 f"host {g.size}/{g.page_size}, device {d.size}")
        if d.device != first.device.device:
            raise TensorMismatch(f"members[{i}].device", str(first.device.device), str(d.device))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) a tensor's elements occupy."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _check_members_apart(members: list[PoolPair]) -> None:
    """No two pool-group members share host or device memory: one member's write-back would
    overwrite another's host pages, and its load would fill the other's device pages."""
    for role, pools in (("host_pool", [[m.host.buffer] for m in members]),
                        ("device_pool", [m.device.all_buffers() for m in members])):
        spans = sorted((*_span(t), i) for i, ts in enumerate(pools) for t in ts
                       if t.data_ptr())  # (no address: storage-less, e.g. meta)
        reach = [0] * len(members)  # the furthest end of each member's spans so far
        for start, end, i in spans:
            for j, furthest in enumerate(reach):
                if j != i and furthest > start:
                    first, later = sorted((i, j))
                    raise InvalidArgument(
                        f"members[{later}].{role}" if later else role,
                        f"a {role} of its own (memory no other member uses)",
                        f"memory shared with {f'members[{first}].' if first else ''}{role}")
            reach[i] = max(reach[i], end)


__all__ = ["CacheEvent", "HiCacheController", "LoadHandle", "PoolPair", "WriteAck",
           "WritePolicy", "should_back_up"]
