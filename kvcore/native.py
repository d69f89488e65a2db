"""Glue shared by backends that implement the native C ABI of docs/native-abi.md.

Vendor-neutral: it turns a :class:`~kvcore.backend.TransferJob` into the ABI's arguments
(pointers, byte strides, index dtypes) and calls a loaded library object. The vendor plugins
(kvio_cuda, kvio_rocm) supply the library, the stream handle and the host allocator.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch

from kvcore.backend import Runner, TransferJob, job_runner
from kvcore.capabilities import HostMemory, IndexSpec, OpSupport, Residency, op_support
from kvcore.errors import InvalidArgument, InvalidIndices, TransferFailed
from kvcore.layout import ByteStrides, Kind, Layout, Op, contiguous_page_layouts, layouts_for
from kvcore.native_abi import (
    REPORT_BYTES,
    REPORT_DEVICE_EPOCH,
    REPORT_DEVICE_VALUE,
    REPORT_HOST_EPOCH,
    REPORT_HOST_VALUE,
    KvioBounds,
    KvioLayout,
    inline_index_limit,
    make_layout,
)
from kvcore.native_job import NativeJob, flush_at_exit
from kvcore.signals import EventLayerSignals, LayerSignals
from kvcore.streams import (
    CurrentStream,
    Fence,
    current_stream,
    has_streams,
    native_handle,
    on_stream,
    recorded_event,
)

DEVICE_TO_HOST = 0
HOST_TO_DEVICE = 1

#: default device staging budget of a staged write-back (pages beyond it go in chunks)
DEFAULT_STAGING_BYTES = 64 << 20


class NativeLibrary(Protocol):
    """What the vendor's ctypes binding offers (see docs/native-abi.md)."""

    def transfer_direct(self, direction: int, k_ptrs: int, v_ptrs: int, layer_begin: int,
                        layer_count: int, host_base: int, layout: Any, host_idx: int,
                        host_idx_64: int, dev_idx: int, dev_idx_64: int, n_tokens: int,
                        stream: int, chained: bool = False,
                        bounds: KvioBounds | None = None) -> None: ...

    def write_back_staged(self, k_ptrs: int, v_ptrs: int, num_layers: int, host_base: int,
                          layout: Any, host_idx_cpu: int, dev_idx: int, dev_idx_64: int,
                          n_tokens: int, staging: int, staging_bytes: int, use_batched: int,
                          stream: int, bounds: KvioBounds | None = None) -> None: ...

    def load_all_staged(self, k_ptrs: int, v_ptrs: int, num_layers: int, host_base: int,
                        layout: Any, host_idx_cpu: int, dev_idx: int, dev_idx_64: int,
                        n_tokens: int, staging: int, staging_bytes: int, use_batched: int,
                        stream: int, bounds: KvioBounds | None = None) -> None: ...

    def load_layer_dma(self, k_dst: int, v_dst: int, layer: int, host_base: int, layout: Any,
                       host_idx_cpu: int, dev_idx_cpu: int, n_tokens: int, use_batched: int,
                       stream: int, bounds: KvioBounds | None = None) -> None: ...

    def has_layer_signals(self) -> bool: ...

    def load_layers_signaled(self, k_ptrs: int, v_ptrs: int, num_layers: int, host_base: int,
                             layout: Any, host_idx: int, host_idx_64: int, dev_idx: int,
                             dev_idx_64: int, n_tokens: int, counters: int, flags: int,
                             epoch: int, stream: int,
                             bounds: KvioBounds | None = None) -> None: ...

    def wait_layer_signal(self, flag: int, epoch: int, stream: int) -> None: ...


def layout_fields(s: ByteStrides) -> dict[str, int]:
    """The kvio_layout struct's fields, from kvcore.layout's byte strides."""
    return {
        "kv_stride": s.kv_stride, "layer_stride": s.layer_stride, "page_stride": s.page_stride,
        "token_stride": s.token_stride, "chunk_stride": s.chunk_stride,
        "page_size": s.page_size, "chunk_bytes": s.chunk_bytes, "num_chunks": s.num_chunks,
    }


def is_64(t: torch.Tensor) -> int:
    return 1 if t.dtype == torch.int64 else 0


class NativeBackend:
    """Runs jobs through a native library; a subclass builds the library."""

    #: the variant name that selects the staged write-back and all-layer load
    STAGED = "staged"
    #: the variant name that selects the copy-engine per-layer load
    DMA = "dma"
    #: the variant name of the per-layer load that moves every layer in one launch
    SIGNALED = "signaled"

    def __init__(self, device: torch.device, library: NativeLibrary,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, use_batched: bool = True) -> None:
        self.device = device
        self.lib = library
        self.staging_bytes = staging_bytes
        self.use_batched = use_batched
        self._staging: dict[int, torch.Tensor] = {}
        self._layouts: dict[ByteStrides, KvioLayout] = {}
        self._signals: dict[int, SignalBuffer] = {}
        self._retired_signals: list[SignalBuffer] = []  # outgrown; a wait may still read one
        self._signal_lock = threading.Lock()
        self._has_signals: bool | None = None
        self._report_ring: ReportRing | None = None
        self._layout_by_id: dict[int, tuple[ByteStrides, KvioLayout]] = {}
        self._groups: dict[tuple[Any, ...], int] = {}
        #: ``wait_signal(flag, epoch, raw_stream)``: the library's wait, without the checks of
        #: its method where the library offers that (on every ``wait_layer``; ctypes passes
        #: a raw handle of 0 as NULL, the legacy default stream)
        self.wait_signal: Callable[[int, int, int], None] = (
            self.optional_unchecked("kvio_wait_layer_signal") or library.wait_layer_signal)
        copy = self.optional_unchecked("kvio_copy_to_device")
        if copy is not None:
            raw = self.raw_stream

            def upload_indices(dst: int, src: int, nbytes: int, stream: Any) -> None:
                copy(dst, src, nbytes, raw(stream) or None)

            #: the index ring's upload through the library (kvcore.placement.Upload): one
            #: runtime call instead of torch's copy dispatch and a stream switch
            self.upload_indices = upload_indices

    def optional_unchecked(self, function: str, last: Callable[[], Any] | None = None,
                           ) -> Callable[..., None] | None:
        """The library's optional ``function`` without per-call checks
        (:meth:`~kvcore.native_abi.NativeLibrary.unchecked`, ``last`` passed on where given),
        or None where the library does not export it or offers no unchecked calls."""
        lib = self.lib
        if not (hasattr(lib, "unchecked") and function in getattr(lib, "optional", ())):
            return None
        return lib.unchecked(function) if last is None else lib.unchecked(function, last=last)

    def raw_stream(self, stream: Any) -> int:
        """The runtime's handle of a torch stream (0: the legacy default stream)."""
        return native_handle(stream)

    #: a lookup of the raw handle of the device's current stream that builds no stream
    #: object (:class:`kvcore.streams.CurrentStream`), where the plugin has one
    current_stream_handle: Callable[[], int] | None = None

    @functools.cached_property
    def callers_stream(self) -> CurrentStream:
        """The device's current stream as an object, reused while it stays current (through
        :attr:`current_stream_handle`, see :class:`~kvcore.streams.CurrentStream`)."""
        return CurrentStream(self.device, self.current_stream_handle)

    def current_raw_stream(self) -> int:
        """The raw handle of the device's current stream (a subclass may look it up faster;
        this is on every ``wait_layer``)."""
        return self.raw_stream(current_stream(self.device))

    def stream_handle(self, stream: Any) -> int:
        """The raw handle of ``stream``, or of the device's current stream when None."""
        return self.raw_stream(stream if stream is not None else current_stream(self.device))

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        """Pinned memory from torch's allocator (cudaHostAlloc / hipHostMalloc): its device
        address equals its host address, which is what the kernels dereference. Memory
        registered after allocation maps at another device address and is never used."""
        return torch.empty(shape, dtype=dtype, pin_memory=True), HostMemory.PINNED

    def staging(self, stream: int) -> torch.Tensor:
        """The staging buffer of ``stream``: one per stream, so streams never share one."""
        if stream not in self._staging:
            self._staging[stream] = torch.empty(self.staging_bytes, dtype=torch.uint8,
                                                device=self.device)
        return self._staging[stream]

    def run(self, job: TransferJob) -> BoundsCompletion | LayerSignals | None:
        pool = job.device_pool
        if pool.device != self.device:
            raise InvalidArgument("device_pool", f"tensors on {self.device}", str(pool.device))
        layout = self._layout(job.host_strides)
        k_ptrs = pool.k_ptrs.data_ptr()
        v_ptrs = pool.v_ptrs.data_ptr() if pool.v_ptrs is not None else 0
        stream = self.stream_handle(job.stream)
        h, d = job.host_indices, job.device_indices
        host_base = job.host_buffer.data_ptr()
        done = self._reports().completion(job)
        bounds = done.bounds
        if job.op is Op.LOAD_LAYER and job.layer is None:
            return self._load_signaled(job, k_ptrs, v_ptrs, host_base, layout, stream, done)
        if job.support.variant == self.STAGED:
            if job.op is Op.LOAD_LAYER:
                raise InvalidArgument("job.support", "a per-layer load variant other than "
                                      "staged (the native ABI stages whole pages only)",
                                      job.support.variant)
            staging = self.staging(stream)
            staged = (self.lib.write_back_staged if job.op is Op.WRITE_BACK
                      else self.lib.load_all_staged)
            staged(
                k_ptrs, v_ptrs, job.host_geometry.num_layers, host_base, layout, h.data_ptr(),
                d.data_ptr(), is_64(d), h.numel(), staging.data_ptr(), staging.numel(),
                int(self.use_batched), stream, bounds=bounds)
            return done
        if job.op is Op.LOAD_LAYER and job.support.variant == self.DMA:
            layer = job.layers.start
            v_dst = pool.layers(1)[layer].data_ptr() if pool.v_ptrs is not None else 0
            self.lib.load_layer_dma(pool.layers(0)[layer].data_ptr(), v_dst, layer, host_base,
                                    layout, h.data_ptr(), d.data_ptr(), h.numel(),
                                    int(self.use_batched), stream, bounds=bounds)
            return None  # CPU indices: the library refuses a bad one before enqueueing
        layers = job.layers
        direction = DEVICE_TO_HOST if job.op is Op.WRITE_BACK else HOST_TO_DEVICE
        self.lib.transfer_direct(direction, k_ptrs, v_ptrs, layers.start, len(layers),
                                 host_base, layout, h.data_ptr(), is_64(h), d.data_ptr(),
                                 is_64(d), h.numel(), stream, chained=job.chained,
                                 bounds=bounds)
        return done

    def prepare(self, job: TransferJob) -> Runner:
        """A runner for jobs like ``job`` (see :func:`kvcore.backend.runner_for`): the
        pointers, layout, bounds sizes and library functions are resolved here once, so a
        submit costs one ctypes call and the report slot. The arguments it passes are those
        :meth:`run` passes through the library's checked methods (a library object without
        ``unchecked`` gets :meth:`run` itself)."""
        unchecked = getattr(self.lib, "unchecked", None)
        pool = job.device_pool
        if unchecked is None or pool.device != self.device:
            return job_runner(self.run, job)
        op, variant = job.op, job.support.variant
        k_ptrs = pool.k_ptrs.data_ptr() or None
        v_ptrs = (pool.v_ptrs.data_ptr() or None) if pool.v_ptrs is not None else None
        host_base = job.host_buffer.data_ptr() or None
        layout = self._layout(job.host_strides)
        num_layers = job.host_geometry.num_layers
        issue = self._reports().issue
        host_tokens, device_tokens = job.host_geometry.size, pool.size
        raw = self.stream_handle
        int64 = torch.int64

        if op is not Op.LOAD_LAYER and variant == self.STAGED:
            staged = unchecked("kvio_write_back_staged" if op is Op.WRITE_BACK
                               else "kvio_load_all_staged")
            staging_of, batched = self.staging, int(self.use_batched)

            def run_staged(h: torch.Tensor, d: torch.Tensor, layer: int | None, stream: Any,
                           chained: bool) -> BoundsCompletion:
                s = raw(stream)
                done = issue(host_tokens, device_tokens, op)
                staging = staging_of(s)
                staged(k_ptrs, v_ptrs, num_layers, host_base, layout, h.data_ptr() or None,
                       d.data_ptr() or None, 1 if d.dtype is int64 else 0, h.numel(),
                       staging.data_ptr(), staging.numel(), batched, s or None, done.bounds)
                return done

            if op is Op.WRITE_BACK and self._async_write_back():
                return self._staged_async_runner(job, run_staged, k_ptrs, v_ptrs, host_base,
                                                 layout)
            return run_staged
        dma = (self.optional_unchecked("kvio_load_layer_dma")
               if op is Op.LOAD_LAYER and variant == self.DMA else None)
        if dma is not None:
            return self._dma_runner(job, dma, host_base, layout)
        if op is Op.LOAD_LAYER and variant in (self.STAGED, self.DMA):
            return job_runner(self.run, job)  # refused, or one copy-engine call per layer
        run_direct = self._direct_runner(job, k_ptrs, v_ptrs, host_base, layout)
        if op is Op.WRITE_BACK:
            return self._direct_after_runner(job, run_direct, k_ptrs, v_ptrs, host_base, layout)
        if not (op is Op.LOAD_LAYER and job.support.layer_signals):
            return run_direct
        return self._signaled_runner(job, run_direct, k_ptrs, v_ptrs, host_base, layout)

    def _direct_runner(self, job: TransferJob, k_ptrs: int | None, v_ptrs: int | None,
                       host_base: int | None, layout: KvioLayout) -> Runner:
        """The direct kernel's runner for jobs like ``job`` (one launch for every layer, or
        for one): ``kvio_transfer_direct``, its chained form, or its inline form for host
        indices on the CPU, as many as ``inline_host_tokens`` (an attribute of the runner where
        the library has the inline form; more are refused before any call)."""
        unchecked = self.lib.unchecked  # type: ignore[attr-defined]
        op, pool = job.op, job.device_pool
        num_layers = job.host_geometry.num_layers
        issue, raw, int64 = self._reports().issue, self.stream_handle, torch.int64
        host_tokens, device_tokens = job.host_geometry.size, pool.size
        direction = DEVICE_TO_HOST if op is Op.WRITE_BACK else HOST_TO_DEVICE
        plain = unchecked("kvio_transfer_direct")
        chained_fn = self.optional_unchecked("kvio_transfer_direct_chained") or plain
        # CPU host indices where the library carries them in its launch (as many as
        # inline_index_limit allows for a grid of every layer, or of one); a pool on the CPU
        # (an emulated library) takes CPU indices as its own
        off_cpu = pool.device.type != "cpu"
        inline_fn = self.optional_unchecked("kvio_transfer_direct_inline") if off_cpu else None
        layer_bytes = layout.chunk_bytes * layout.num_chunks * (2 if v_ptrs else 1)
        inline_one = inline_index_limit(layout.page_size, layer_bytes)
        inline_all = inline_index_limit(layout.page_size, layer_bytes * num_layers)

        def run_direct(h: torch.Tensor, d: torch.Tensor, layer: int | None, stream: Any,
                       chained: bool) -> BoundsCompletion:
            fn = chained_fn if chained else plain
            if h.is_cpu and off_cpu:
                limit = 0 if inline_fn is None else inline_all if layer is None else inline_one
                if h.numel() > limit:
                    raise _cpu_host_indices(h, layer, limit)
                fn = inline_fn
            done = issue(host_tokens, device_tokens, op)
            first, count = (0, num_layers) if layer is None else (layer, 1)
            fn(direction, k_ptrs, v_ptrs, first, count, host_base, layout,
               h.data_ptr() or None, 1 if h.dtype is int64 else 0, d.data_ptr() or None,
               1 if d.dtype is int64 else 0, h.numel(), raw(stream) or None, done.bounds)
            return done

        if inline_fn is not None:
            run_direct.inline_host_tokens = (  # type: ignore[attr-defined]
                inline_one if op is Op.LOAD_LAYER else inline_all)  # (a layer per call)
        return run_direct

    def _direct_after_runner(self, job: TransferJob, run_direct: Runner, k_ptrs: int | None,
                             v_ptrs: int | None, host_base: int | None,
                             layout: KvioLayout) -> Runner:
        """The direct write-back's runner for transfers ordered after another stream
        (``after``: the controller's caller), where the library has
        ``kvio_transfer_direct_after``: the library records the order point, launches the
        kernel and records its completion (three runtime calls, against three torch event
        calls around ``run_direct``), and the job it hands out is the completion. Without
        ``after``, or without the function, ``run_direct`` (then not ``follows``: the plan
        fences)."""
        lib = self.lib
        if not (self._offers("has_direct_after") and hasattr(lib, "unchecked")):
            return run_direct
        after_fn = lib.unchecked("kvio_transfer_direct_after")
        inline_tokens: int | None = getattr(run_direct, "inline_host_tokens", None)
        pool = job.device_pool
        off_cpu = pool.device.type != "cpu"
        num_layers = job.host_geometry.num_layers
        issue, raw, int64 = self._reports().issue, self.stream_handle, torch.int64
        host_tokens, device_tokens, op = job.host_geometry.size, pool.size, job.op

        def run_after(h: torch.Tensor, d: torch.Tensor, layer: int | None, stream: Any,
                      chained: bool, after: Any = None) -> NativeJob | BoundsCompletion:
            if after is None or layer is not None:
                return run_direct(h, d, layer, stream, chained)
            host_inline = h.is_cpu and off_cpu
            if host_inline and (inline_tokens is None or h.numel() > inline_tokens):
                raise _cpu_host_indices(h, layer, inline_tokens or 0)
            done = issue(host_tokens, device_tokens, op)
            out = ctypes.c_void_p()
            after_fn(DEVICE_TO_HOST, k_ptrs, v_ptrs, 0, num_layers, host_base, layout,
                     h.data_ptr() or None, 1 if h.dtype is int64 else 0, d.data_ptr() or None,
                     1 if d.dtype is int64 else 0, h.numel(), 1 if host_inline else 0,
                     raw(stream) or None, raw(after) or None, done.bounds, ctypes.byref(out))
            return NativeJob(lib, out.value or 0, done, (h, d), "kvio_transfer_direct_after")

        run_after.follows = True  # type: ignore[attr-defined]
        if inline_tokens is not None:
            run_after.inline_host_tokens = inline_tokens  # type: ignore[attr-defined]
        return run_after

    def _signaled_runner(self, job: TransferJob, run_direct: Runner, k_ptrs: int | None,
                         v_ptrs: int | None, host_base: int | None,
                         layout: KvioLayout) -> Runner:
        """The signaled per-layer load's runner: every layer in one launch, each raising its
        ready flag (one layer at a time: ``run_direct``; without the library's signals: one
        launch per layer)."""
        op, pool = job.op, job.device_pool
        num_layers = job.host_geometry.num_layers
        issue, raw, int64 = self._reports().issue, self.stream_handle, torch.int64
        host_tokens, device_tokens = job.host_geometry.size, pool.size
        off_cpu = pool.device.type != "cpu"
        direct_inline = hasattr(run_direct, "inline_host_tokens")  # the library's inline form
        layer_bytes = layout.chunk_bytes * layout.num_chunks * (2 if v_ptrs else 1)
        inline_one = inline_index_limit(layout.page_size, layer_bytes)
        by_layer = job_runner(self.run, job)
        signaled = self.optional_unchecked("kvio_load_layers_signaled")
        inline = self.optional_unchecked("kvio_load_layers_signaled_inline") \
            if signaled is not None and off_cpu else None
        groups: dict[int, int] = {}  # tokens per load -> layers that land together

        def run_signaled(h: torch.Tensor, d: torch.Tensor, layer: int | None, stream: Any,
                         chained: bool) -> BoundsCompletion | LayerSignals:
            if layer is not None:
                return run_direct(h, d, layer, stream, chained)
            signals = signaled is not None and self._layer_signals()
            host_inline = h.is_cpu and off_cpu
            if host_inline and not (signals and inline is not None
                                    and h.numel() <= inline_one):
                raise _cpu_host_indices(h, layer, inline_one if signals and inline else 0)
            if not signals:
                return by_layer(h, d, layer, stream, chained)  # one launch per layer
            assert signaled is not None  # (signals says so)
            s = raw(stream)
            done = issue(host_tokens, device_tokens, op)
            n = h.numel()
            group = groups.get(n)
            if group is None:  # this runner's front of layer_group's cache (no key tuple)
                group = groups[n] = self.layer_group(k_ptrs, v_ptrs, num_layers, host_base,
                                                     layout, n)
            args = (k_ptrs, v_ptrs, num_layers, host_base, layout, h.data_ptr() or None,
                    1 if h.dtype is int64 else 0, d.data_ptr() or None,
                    1 if d.dtype is int64 else 0, n)
            # host indices on the CPU: only a bound plan's, within inline_host_tokens
            launch = inline if host_inline else signaled
            assert launch is not None
            with self._signal_lock:  # epochs reach the stream in the order they are handed out
                buf = self._signal_buffer(s, num_layers, stream)
                epoch = buf.next_epoch()
                launch(*args, buf.counters or None, buf.flags or None, epoch, s or None,
                       done.bounds)
            return NativeLayerSignals(self, buf, epoch, done, group, num_layers)

        if inline is not None and direct_inline and self._layer_signals():
            run_signaled.inline_host_tokens = inline_one  # type: ignore[attr-defined]
        return run_signaled

    def _dma_runner(self, job: TransferJob, dma: Callable[..., None], host_base: int | None,
                    layout: KvioLayout) -> Runner:
        """The copy-engine per-layer load's runner: one unchecked ``kvio_load_layer_dma`` per
        layer, with the layer tensors' addresses looked up once (a load of every layer makes
        one call per layer, so what :meth:`run` repeats per call is paid num_layers times)."""
        pool = job.device_pool
        k_dst = [t.data_ptr() or None for t in pool.layers(0)]
        v_dst = ([t.data_ptr() or None for t in pool.layers(1)] if pool.v_ptrs is not None
                 else [None] * len(k_dst))
        issue, raw, batched = self._reports().issue, self.stream_handle, int(self.use_batched)
        host_tokens, device_tokens, op = job.host_geometry.size, pool.size, job.op
        every_layer = job_runner(self.run, job)

        def run_dma(h: torch.Tensor, d: torch.Tensor, layer: int | None, stream: Any,
                    chained: bool) -> None:
            if layer is None:
                return every_layer(h, d, layer, stream, chained)
            bounds = issue(host_tokens, device_tokens, op).bounds
            dma(k_dst[layer], v_dst[layer], layer, host_base, layout, h.data_ptr() or None,
                d.data_ptr() or None, h.numel(), batched, raw(stream) or None, bounds)
            return None  # CPU indices: the library refuses a bad one before enqueueing

        return run_dma

    def _async_write_back(self) -> bool:
        """Whether the controller's large staged write-backs go to the library's thread:
        :func:`write_back_mode` says so and the library exports the thread's functions."""
        return write_back_mode() == "1" and self._offers("has_async_write_back")

    def _offers(self, query: str) -> bool:
        """Whether the library answers its optional ``query`` (a ``has_...`` method) yes."""
        has = getattr(self.lib, query, None)
        return has is not None and bool(has())

    def _staged_async_runner(self, job: TransferJob, run_staged: Runner, k_ptrs: int | None,
                             v_ptrs: int | None, host_base: int | None,
                             layout: KvioLayout) -> Runner:
        """The staged write-back runner for transfers ordered after another stream (``after``:
        the controller's caller), which it orders itself (``follows``), so a bound plan
        passes that stream instead of fencing. One of at least
        :data:`ASYNC_WRITE_BACK_MIN_BYTES` goes to the library's thread
        (``kvio_write_back_staged_async``: the caller pays for the checks and the handover,
        the thread for the runtime calls); a smaller one is issued here through
        ``kvio_write_back_staged_after`` where the library has it (its host copy overlaps the
        next write-back's gather), else after a fence through ``run_staged``. Either returns
        a :class:`NativeJob` that tells its completion. One of at most
        :data:`DIRECT_WRITE_BACK_MAX_BYTES` goes through the direct kernel with its host
        indices in the launch, where the library has that form and they fit it (ordered after
        ``after`` by the library where it has ``kvio_transfer_direct_after``, else by a
        fence).
        Without ``after`` (the plan API: the transfer must be on ``stream`` in stream order
        when the submit returns) ``run_staged`` (the synchronous runner) enqueues it."""
        lib = self.lib
        unchecked = lib.unchecked  # type: ignore[attr-defined]
        handed = unchecked("kvio_write_back_staged_async")
        overlapped = self.optional_unchecked("kvio_write_back_staged_after")
        flush_at_exit(lib)
        issue, raw, staging_of = self._reports().issue, self.stream_handle, self.staging
        num_layers, batched = job.host_geometry.num_layers, int(self.use_batched)
        host_tokens, device_tokens, op = job.host_geometry.size, job.device_pool.size, job.op
        int64 = torch.int64
        pool = job.device_pool
        token_bytes = (2 if pool.v_ptrs is not None else 1) * num_layers * pool.element_bytes
        handed_from = -(-ASYNC_WRITE_BACK_MIN_BYTES // token_bytes)  # tokens
        fence = Fence(self.device)
        run_direct, direct_upto = run_staged, -1  # tokens
        if pool.device.type != "cpu" and "kvio_transfer_direct_inline" in getattr(
                lib, "optional", ()):
            run_direct = self._direct_after_runner(
                job, self._direct_runner(job, k_ptrs, v_ptrs, host_base, layout), k_ptrs,
                v_ptrs, host_base, layout)
            direct_upto = min(DIRECT_WRITE_BACK_MAX_BYTES // token_bytes,
                              run_direct.inline_host_tokens)  # type: ignore[attr-defined]
        direct_follows = getattr(run_direct, "follows", False)
        follow_direct: Callable[..., NativeJob] = run_direct  # (it takes `after` too)

        def run_staged_async(h: torch.Tensor, d: torch.Tensor, layer: int | None,
                             stream: Any, chained: bool,
                             after: Any = None) -> NativeJob | BoundsCompletion:
            if after is None:
                return run_staged(h, d, layer, stream, chained)
            n = h.numel()
            if n <= direct_upto:
                if direct_follows:
                    return follow_direct(h, d, layer, stream, chained, after)
                fence.order(stream, after)
                return run_direct(h, d, layer, stream, chained)
            if n >= handed_from:
                call, function = handed, "kvio_write_back_staged_async"
            elif overlapped is not None:
                call, function = overlapped, "kvio_write_back_staged_after"
            else:  # small, and no overlapped form: issued here, after the caller's stream
                fence.order(stream, after)
                return run_staged(h, d, layer, stream, chained)
            s = raw(stream)
            done = issue(host_tokens, device_tokens, op)
            staging = staging_of(s)
            out = ctypes.c_void_p()
            call(k_ptrs, v_ptrs, num_layers, host_base, layout, h.data_ptr() or None,
                 d.data_ptr() or None, 1 if d.dtype is int64 else 0, n,
                 staging.data_ptr(), staging.numel(), batched, s or None, raw(after) or None,
                 done.bounds, ctypes.byref(out))
            return NativeJob(lib, out.value or 0, done, (h, d, staging), function)

        run_staged_async.follows = True  # type: ignore[attr-defined]
        return run_staged_async

    def _layout(self, strides: ByteStrides) -> KvioLayout:
        """One validated C struct per host pool geometry, not per call; looked up by the
        strides object first (hashing its eight fields on every call cost microseconds)."""
        hit = self._layout_by_id.get(id(strides))
        if hit is not None and hit[0] is strides:
            return hit[1]
        layout = self._layouts.get(strides)
        if layout is None:
            layout = self._layouts[strides] = make_layout(layout_fields(strides))
        self._layout_by_id[id(strides)] = (strides, layout)
        return layout

    def _reports(self) -> ReportRing:
        if self._report_ring is None:
            self._report_ring = ReportRing.of(self.device)
        return self._report_ring

    def _load_signaled(self, job: TransferJob, k_ptrs: int, v_ptrs: int, host_base: int,
                       layout: KvioLayout, stream: int,
                       done: BoundsCompletion) -> LayerSignals:
        """Every layer of a per-layer load in one launch, each layer raising its own flag.
        Where the library cannot (``has_layer_signals`` false) the layers go one launch each
        with an event after each, which is what the caller would have done."""
        if not job.support.layer_signals:
            raise InvalidArgument("job.layer", f"a layer (variant {job.support.variant!r} has "
                                  "no layer_signals)", "None")
        h, d = job.host_indices, job.device_indices
        num_layers = job.host_geometry.num_layers
        if not self._layer_signals():  # each layer's job as the plan would have issued it
            events, completions = [], []
            for layer in range(num_layers):
                completions.append(self.run(attrs.evolve(job, layer=layer, chained=layer > 0)))
                events.append(recorded_event(self.device, job.stream))
            return EventLayerSignals(events, [c for c in completions if c is not None])
        group = self.layer_group(k_ptrs, v_ptrs or None, num_layers, host_base, layout,
                                 h.numel())
        with self._signal_lock:  # epochs reach the stream in the order they are handed out
            buf = self._signal_buffer(stream, num_layers, job.stream)
            epoch = buf.next_epoch()
            self.lib.load_layers_signaled(k_ptrs, v_ptrs, num_layers, host_base, layout,
                                          h.data_ptr(), is_64(h), d.data_ptr(), is_64(d),
                                          h.numel(), buf.counters, buf.flags, epoch, stream,
                                          bounds=done.bounds)
        return NativeLayerSignals(self, buf, epoch, done, group, num_layers)

    def layer_group(self, k_ptrs: int | None, v_ptrs: int | None, num_layers: int,
                    host_base: int | None, layout: KvioLayout, n_tokens: int) -> int:
        """How many consecutive layers of a signaled load of these arguments land together
        (the library's ``signaled_layer_group``; 1 where it has none): one ``wait_layer`` per
        such group and stream is enough. Asked once per distinct arguments."""
        key = (k_ptrs, v_ptrs, num_layers, host_base, id(layout), n_tokens)
        group = self._groups.get(key)
        if group is None:
            query = getattr(self.lib, "signaled_layer_group", None)
            group = 1 if query is None or n_tokens <= 0 else int(query(
                k_ptrs or 0, v_ptrs, num_layers, host_base or 0, layout, n_tokens,
                self.stream_handle(None) or None))
            self._groups[key] = group
        return group

    def _layer_signals(self) -> bool:
        """Whether the library can run a signaled load (asked once)."""
        if self._has_signals is None:
            self._has_signals = bool(self.lib.has_layer_signals())
        return self._has_signals

    def _signal_buffer(self, stream: int, num_layers: int,
                       torch_stream: Any = None) -> SignalBuffer:
        """The signal memory of ``stream`` (one per stream, as the staging buffers), at least
        ``num_layers`` layers large. An outgrown one is kept: waits may still read it."""
        buf = self._signals.get(stream)
        if buf is None or buf.capacity < num_layers:
            if buf is not None:
                self._retired_signals.append(buf)
            with on_stream(torch_stream):
                buf = self._signals[stream] = SignalBuffer(self.device, max(num_layers, 128))
        return buf


def _cpu_host_indices(h: torch.Tensor, layer: int | None, limit: int) -> InvalidArgument:
    """The refusal of CPU host indices a runner cannot pass to its library as they are
    (``limit``: how many it could, 0 where its library carries none in its launch)."""
    return InvalidArgument("host_indices", "device-resident indices (on the CPU: at most "
                           f"{limit} here, for a library that carries them in its launch)",
                           f"{h.numel()} on the CPU (layer {layer})")


class SignalBuffer:
    """The signal memory of the signaled loads of one stream: ``capacity`` tile counters in
    device memory (zero; each load leaves them zero), ``capacity`` ready flags (flag
    l: every layer of l's group has landed) and the epoch the last load raised them to.
    Loads on one stream run in order, so the flags only grow (cyclically, as the wait
    compares them); epoch 0 is the fresh memory's and never handed out first.

    The flags live in pinned host memory where the device has streams: the kernels publish
    them with a system-scope store, the stream-side wait reads them where they are, and the
    host reads them too (``landed``) without a round trip to the device, so a ``wait_layer``
    for a layer that has already landed enqueues nothing. Without streams (an emulated
    library on the CPU) they are plain memory that the library writes."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.capacity = capacity
        # a tile counter per group of layers (zero before the first load; the library leaves
        # them zero after each)
        self.counter_memory = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.flag_memory = torch.zeros(capacity, dtype=torch.int32,
                                       pin_memory=has_streams(device))
        self.counters = self.counter_memory.data_ptr()
        self.flags = self.flag_memory.data_ptr()
        #: the flags as the host reads them, unsigned as the epochs (a memoryview: indexing
        #: one gives an int without NumPy's scalar, on every ``wait_layer``)
        self.landed = self.flag_memory.numpy().data.cast("B").cast("I")
        self.epoch = 0

    def next_epoch(self) -> int:
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF
        return self.epoch

    def has_landed(self, layer: int, epoch: int) -> bool:
        """Whether flag ``layer`` has reached ``epoch`` (the stream-side wait's cyclic
        compare: at most 2**31 epochs ahead counts as reached)."""
        return (self.landed[layer] - epoch) & 0xFFFFFFFF < 0x80000000


class NativeLayerSignals:
    """The LayerSignals of one signaled load: the layers land ``group`` at a time (one wave of
    the kernel's grid), and flag l reaches ``epoch`` once every layer of l's group has landed
    (the library raises a group's flags together). So a wait for layer i waits for the flag of
    the last layer of i's group, and only where the same stream has not waited for that group
    yet: a stream-side wait costs the waiting stream a microsecond or two of device time even
    once its flag is up. A wait for a layer the host already sees landed enqueues
    nothing. The last group's wait goes to the event the plan recorded after the launch
    (:meth:`ends_with`) where there is one."""

    def __init__(self, backend: NativeBackend, buffer: SignalBuffer, epoch: int,
                 done: BoundsCompletion, group: int = 1, num_layers: int | None = None) -> None:
        self._wait: Callable[[int, int, int], None] = backend.wait_signal
        self._raw_stream = backend.raw_stream
        self._current_raw = backend.current_raw_stream
        self._buffer = buffer  # keeps the flags alive while a wait may be enqueued
        self._landed = buffer.landed
        self._flags = buffer.flags
        self._done = done
        self.epoch = epoch
        self.group = max(1, group)
        self._last = (num_layers if num_layers is not None else buffer.capacity) - 1
        self._last_group = self._last // self.group
        self._end: Any = None  # the event recorded right after the launch (ends_with)
        self._callers_stream = backend.callers_stream
        self._covered: dict[int, int] = {}  # raw stream -> the groups it waits for (bits)

    def ends_with(self, event: Any) -> None:
        """Wait for ``event``, recorded on the load's stream right after the launch, instead
        of the last group's flag. An engine's next load is ordered after the stream that
        waits here, so this wait is on the path from one load to the next: an event wait
        resolves inside the device, where a flag wait polls pinned memory (a one-page MLA
        load queue on an H100 lost about 6 us per load there, docs/benchmarks/)."""
        self._end = event

    def wait_layer(self, layer: int, stream: Any) -> None:
        if not self._buffer.has_landed(layer, self.epoch):
            self._enqueue(layer, self._raw_stream(stream), stream)

    def wait_layer_current(self, layer: int) -> None:
        """:meth:`wait_layer` on the device's current stream."""
        # _enqueue's covered test and has_landed inlined, in that order: this runs once per
        # layer per load, and most layers share a group the stream already waits for
        raw = self._current_raw()
        if (not self._covered.get(raw, 0) >> (layer // self.group) & 1
                and (self._landed[layer] - self.epoch) & 0xFFFFFFFF >= 0x80000000):
            self._enqueue(layer, raw, None)

    def _enqueue(self, layer: int, raw: int, stream: Any) -> None:
        """Make raw stream ``raw`` (the torch stream ``stream``; None: the current one) wait
        for ``layer``'s group, unless it already does."""
        g = self.group
        group = layer // g
        waited = self._covered.get(raw, 0)
        if waited >> group & 1:
            return  # the stream already waits for this layer's group
        if group == self._last_group and self._end is not None:
            # (kvcore's lookup of the current stream: torch's Event.wait(None) takes several
            # microseconds more for its own)
            self._end.wait(stream if stream is not None else self._callers_stream())
        else:
            self._wait(self._flags + 4 * min(group * g + g - 1, self._last), self.epoch, raw)
        self._covered[raw] = waited | 1 << group

    def check(self) -> None:
        self._done.check()


class ReportRing:
    """Pinned host memory for the kernels' reports of out-of-range device-resident indices
    (``struct kvio_report``, docs/native-abi.md): one slot per transfer, slot ``epoch %
    SLOTS``, reused round-robin, and a 64-bit epoch per transfer that the kernels store with
    the bad value.

    The kernels' stores are plain (host memory need not support PCIe atomics), so a transfer
    issued ``SLOTS`` transfers after another shares its slot and may store its report over the
    other's before that one is checked. A completion reads an epoch word equal to its
    own as its own failure, a smaller one as an older transfer's report (so a stale report
    never fails a later transfer), and a greater one as a later transfer's report that may
    have overwritten its own: its outcome is unknown and it fails (:class:`BoundsCompletion`).
    ``SLOTS`` (65536 slots, 2 MiB, allocated once per device and process: :meth:`of`) makes
    that take 65536 transfers issued between a transfer's issue and its check.

    One case is left: a transfer's kernel that runs after a later transfer of its slot stored
    a report (its stream stalled while 65536 more transfers were issued) stores its own epoch
    over that report: the later transfer's own refusal goes unreported and its check passes
    (a write-back acknowledged without the refused token's bytes). That is a known limit."""

    SLOTS = 65536

    def __init__(self, device: torch.device) -> None:
        # pinned where the device has streams (its kernels store into it); on the CPU (an
        # emulated library) plain memory is what the library writes
        self.memory = torch.zeros(self.SLOTS * REPORT_BYTES, dtype=torch.uint8,
                                  pin_memory=has_streams(device))
        #: the reports as 64-bit words, slot after slot (a memoryview: a completion keeps it
        #: and its slot's first word, not a NumPy view made per transfer)
        self.words = self.memory.numpy().data.cast("B").cast("q")
        self.base = self.memory.data_ptr()
        self._epochs = itertools.count(1)  # next() is atomic under the GIL

    @classmethod
    def of(cls, device: torch.device) -> ReportRing:
        """The ring of ``device`` that every backend of this process shares (epochs stay
        unique across them; a backend's own ring pinned 2 MiB each time a registry was made)."""
        with _RINGS_LOCK:
            ring = _RINGS.get(device)
            if ring is None:
                ring = _RINGS[device] = cls(device)
            return ring

    def completion(self, job: TransferJob) -> BoundsCompletion:
        return self.issue(job.host_geometry.size, job.device_pool.size, job.op)

    def issue(self, host_tokens: int, device_tokens: int, op: Op) -> BoundsCompletion:
        """The bounds and completion of one transfer between pools of these sizes."""
        epoch = next(self._epochs)
        slot = epoch % self.SLOTS
        bounds = KvioBounds(host_tokens, device_tokens, self.base + slot * REPORT_BYTES, epoch)
        return BoundsCompletion(self.words, slot * (REPORT_BYTES // 8), bounds, op)


_RINGS: dict[torch.device, ReportRing] = {}
_RINGS_LOCK = threading.Lock()

#: the words of a report's epochs (the words are signed; epochs stay below 2**63)
_HOST_EPOCH_WORD = REPORT_HOST_EPOCH // 8
_DEVICE_EPOCH_WORD = REPORT_DEVICE_EPOCH // 8


class BoundsCompletion:
    """The completion of one native transfer: after its stream work finished, ``check()``
    raises InvalidIndices naming the index the kernels refused (and did not dereference).
    Where a later transfer sharing the report slot stored its report there (see
    :class:`ReportRing`), whether this transfer refused an index is unknown: ``check()``
    raises TransferFailed, so nothing is acknowledged on a guess (its own report on the other
    side is raised first, as InvalidIndices)."""

    __slots__ = ("_epoch", "_first", "_op", "_words", "bounds")

    def __init__(self, words: Any, first: int, bounds: KvioBounds, op: Op) -> None:
        self._words = words  # 64-bit words; this transfer's report starts at word ``first``
        self._first = first
        self.bounds = bounds
        self._epoch = bounds.epoch
        self._op = op

    def check(self) -> None:
        w, at, epoch = self._words, self._first, self._epoch
        if w[at + _HOST_EPOCH_WORD] < epoch and w[at + _DEVICE_EPOCH_WORD] < epoch:
            return  # no report in the slot, or an older transfer's
        self._fail()

    def _fail(self) -> None:
        """Raise what the slot holds: this transfer's report, else a later one's."""
        w, at, b = self._words, self._first, self.bounds
        sides = (("host_indices", REPORT_HOST_EPOCH, REPORT_HOST_VALUE, b.host_tokens),
                 ("device_indices", REPORT_DEVICE_EPOCH, REPORT_DEVICE_VALUE, b.device_tokens))
        for name, epoch_at, value_at, size in sides:
            if w[at + epoch_at // 8] == self._epoch:
                raise InvalidIndices(name, f"values in [0, {size})",
                                     f"{w[at + value_at // 8]} (refused by the kernel, "
                                     "which moved no byte for it)",
                                     f"{self._op.value} at completion")
        for name, epoch_at, _, _ in sides:
            later = w[at + epoch_at // 8]
            if later > self._epoch:
                raise TransferFailed(
                    f"{self._op.value} (epoch {self._epoch}) at completion: its {name} report "
                    f"slot was taken by the report of a later transfer (epoch {later}), which "
                    "refused an index and may have overwritten this one's report (the slot is "
                    f"reused every {ReportRing.SLOTS} transfers); whether this transfer "
                    "refused an index is unknown, so it is failed rather than acknowledged "
                    "on a guess")


#: ``KVCORE_ASYNC_WRITE_BACK``: how a staged write-back through the controller is issued
WRITE_BACK_MODES = {
    "0": "every write-back by the caller, in stream order (kvio_write_back_staged)",
    "1": "from ASYNC_WRITE_BACK_MIN_BYTES by the library's thread, smaller by the caller with "
         "its host copy overlapping the next one's gather, up to DIRECT_WRITE_BACK_MAX_BYTES "
         "through the direct kernel (the default)",
}


def write_back_mode() -> str:
    """The ``KVCORE_ASYNC_WRITE_BACK`` mode (:data:`WRITE_BACK_MODES`; unset or empty: ``1``);
    another value is refused with InvalidArgument naming the variable."""
    return _mode("KVCORE_ASYNC_WRITE_BACK", WRITE_BACK_MODES, "1")


def _mode(variable: str, modes: dict[str, str], default: str) -> str:
    mode = os.environ.get(variable, "").strip() or default
    if mode not in modes:
        raise InvalidArgument(variable, "one of " + ", ".join(
            f"{k} ({v})" for k, v in modes.items()), repr(mode))
    return mode


#: a staged write-back through the controller of at least this many bytes is issued by the
#: library's thread (``kvio_write_back_staged_async``): from here on its issue takes dozens
#: of runtime calls (a pipeline of chunks), below it a few, which are cheaper than a handover
ASYNC_WRITE_BACK_MIN_BYTES = 16 << 20

#: a staged write-back through the controller of at most this many bytes goes through the
#: direct kernel instead (SM stores into pinned memory, the host indices in its launch). The
#: staged path's runtime calls cost a slow host's caller more than such a copy takes: a
#: one-page MLA write (2.25 MiB) ran at 0.69-0.80 of the ceiling there, CPU-bound, where the
#: direct kernel holds 0.93 (docs/benchmarks/h100-2026-12-06g). Up to one MHA page (8 MiB) the
#: caller's CPU decides: its staged write-back read 1.00 of the ceiling against the direct
#: kernel's 0.94, and cost the caller 24-28 us against 19-21 (an H100 host, a Python call in
#: 44 ns) and the library call 20.6 us against 9.0 on an H200 host (issue 21's bar: 30 us per
#: write(); docs/benchmarks/h100-2026-12-07). Larger ones keep the staged path's bandwidth
#: (0.95-0.98 from 4 MHA pages, against 0.945).
DIRECT_WRITE_BACK_MAX_BYTES = 8 << 20

#: pages (per K/V, over all layers) at least this large go through the staged write-back
#: (and the staged all-layer load, where declared)
STAGED_MIN_PAGE_BYTES = 64 << 10

#: a per-layer load whose page slices (one layer of one page) are at least this large may go
#: through the copy engine; below it, the CPU cost of one copy per slice outlasts the copies
DMA_MIN_PAGE_BYTES = 64 << 10


def native_ops(staging_bytes: int = DEFAULT_STAGING_BYTES,
               staged_min_page_bytes: int = STAGED_MIN_PAGE_BYTES,
               element_alignment: int = 16,
               dma_load_layouts: tuple[Layout, ...] = (),
               dma_min_page_bytes: int = DMA_MIN_PAGE_BYTES,
               staged_load: bool = False,
               signaled_load: bool = False,
               whole_page_staged: bool = False) -> tuple[OpSupport, ...]:
    """The operation variants every implementation of the native ABI declares.

    Write-back has two variants chosen per call by page size: ``staged`` (device gather into
    a bounded staging buffer, then copies of whole contiguous pages; host indices on the CPU,
    since the copy destinations are computed there) for pages of at least
    ``staged_min_page_bytes``, and ``direct`` (one kernel storing straight into pinned host
    memory; both index sets on the device) below that and for layouts whose pages are not
    contiguous. Loads are direct kernels reading pinned host memory, except per-layer loads
    from ``dma_load_layouts`` with page slices of at least ``dma_min_page_bytes``, declared
    first and so preferred there: the ``dma`` variant has the copy engine move each run of
    consecutive slots (both index sets on the CPU, since the copy addresses are computed
    there); it needs the library's optional ``kvio_load_layer_dma``. With ``staged_load``
    the all-layer load has a ``staged`` variant too, the write-back's mirror (copies of whole
    host pages into the staging buffer, then a device scatter; same page window and index
    residency); it needs the library's optional ``kvio_load_all_staged``. With
    ``signaled_load`` the direct per-layer load is the ``signaled`` variant: it also takes one
    job for every layer, moved in one launch layer after layer, each layer raising a ready
    flag that ``wait_layer`` waits on (``layer_signals``); it needs the library's optional
    ``kvio_load_layers_signaled`` and ``kvio_wait_layer_signal``, and falls back to one launch
    per layer with an event after each where they cannot run. With ``whole_page_staged`` the
    staged variants also serve layouts whose page of K and V together is one run though
    neither alone is (page_unified MHA): the library stages and copies whole pages there
    (``whole_pages``).
    """
    kinds = (Kind.MHA, Kind.MLA)
    # kinds grouped by the layouts whose pages (per K/V) are one run (kvcore.layout decides;
    # a layout a kind does not have does not split the group)
    contiguous: dict[frozenset[Layout], list[Kind]] = {}
    for kind in kinds:
        lays = set(contiguous_page_layouts(kind)) | (set(Layout) - set(layouts_for(kind)))
        contiguous.setdefault(frozenset(lays), []).append(kind)
    common: dict[str, Any] = {"element_alignment": element_alignment}
    on_cpu = IndexSpec(Residency.HOST, (torch.int64,))
    dma = (OpSupport(op=Op.LOAD_LAYER, kinds=frozenset(kinds),
                     layouts=frozenset(dma_load_layouts), host_index=on_cpu,
                     device_index=on_cpu, variant=NativeBackend.DMA, batched_memcpy=True,
                     min_page_bytes=dma_min_page_bytes, **common),) if dma_load_layouts else ()
    staged: dict[str, Any] = {"host_index": on_cpu, "device_index": IndexSpec(Residency.DEVICE),
                              "variant": NativeBackend.STAGED, "staged": True,
                              "staging_bytes": staging_bytes, "batched_memcpy": True,
                              "contiguous_pages": True, "min_page_bytes": staged_min_page_bytes,
                              **common}
    staged_ops = [OpSupport(op=op, kinds=frozenset(ks), layouts=lays, **staged)
                  for op in (Op.WRITE_BACK, Op.LOAD_ALL) for lays, ks in contiguous.items()]
    if whole_page_staged:
        staged_ops += [OpSupport(op=op, kinds=frozenset({kind}), layouts=frozenset(whole),
                                 whole_pages=True, **staged)
                       for op in (Op.WRITE_BACK, Op.LOAD_ALL) for kind in kinds
                       if (whole := contiguous_page_layouts(kind, whole=True))]
    load_staged = tuple(s for s in staged_ops if s.op is Op.LOAD_ALL) if staged_load else ()
    return (
        *dma,
        *(s for s in staged_ops if s.op is Op.WRITE_BACK),
        op_support(Op.WRITE_BACK, kinds, tuple(Layout), Residency.DEVICE, Residency.DEVICE,
                   variant="direct", **common),
        op_support(Op.LOAD_LAYER, kinds, tuple(Layout), Residency.DEVICE, Residency.DEVICE,
                   variant=NativeBackend.SIGNALED if signaled_load else "direct",
                   layer_signals=signaled_load, **common),
        *load_staged,
        op_support(Op.LOAD_ALL, kinds, tuple(Layout), Residency.DEVICE, Residency.DEVICE,
                   variant="direct", **common),
    )
