"""TransferPlan and BoundPlan: the one object that both places indices and runs.

:meth:`kvcore.registry.Registry.resolve` returns a :class:`TransferPlan` for a request: the
backend and its declared :class:`~kvcore.capabilities.OpSupport` variants.
:meth:`TransferPlan.bind` ties it to one pool pair: everything about a device pool and a host
pool is checked once (dtype, layer count, geometry, device, host memory the variant can
dereference, alignment, contiguous pages) and the variant that runs is fixed, since page bytes
and layer count are fixed by the pools. :meth:`BoundPlan.submit` then checks the indices that
are on the CPU, places both index tensors where that variant wants them and enqueues the whole
operation (all layers, one layer, or every layer of a per-layer load layer after layer or as
one signaled job) without waiting for the device. The controller, ``kvio bench``, the
conformance suite, the start-up verification and ``kvio replay`` all call it, so placement,
kernel choice and validation cannot disagree: there is no second place that decides them.

Index values on the CPU are checked before anything is enqueued. Device-resident index values
are never copied to the CPU to be checked (that would wait for the device): the backend must
not dereference an out-of-range one and reports it through the transfer's completion
(:meth:`Submission.check`), as the native kernels do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from kvcore.backend import TransferBackend, TransferJob, runner_for
from kvcore.capabilities import HostMemory, IndexSpec, OpSupport, Residency
from kvcore.errors import (
    BuildError,
    ContractViolation,
    InvalidArgument,
    InvalidIndices,
    KVCoreError,
    NoBackend,
    TensorMismatch,
)
from kvcore.layout import Kind, Layout, Op, page_block_contiguous, page_contiguous
from kvcore.placement import IndexRing, place, stream_key
from kvcore.pools import DevicePool, HostPool
from kvcore.signals import ENDS_WITH, WAIT_CURRENT
from kvcore.streams import Fence, current_stream, has_streams, on_stream, recorded_event
from kvcore.validate import (
    CheckedTensors,
    as_layer,
    check_cpu_indices,
    check_index_tensor,
    check_instance,
    check_layer,
    describe_tensor,
)


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


class Submission:
    """What one :meth:`BoundPlan.submit` enqueued.

    ``wait_layer(layer, stream)`` orders ``stream`` after one layer of a load (enqueues the
    wait and returns; a layer this submission did not move needs no wait). ``query()`` says
    without blocking whether everything enqueued has finished, ``synchronize()`` blocks
    until it has, and ``check()`` raises the transfer's failure (a
    :class:`~kvcore.errors.KVCoreError`) once it has finished. On a device without streams
    everything already ran when ``submit`` returned.
    """

    __slots__ = ("_done", "_layers", "_one", "_waits", "event")

    def __init__(self, waits: dict[int, Any], event: Any,
                 completions: list[tuple[int | None, Any]], one: Any = None,
                 layers: int = 0) -> None:
        self._waits = waits
        self.event = event
        self._done = completions  # (layer the completion belongs to, None: every layer)
        # the wait of layers [0, layers) where one object serves them all (then ``waits`` is
        # not consulted: no dict of every layer is built per submit)
        self._one = one
        self._layers = layers if one is not None else 0

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers a consumer can wait for (every layer of a load; none for a write)."""
        return tuple(range(self._layers)) if self._one is not None else tuple(self._waits)

    @property
    def completions(self) -> list[Any]:
        """What the backend returned for the jobs of this submission (None ones left out)."""
        return [c for _, c in self._done]

    def wait_layer(self, layer: int, stream: Any) -> None:
        """Make ``stream`` wait for layer ``layer`` (nothing for a layer this submission did
        not move); a layer that is not an int is refused with InvalidArgument."""
        if type(layer) is not int:
            layer = as_layer(layer)
        if self._one is not None:
            wait = self._one if 0 <= layer < self._layers else None
        else:
            wait = self._waits.get(layer)
        if wait is None or stream is None:
            return
        if hasattr(wait, "wait_layer"):  # LayerSignals (not isinstance: a Protocol check
            wait.wait_layer(layer, stream)  # costs microseconds per layer)
        else:
            stream.wait_event(wait)

    def current_waiter(self) -> Callable[[int], None] | None:
        """``wait(layer)``: :meth:`wait_layer` on the device's current stream, where every
        layer's wait can look that stream up itself (a backend's LayerSignals with
        ``wait_layer_current``: one call per layer instead of a stream lookup and a
        dispatch); else None."""
        one = self._one
        if one is None:
            waits = list(self._waits.values())
            if not waits or any(w is not waits[0] for w in waits):
                return None
            one = waits[0]
        fast = getattr(one, WAIT_CURRENT, None)
        return fast if callable(fast) else None

    def query(self) -> bool:
        """Whether everything the submission enqueued has finished (never blocks)."""
        return self.event is None or bool(self.event.query())

    def synchronize(self) -> None:
        """Block the host until everything the submission enqueued has finished."""
        if self.event is not None:
            self.event.synchronize()

    def check(self, layer: int | None = None) -> None:
        """Raise the failure of the whole submission, or with ``layer`` of the jobs that
        moved that layer (a job for every layer counts for each)."""
        if layer is not None:
            layer = as_layer(layer, "an int or None")
        for owner, c in self._done:
            if layer is None or owner is None or owner == layer:
                c.check()


class _Lane:
    """What a bound plan's submit looks up for one route (host and device indices each on the
    CPU or not): the variant that runs, its runner, whether that runner ``follows`` the
    caller's stream itself, and its IndexSpecs' facts for :meth:`fit`."""

    __slots__ = ("d_dtypes", "d_where", "follows", "h_dtypes", "h_where", "key", "run",
                 "support")

    def __init__(self, support: OpSupport, h_cpu: bool, d_cpu: bool,
                 runners: dict[int, Any], op: Op) -> None:
        self.support = support
        self.key = id(support)
        self.run = runners[self.key]
        # a write-back or all-layer runner that orders its transfer after the caller's stream
        # (it takes ``after``)
        self.follows = bool(getattr(self.run, "follows", False)) and op is not Op.LOAD_LAYER
        self.h_dtypes = frozenset(support.host_index.dtypes)
        self.d_dtypes = frozenset(support.device_index.dtypes)
        # whether a tensor on this route is where its spec wants it
        self.h_where = h_cpu is (support.host_index.residency is Residency.HOST)
        self.d_where = d_cpu is (support.device_index.residency is Residency.HOST)

    def fit(self, h: torch.Tensor, d: torch.Tensor, inline_host: int) -> tuple[bool, bool]:
        """Whether each tensor of a submit on this route already is where and how its
        IndexSpec wants it: a dtype it takes, contiguous, and on the CPU where it wants HOST,
        on the plan's device where it wants DEVICE (the tensors are a checked submit's, each
        on one or the other, so the route says which). Host indices count as placed too where
        they are contiguous CPU ones the runner takes in its launch (at most
        ``inline_host``; 0: it has no such form)."""
        h_placed = self.h_where and h.dtype in self.h_dtypes and h.is_contiguous()
        if not h_placed and inline_host and h.is_cpu and h.numel() <= inline_host \
                and h.is_contiguous():
            h_placed = True  # the runner copies them into its launch: nothing to upload
        return h_placed, self.d_where and d.dtype in self.d_dtypes and d.is_contiguous()


class BoundPlan:
    """A :class:`~kvcore.plan.TransferPlan` bound to ``device_pool`` and ``host_pool``.

    Construction raises a typed error for a pool the plan cannot serve, and builds the
    backend (a kernel that cannot be built fails here, not at the first transfer). The
    variant is the first declared one whose page window holds the pools' pages; where it wants
    an index on the CPU and the caller's is on the device, the first fitting variant that
    takes both on the device runs instead, so no call copies device indices back to wait for
    them (only a backend that declares no such variant makes a submit do that).
    """

    def __init__(self, plan: TransferPlan, device_pool: DevicePool, host_pool: HostPool) -> None:
        self.plan = plan
        self.device_pool = device_pool
        self.host_pool = host_pool
        check_instance("device_pool", device_pool, DevicePool, "a DevicePool", plan.context)
        check_instance("host_pool", host_pool, HostPool, "a HostPool", plan.context)
        self.op = plan.request.op
        self.device = device_pool.device
        _check_pools(plan, device_pool, host_pool)
        g = host_pool.geometry
        self.num_layers = g.num_layers
        page_bytes = plan.page_bytes(g.page_size, g.num_layers)
        self.support = plan.select(page_bytes)
        _check_support(plan, self.support, device_pool, host_pool)
        fitting = [v for v in plan.variants if v.fits_page(page_bytes)]
        on_device = [v for v in fitting if _wants(v, Residency.DEVICE)]
        self.device_support = on_device[0] if on_device else self.support
        if self.device_support is not self.support:
            _check_support(plan, self.device_support, device_pool, host_pool)
        self.backend: TransferBackend = _build(plan)
        self._host_size = g.size
        self._device_size = device_pool.size
        self._page_size = g.page_size
        self._context = plan.context  # (every check names it; built once)
        self._runners = {id(v): runner_for(self.backend, self._template(v))
                         for v in (self.support, self.device_support)}
        # variant -> how many CPU host indices its runner takes as they are (its library
        # carries them in the launch) where its spec wants them on the device (see _issue)
        self._inline_host = {key: int(getattr(run, "inline_host_tokens", 0))
                             for key, run in self._runners.items()}
        # [host indices on the CPU][device indices on the CPU] -> the variant that runs and
        # what a submit on that route looks up
        self._lanes = tuple(tuple(_Lane(self._route(h_cpu, d_cpu), h_cpu, d_cpu,
                                        self._runners, self.op)
                                  for d_cpu in (False, True)) for h_cpu in (False, True))
        self._whole = self.op is not Op.LOAD_LAYER  # every layer in one job
        self._load_all = self.op is Op.LOAD_ALL
        self._ring = IndexRing(self.device, upload=getattr(self.backend, "upload_indices",
                                                           None)) \
            if has_streams(self.device) else None
        self._fence = Fence(self.device)
        self._stream_seen: Any = None  # the last stream a submit was checked to run on
        # CPU index tensors this plan checked, while they hold the values checked (by role:
        # the bounds differ)
        self._checked_host = CheckedTensors(CHECKED_TENSORS)
        self._checked_device = CheckedTensors(CHECKED_TENSORS)

    @property
    def context(self) -> str:
        """``backend/layout op`` (its plan's :attr:`TransferPlan.context`), for error messages."""
        return self._context

    def check(self, host_indices: object, device_indices: object, layer: int | None = None,
              *, host_trusted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the index tensors without waiting for the device; return them typed.

        Always: type, dtype, rank, device, equal lengths and ``layer``. Values of tensors on
        the CPU: range, whole host pages, no duplicate destination (host slots for a
        write-back, device slots for a load). ``host_trusted`` skips the value checks of
        ``host_indices`` (the controller's own allocator made them). A CPU tensor this plan
        checked before and that holds the same values is not checked again
        (:class:`~kvcore.validate.CheckedTensors`): an engine that submits each layer of a
        load with the same tensors pays for the check once.
        """
        if layer is not None:
            self._check_layer(layer)
        h, d, _ = self._checked(host_indices, device_indices, host_trusted)
        return h, d

    def _checked(self, host_indices: object, device_indices: object, host_trusted: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[object, object]]:
        """:meth:`check` of the tensors alone, and for each tensor on the CPU that passed the
        value checks the proof of its values :class:`~kvcore.validate.CheckedTensors` keeps
        (it tells the index ring that a slot staged from them still holds them), else None."""
        ctx = self._context
        h, d = self._check_form(host_indices, device_indices)
        write = self.op is Op.WRITE_BACK
        h_proof = d_proof = None
        if h.is_cpu and not host_trusted:
            h_proof = self._checked_host.match(h)
            if h_proof is None:
                check_cpu_indices("host_indices", h, self._host_size, ctx,
                                  page_size=self._page_size, unique=write)
                h_proof = self._checked_host.add(h)
        if d.is_cpu:
            d_proof = self._checked_device.match(d)
            if d_proof is None:
                check_cpu_indices("device_indices", d, self._device_size, ctx,
                                  unique=not write, runs=self._page_size)
                d_proof = self._checked_device.add(d)
        return h, d, (h_proof, d_proof)

    def _check_form(self, host_indices: object, device_indices: object,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What any submit must hold whatever the caller vouches for (a kernel reads as many
        device indices as there are host indices): 1-D int32/int64 tensors of equal length,
        each on the CPU or the plan's device."""
        ctx = self._context
        h = check_index_tensor("host_indices", host_indices, ctx)
        d = check_index_tensor("device_indices", device_indices, ctx)
        if not h.is_cpu:
            self.check_where("host_indices", h)
        if not d.is_cpu:
            self.check_where("device_indices", d)
        if h.numel() != d.numel():
            raise InvalidIndices("device_indices", f"{h.numel()} entries (as many as "
                                  "host_indices)", f"{d.numel()}", ctx)
        return h, d

    def check_where(self, name: str, t: torch.Tensor) -> None:
        """TensorMismatch naming ``name`` unless index tensor ``t`` is on the CPU or this plan's
        device (a kernel would read another device's memory from here)."""
        if not t.is_cpu and t.device != self.device:
            where = "cpu" if self.device.type == "cpu" else f"cpu or {self.device}"
            raise TensorMismatch(name, f"a tensor on {where}", describe_tensor(t),
                                 self._context)

    def _check_layer(self, layer: object) -> int:
        if self.op is not Op.LOAD_LAYER:
            raise InvalidArgument("layer", f"None ({self.op.value} moves every layer)",
                                  repr(layer), self._context)
        return check_layer(layer, self.num_layers, self._context)

    def variant_for(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
                    ) -> OpSupport:
        """The variant a submit of these tensors runs: :attr:`support`, or
        :attr:`device_support` where the caller's indices are on the device and
        :attr:`support` wants one of them on the CPU."""
        h = check_index_tensor("host_indices", host_indices, self._context)
        d = check_index_tensor("device_indices", device_indices, self._context)
        return self._lanes[h.is_cpu][d.is_cpu].support

    def _route(self, h_cpu: bool, d_cpu: bool) -> OpSupport:
        s = self.support
        if ((not h_cpu and s.host_index.residency is Residency.HOST)
                or (not d_cpu and s.device_index.residency is Residency.HOST)):
            return self.device_support
        return s

    def place(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
              support: OpSupport | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Both tensors where ``support`` (default: the variant a submit of them would run)
        wants them, on the current stream. A caller that submits the same indices many times
        places them once; its submits then move nothing. Placing device-resident indices for
        :attr:`support` may copy them to the CPU, which waits for the device."""
        check_index_tensor("host_indices", host_indices, self._context)
        check_index_tensor("device_indices", device_indices, self._context)
        if support is None:
            support = self._lanes[host_indices.is_cpu][device_indices.is_cpu].support
        else:
            check_instance("support", support, OpSupport, "one of the plan's OpSupport",
                           self._context)
        return (place(host_indices, support.host_index, self.device),
                place(device_indices, support.device_index, self.device))

    def submit(self, host_indices: torch.Tensor, device_indices: torch.Tensor, *,
               layer: int | None = None, stream: Any = None, check: bool = True,
               host_trusted: bool = False, chained: bool = False,
               after: Any = None) -> Submission:
        """Check, place and enqueue the operation on ``stream`` (default: the device's
        current stream); never waits for the device.

        ``after``: another stream (the caller's, when ``stream`` is a transfer stream of its
        own) whose work enqueued so far the operation must follow. The upload of CPU indices
        through this plan's ring does not wait for it (it reads only memory the CPU wrote);
        the wait goes on ``stream`` before anything that reads a device tensor.

        For a per-layer load, ``layer`` None moves every layer: as one job where the variant
        has ``layer_signals``, else one job per layer; the returned submission can wait for
        each layer. An int moves that layer only (``chained``: the caller promises the work
        just before it on ``stream`` is another layer of the same load, see
        :class:`~kvcore.backend.TransferJob`). ``check=False`` skips the value checks (the
        caller already ran :meth:`check` on these tensors); their type, dtype, rank, device
        and lengths, and ``layer``, are checked either way.

        CPU indices the variant reads on the device are copied there through memory this
        plan reuses once the transfers that read it completed: on a stream of the plan's own
        where the backend offers ``upload_indices`` (``stream`` then waits for an event
        after the copies), else on ``stream``. ``stream`` and
        ``after`` must be streams of the plan's device; anything else is refused with
        InvalidArgument before anything is enqueued.
        """
        # checked whatever `check` says (it vouches for values; a kernel indexes by `layer`)
        if layer is not None and (type(layer) is not int or not 0 <= layer < self.num_layers
                                  or self.op is not Op.LOAD_LAYER):
            layer = self._check_layer(layer)
        proofs: tuple[object, object] = (None, None)
        if check:
            h, d, proofs = self._checked(host_indices, device_indices, host_trusted)
        else:
            h, d = self._check_form(host_indices, device_indices)
        if stream is not None and stream is not self._stream_seen:
            self._stream_seen = self._check_stream("stream", stream)
        if after is not None and after is not self._stream_seen:
            self._check_stream("after", after)
        return self._issue(h, d, layer, stream, chained, after, proofs)

    def _issue(self, h: torch.Tensor, d: torch.Tensor, layer: int | None, stream: Any,
               chained: bool = False, after: Any = None,
               proofs: tuple[object, object] = (None, None)) -> Submission:
        """:meth:`submit` of tensors, a layer and streams already checked (the
        controller's: it ran :meth:`check` itself, and its streams are its own and the
        device's current one). ``proofs``: see :meth:`_checked`."""
        lane, h_placed, d_placed = self._fit(h, d)
        support = lane.support
        s = stream if stream is not None else current_stream(self.device)
        if h_placed and d_placed:
            return self._enqueue(lane, h, d, layer, s, chained, after)
        segments: list[int] = []
        sub: Submission | None = None
        try:
            h, d, after = self._placed(support, h, d, h_placed, d_placed, s, after, segments,
                                       layer is not None, proofs)
            sub = self._enqueue(lane, h, d, layer, s, chained, after)
        finally:  # the ring's slots are free once what read them (or nothing) completed
            self._seal(segments, sub, s)
        assert sub is not None
        return sub

    def _fit(self, h: torch.Tensor, d: torch.Tensor) -> tuple[_Lane, bool, bool]:
        """The lane of checked tensors' route, and whether each tensor already goes to its
        runner as it is: where and how its IndexSpec wants it, or (host indices) few enough
        CPU ones for its launch."""
        lane = self._lanes[h.is_cpu][d.is_cpu]
        return (lane, *lane.fit(h, d, self._inline_host[lane.key]))

    def _placed(self, support: OpSupport, h: torch.Tensor, d: torch.Tensor, h_placed: bool,
                d_placed: bool, s: Any, after: Any, segments: list[int], again: bool,
                proofs: tuple[object, object] = (None, None),
                ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The tensors not yet placed (see :meth:`_fit`), placed for ``s``: CPU ones through
        the ring where it uploads on a stream of its own (their segments appended to
        ``segments``, which the caller seals after the work that reads them), else copied on
        ``s`` once it follows ``after`` (then returned as None: nothing more to order). ``s``
        then waits for the ring's uploads. ``again``: the same tensors may come back soon
        (one layer of a load)."""
        ring = self._ring
        if ring is not None and ring.upload is not None:  # no stream switch needed
            # CPU indices only: what they read the CPU wrote, so no need to follow `after`
            if not h_placed:
                h, h_placed = self._ring_stage(h, support.host_index, segments, s, again,
                                               proofs[0])
            if not d_placed:
                d, d_placed = self._ring_stage(d, support.device_index, segments, s, again,
                                               proofs[1])
        if not (h_placed and d_placed):
            if after is not None:  # before anything reads a tensor `after` may write
                self._fence.order(s, after)
                after = None
            with on_stream(s):  # copies and allocations are ordered on the stream
                if not h_placed:
                    h = self._place_on_stream(h, support.host_index, segments, s)
                if not d_placed:
                    d = self._place_on_stream(d, support.device_index, segments, s)
        if segments:  # copies on the ring's upload stream: ``s`` waits for them
            assert ring is not None
            ring.ready(s)
        return h, d, after

    def _seal(self, segments: list[int], sub: Submission | None, s: Any) -> None:
        """The ring's ``segments`` free once ``sub`` (the last work reading them; None: it
        was never enqueued) completed."""
        if segments:
            event = sub.event if sub is not None else recorded_event(self.device, s)
            assert self._ring is not None
            self._ring.seal(segments, event, stream_key(s))

    def _check_stream(self, name: str, stream: Any) -> Any:
        """``stream`` if it is a stream of this plan's device, else InvalidArgument naming
        ``name``: a kernel enqueued on another device's stream would read this device's
        memory from there."""
        on = getattr(stream, "device", None)
        if (not isinstance(on, torch.device) or on != self.device
                or not callable(getattr(stream, "wait_event", None))):
            came = f"{type(stream).__name__} on {on}" if isinstance(on, torch.device) \
                else f"{type(stream).__name__} {stream!r}"[:120]
            raise InvalidArgument(name, f"None or a stream of {self.device}", came,
                                  self._context)
        return stream

    def _ring_stage(self, t: torch.Tensor, spec: IndexSpec, segments: list[int],
                    stream: Any, again: bool = True, proof: object | None = None,
                    ) -> tuple[torch.Tensor, bool]:
        """``t`` copied to the device through the ring where ``spec`` wants it there and the
        ring can take it (then placed: True), else ``t`` itself (False). ``again``: ``t`` may
        be submitted again soon; ``proof``: what stands for its values (see
        :meth:`IndexRing.stage`)."""
        if (self._ring is not None and t.is_cpu and spec.residency is Residency.DEVICE
                and t.is_contiguous()):
            dtype = t.dtype if t.dtype in spec.dtypes else spec.dtypes[0]
            staged = self._ring.stage(t, dtype, stream, again, proof)
            if staged is not None:
                segments.append(staged[1])
                return staged[0], True
        return t, False

    def _place_on_stream(self, t: torch.Tensor, spec: IndexSpec, segments: list[int],
                         stream: Any) -> torch.Tensor:
        """``t`` (not yet where ``spec`` wants it) placed: through the ring where it can take
        it, else by :func:`place` on the current stream, which must be ``stream``."""
        staged, placed = self._ring_stage(t, spec, segments, stream)
        return staged if placed else place(t, spec, self.device)

    def _enqueue(self, lane: _Lane, hp: torch.Tensor, dp: torch.Tensor,
                 layer: int | None, s: Any, chained: bool, after: Any = None) -> Submission:
        """Run ``lane``'s runner on placed tensors; the submission of what it enqueued."""
        support, run = lane.support, lane.run
        follow: Callable[..., Any] = run  # (a runner that `follows` takes `after` too)
        if after is not None and not lane.follows:
            self._fence.order(s, after)
            after = None
        if self._whole:
            done = self._completion(support, run(hp, dp, None, s, False) if after is None
                                    else follow(hp, dp, None, s, False, after))
            # a transfer another thread issues is its own event (one recorded on the stream
            # now would come before its work)
            event = done if _issued_later(done) else recorded_event(self.device, s)
            return Submission({}, event, [] if done is None else [(None, done)],
                              one=event if self._load_all else None, layers=self.num_layers)
        if layer is not None:
            done = self._completion(support, run(hp, dp, layer, s, chained))
            event = recorded_event(self.device, s)
            return Submission({layer: event}, event,
                              [] if done is None else [(layer, done)])
        if support.layer_signals:
            signals = run(hp, dp, None, s, False)
            if not (hasattr(signals, "wait_layer") and hasattr(signals, "check")):
                raise ContractViolation(
                    f"{self.context}: variant {support.variant!r} declares layer_signals, "
                    "so a job for every layer must return LayerSignals (wait_layer, "
                    f"check); it returned {type(signals).__name__}")
            event = recorded_event(self.device, s)
            ends_with = getattr(signals, ENDS_WITH, None)
            if ends_with is not None and event is not None:
                ends_with(event)
            return Submission({}, event, [(None, signals)], one=signals,
                              layers=self.num_layers)
        waits: dict[int, Any] = {}
        completions: list[tuple[int | None, Any]] = []
        for n in range(self.num_layers):
            done = self._completion(support, run(hp, dp, n, s, n > 0))
            if done is not None:
                completions.append((n, done))
            waits[n] = recorded_event(self.device, s)
        return Submission(waits, waits[self.num_layers - 1], completions)

    def _completion(self, support: OpSupport, done: Any) -> Any:
        """What a runner returned, where it is None or a completion (has ``check()``), else
        ContractViolation naming the variant."""
        if done is None or hasattr(done, "check"):
            return done
        raise ContractViolation(
            f"{self.context}: the run() of variant {support.variant!r} returned "
            f"{type(done).__name__} ({done!r:.60}); expected None or a completion with "
            "check() (kvcore.backend.Completion; docs/writing-a-backend.md)")

    def _template(self, support: OpSupport) -> TransferJob:
        """The job every submit of ``support`` runs, but for its indices, layer, stream and
        chaining (see :func:`kvcore.backend.runner_for`)."""
        hp = self.host_pool
        none = torch.empty(0, dtype=torch.int64)
        return TransferJob(op=self.op, support=support, device_pool=self.device_pool,
                           host_buffer=hp.buffer, host_geometry=hp.geometry,
                           host_strides=hp.strides, host_indices=none, device_indices=none)


#: CPU index tensors a bound plan remembers as checked, per role (host, device)
CHECKED_TENSORS = 16


def issue_layers_across(plans: list[BoundPlan], h: torch.Tensor, d: torch.Tensor, stream: Any,
                        after: Any = None) -> list[Submission]:
    """A per-layer load of the same indices into every plan's pool pair (a pool group: the
    controller's ``members``), layer after layer across the plans, so layer 0 of every pair
    lands first (one signaled job per plan would hold back the next plan's). Indices and
    streams are checked already (:meth:`BoundPlan._issue`'s terms); the plans are bound for
    per-layer loads on one device.

    Each plan's indices are placed once for all its layers, as :meth:`BoundPlan.submit`
    places them (the ring where it uploads on its own stream, else copies on ``stream``
    after ``after``), and its ring's slots are held until the last layer completed. Returns
    one submission per layer and plan, in issue order."""
    first = plans[0]
    if stream is None:
        stream = current_stream(first.device)
    if after is not None:  # the layers read device pages `after` may still write
        first._fence.order(stream, after)
    # each plan's ring segments, sealed even where placing or issuing fails part way
    segments: list[list[int]] = [[] for _ in plans]
    placed: list[tuple[_Lane, torch.Tensor, torch.Tensor]] = []
    subs: list[Submission] = []
    try:
        for plan, taken in zip(plans, segments, strict=True):
            lane, h_placed, d_placed = plan._fit(h, d)
            hp, dp, _ = plan._placed(lane.support, h, d, h_placed, d_placed, stream, None,
                                     taken, False)
            placed.append((lane, hp, dp))
        for layer in range(first.num_layers):
            for i, (plan, (lane, hp, dp)) in enumerate(zip(plans, placed, strict=True)):
                subs.append(plan._enqueue(lane, hp, dp, layer, stream, layer + i > 0))
    finally:  # every slot is read until the last layer (or, failing, what was enqueued)
        last = subs[-1] if subs else None
        for plan, taken in zip(plans, segments, strict=True):
            plan._seal(taken, last, stream)
    return subs


def _issued_later(done: Any) -> bool:
    """Whether a runner's completion tells completion itself (a
    :class:`~kvcore.native_job.NativeJob`: a transfer another thread issues, where an event
    recorded on the stream now would come before its work, or one whose completion event the
    library recorded in the same call)."""
    return hasattr(done, "query") and hasattr(done, "synchronize")


def _wants(v: OpSupport, residency: Residency) -> bool:
    return v.host_index.residency is residency and v.device_index.residency is residency


def check_pool_pair(device_pool: DevicePool, host_pool: HostPool, name: str = "host_pool",
                    context: str = "") -> None:
    """The host pool holds what the device pool holds: kind, layers, heads, head_dim, page
    size and dtype, or TensorMismatch naming ``name.field``."""
    g = host_pool.geometry
    for field, dev_v, host_v in (("kind", device_pool.kind, g.kind),
                                 ("num_layers", device_pool.num_layers, g.num_layers),
                                 ("head_num", device_pool.head_num, g.head_num),
                                 ("head_dim", device_pool.head_dim, g.head_dim),
                                 ("page_size", device_pool.page_size, g.page_size),
                                 ("dtype", device_pool.dtype, host_pool.dtype)):
        if host_v != dev_v:
            raise TensorMismatch(f"{name}.{field}", f"{dev_v} (as the device pool)",
                                 str(host_v), context)


def _check_pools(plan: TransferPlan, device_pool: DevicePool, host_pool: HostPool) -> None:
    """Everything about the pool pair the plan must agree with, before any kernel sees it."""
    r = plan.request
    ctx = plan.context
    g = host_pool.geometry
    if device_pool.device != r.device:
        raise TensorMismatch("device_pool", f"tensors on {r.device} (the plan's device)",
                             str(device_pool.device), ctx)
    for field, planned, dev_v in (("dtype", r.dtype, device_pool.dtype),
                                  ("kind", r.kind, device_pool.kind)):
        if dev_v != planned:
            raise TensorMismatch(f"device_pool.{field}", f"{planned} (the plan's)", str(dev_v),
                                 ctx)
    check_pool_pair(device_pool, host_pool, "host_pool", ctx)
    if g.layout is not r.layout:
        raise TensorMismatch("host_pool.layout", f"{r.layout.value} (the plan's)",
                             g.layout.value, ctx)
    if device_pool.element_bytes != r.element_bytes:
        raise TensorMismatch("device_pool", f"elements of {r.element_bytes} B (the plan's)",
                             f"{device_pool.element_bytes} B", ctx)
    if plan.host_memory is HostMemory.PINNED and host_pool.memory is not HostMemory.PINNED:
        raise TensorMismatch("host_pool", f"pinned host memory for {ctx}",
                             f"{host_pool.memory.value} memory; allocate it with "
                             "kvcore.allocate_host_pool so the backend chooses the allocator")
    if (plan.host_memory is HostMemory.PINNED and has_streams(device_pool.device)
            and not host_pool.buffer.is_pinned()):
        raise TensorMismatch("host_pool.buffer", f"a pinned buffer for {ctx}",
                             "a buffer that is not pinned (its memory says pinned)")


def _check_support(plan: TransferPlan, support: OpSupport, device_pool: DevicePool,
                   host_pool: HostPool) -> None:
    """What the chosen variant asks of the pools: aligned data pointers, contiguous pages."""
    align = support.element_alignment
    named = [("host_pool.buffer", host_pool.buffer)] + [
        (f"device_pool layer {i}", t) for i, t in enumerate(device_pool.all_buffers())]
    for name, t in named:
        if t.data_ptr() % align:
            raise TensorMismatch(name, f"a data pointer aligned to {align} B for "
                                 f"{plan.context}", f"address {t.data_ptr():#x}")
    g = host_pool.geometry
    if support.contiguous_pages and not page_contiguous(g) and not (
            support.whole_pages and page_block_contiguous(g)):
        raise TensorMismatch("host_pool", f"contiguous host pages for {plan.context} "
                             f"variant {support.variant}", "a layout whose pages are split")


def _build(plan: TransferPlan) -> TransferBackend:
    """The plan's backend instance, built now so a kernel that cannot be built fails here."""
    try:
        return plan.instance()
    except KVCoreError:
        raise
    except Exception as exc:
        raise BuildError(f"backend {plan.backend_name!r} could not be built for "
                         f"{plan.request.device} ({plan.context}): "
                         f"{type(exc).__name__}: {exc}") from exc
