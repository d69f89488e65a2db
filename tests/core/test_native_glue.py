"""kvcore.native turns a placed job into the native ABI's arguments (no GPU needed)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from kvcore.layout import Kind, Layout, Op
from kvcore.native import (
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    BoundsCompletion,
    NativeBackend,
    layout_fields,
)
from kvcore.native_abi import make_layout
from kvcore.pools import DevicePool, HostPool


class RecordingLibrary:
    """NativeLibrary's transfer methods, recording their positional arguments; the ABI v2
    ``bounds`` keyword (None: unchecked) goes to ``self.bounds``, one entry per call."""

    def __init__(self, signals: bool = True) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.bounds: list[Any] = []
        self.signals = signals

    def transfer_direct(self, *args: Any, chained: bool = False, bounds: Any = None) -> None:
        self.calls.append(("direct chained" if chained else "direct", args))
        self.bounds.append(bounds)

    def write_back_staged(self, *args: Any, bounds: Any = None) -> None:
        self.calls.append(("staged", args))
        self.bounds.append(bounds)

    def load_all_staged(self, *args: Any, bounds: Any = None) -> None:
        self.calls.append(("staged load", args))
        self.bounds.append(bounds)

    def load_layer_dma(self, *args: Any, bounds: Any = None) -> None:
        self.calls.append(("dma", args))
        self.bounds.append(bounds)

    def has_layer_signals(self) -> bool:
        return self.signals

    def load_layers_signaled(self, *args: Any, bounds: Any = None) -> None:
        self.calls.append(("signaled", args))
        self.bounds.append(bounds)

    def wait_layer_signal(self, *args: Any) -> None:
        self.calls.append(("wait", args))


class CpuNative(NativeBackend):
    def raw_stream(self, stream: Any) -> int:
        assert stream is None  # the CPU has no streams
        return 0


class StreamsNative(NativeBackend):
    """Stands for a backend with streams: "other" is raw stream 11, the current one
    ``current``."""

    current = 0

    def raw_stream(self, stream: Any) -> int:
        return {None: 0, "other": 11}[stream]

    def current_raw_stream(self) -> int:
        return self.current


def _setup(layout: str, signals: bool = True,
           ) -> tuple[CpuNative, RecordingLibrary, DevicePool, HostPool]:
    lib = RecordingLibrary(signals)
    backend = CpuNative(torch.device("cpu"), lib, staging_bytes=1 << 20)  # type: ignore[arg-type]
    dev = DevicePool.allocate("mha", 3, 64, 2, 64, torch.bfloat16, "cpu", 16)
    host = HostPool.wrap(torch.empty(_shape(layout), dtype=torch.bfloat16), "mha", layout, 3, 2,
                         64, 16)
    return backend, lib, dev, host


def _shape(layout: str, num_layers: int = 3) -> tuple[int, ...]:
    from kvcore.layout import Geometry, host_shape

    return host_shape(Geometry(Kind.MHA, Layout(layout), num_layers, 64, 2, 64, 16))


def _job(dev: DevicePool, host: HostPool, op: Op, variant: str, layer: int | None = None,
         chained: bool = False) -> Any:
    from kvcore.backend import TransferJob
    from kvcore.layout import Layout
    from kvcore.native import native_ops

    ops = (*native_ops(dma_load_layouts=(Layout.LAYER_FIRST,), staged_load=True),
           *native_ops(signaled_load=True))
    support = next(s for s in ops if s.op is op and s.variant == variant)
    return TransferJob(op=op, support=support, device_pool=dev, host_buffer=host.buffer,
                       host_geometry=host.geometry, host_strides=host.strides,
                       host_indices=torch.arange(16, 32, dtype=torch.int64),
                       device_indices=torch.arange(16, dtype=torch.int32), layer=layer,
                       chained=chained)


def _run(backend: CpuNative, dev: DevicePool, host: HostPool, op: Op, variant: str,
         layer: int | None = None, chained: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    job = _job(dev, host, op, variant, layer, chained)
    backend.run(job)
    return job.host_indices, job.device_indices


def test_staged_write_back_passes_cpu_host_indices_a_staging_buffer_and_the_layout() -> None:
    backend, lib, dev, host = _setup("page_first")
    host_idx, dev_idx = _run(backend, dev, host, Op.WRITE_BACK, "staged")
    (name, args), = lib.calls
    assert name == "staged"
    k, v, layers, base, layout, h, d, d64, n, staging, staging_bytes, batched, stream = args
    assert (k, v, layers, base) == (dev.k_ptrs.data_ptr(), dev.v_ptrs.data_ptr(), 3,
                                    host.buffer.data_ptr())
    assert (h, d) == (host_idx.data_ptr(), dev_idx.data_ptr())
    assert make_layout(layout).as_dict() == layout_fields(host.strides)
    assert (d64, n, staging_bytes, batched, stream) == (0, 16, 1 << 20, 1, 0)
    assert staging == backend.staging(0).data_ptr()


def test_staged_load_of_all_layers_passes_the_write_back_arguments_to_its_own_function(
) -> None:
    backend, lib, dev, host = _setup("page_first")
    _run(backend, dev, host, Op.WRITE_BACK, "staged")
    host_idx, dev_idx = _run(backend, dev, host, Op.LOAD_ALL, "staged")
    (wb, wb_args), (load, load_args) = lib.calls
    assert (wb, load) == ("staged", "staged load")
    # same pools, struct and staging buffer (one per stream): only the function differs
    assert load_args[:4] == wb_args[:4] and load_args[7:] == wb_args[7:]
    assert load_args[4] is wb_args[4]
    assert load_args[5:7] == (host_idx.data_ptr(), dev_idx.data_ptr())


def test_a_per_layer_job_marked_staged_is_refused_before_the_library_is_called() -> None:
    import attrs

    from kvcore.backend import TransferJob
    from kvcore.errors import InvalidArgument
    from kvcore.native import native_ops

    backend, lib, dev, host = _setup("page_first")
    staged = next(s for s in native_ops(staged_load=True) if s.variant == "staged")
    job = TransferJob(op=Op.LOAD_LAYER, support=attrs.evolve(staged, op=Op.LOAD_LAYER),
                      device_pool=dev, host_buffer=host.buffer, host_geometry=host.geometry,
                      host_strides=host.strides, host_indices=torch.arange(16),
                      device_indices=torch.arange(16), layer=0)
    with pytest.raises(InvalidArgument, match=r"job\.support"):
        backend.run(job)
    assert lib.calls == []


def test_the_staged_load_is_opt_in_and_declared_before_the_direct_one() -> None:
    from kvcore.capabilities import Residency
    from kvcore.native import STAGED_MIN_PAGE_BYTES, native_ops

    assert [s.variant for s in native_ops() if s.op is Op.LOAD_ALL] == ["direct"]
    ops = native_ops(staged_load=True, staging_bytes=1 << 24)
    loads = [s for s in ops if s.op is Op.LOAD_ALL]
    # one staged variant per group of kinds with the same contiguous-page layouts (page_unified
    # pages are one run of K/V for MLA only: K and V interleave inside an MHA page)
    assert [s.variant for s in loads] == ["staged", "staged", "direct"]
    by_kind = {k: s.layouts for s in loads[:2] for k in s.kinds}
    assert Layout.PAGE_UNIFIED in by_kind[Kind.MLA]
    assert Layout.PAGE_UNIFIED not in by_kind[Kind.MHA]
    assert Layout.LAYER_FIRST not in by_kind[Kind.MHA] | by_kind[Kind.MLA]
    staged = loads[0]
    write_back = [s for s in ops if s.op is Op.WRITE_BACK and s.variant == "staged"]
    assert [s.layouts for s in write_back] == [s.layouts for s in loads[:2]]
    assert staged.host_index.residency is Residency.HOST
    assert staged.device_index.residency is Residency.DEVICE
    assert staged.staged and staged.contiguous_pages and staged.batched_memcpy
    assert (staged.staging_bytes, staged.min_page_bytes) == (1 << 24, STAGED_MIN_PAGE_BYTES)


def _kvio_cuda_plan(op: Op, layout: Any, element_bytes: int) -> Any:
    """A plan over kvio_cuda's declared variants for ``op``/``layout`` (nothing to run)."""
    import kvio_cuda

    from kvcore.capabilities import HostMemory
    from kvcore.plan import TransferPlan
    from kvcore.registry import make_request

    req = make_request(op, "mha", layout, torch.bfloat16, element_bytes, "cpu")
    return TransferPlan(request=req, backend_name="cuda", backend_version="0",
                        host_memory=HostMemory.PINNED,
                        variants=tuple(s for s in kvio_cuda.CAPABILITIES.ops
                                       if s.covers(op, Kind.MHA, layout)),
                        instance=lambda: None)


def test_kvio_cuda_stages_all_layer_loads_of_contiguous_pages_of_64_kib_and_more() -> None:
    from kvcore.layout import Layout

    for layout in Layout:
        plan = _kvio_cuda_plan(Op.LOAD_ALL, layout, 1152)
        # (MHA page_unified pages interleave K and V: staged as whole pages, K and V together)
        contiguous = layout in (Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, Layout.PAGE_HEAD,
                                Layout.PAGE_UNIFIED)
        assert plan.select(64 << 10).variant == ("staged" if contiguous else "direct"), layout
        assert plan.select((64 << 10) - 16).variant == "direct", layout
        assert plan.select(1 << 20).variant == ("staged" if contiguous else "direct"), layout


def test_direct_load_of_one_layer_passes_that_layer_and_both_index_widths() -> None:
    backend, lib, dev, host = _setup("layer_first")
    _run(backend, dev, host, Op.LOAD_LAYER, "direct", layer=2)
    _run(backend, dev, host, Op.WRITE_BACK, "direct")
    (n1, a1), (n2, a2) = lib.calls
    assert (n1, a1[0], a1[3], a1[4]) == ("direct", HOST_TO_DEVICE, 2, 1)
    assert (n2, a2[0], a2[3], a2[4]) == ("direct", DEVICE_TO_HOST, 0, 3)
    assert (a1[8], a1[10], a1[11]) == (1, 0, 16)  # host int64, device int32, 16 tokens


def test_a_chained_job_reaches_the_library_as_chained_and_only_then() -> None:
    backend, lib, dev, host = _setup("page_first")
    _run(backend, dev, host, Op.LOAD_LAYER, "direct", layer=0)
    _run(backend, dev, host, Op.LOAD_LAYER, "direct", layer=1, chained=True)
    assert [name for name, _ in lib.calls] == ["direct", "direct chained"]
    assert lib.calls[0][1][3] == 0 and lib.calls[1][1][3] == 1


def test_the_layout_struct_is_built_once_per_host_geometry() -> None:
    backend, lib, dev, host = _setup("page_first")
    _run(backend, dev, host, Op.LOAD_LAYER, "direct", layer=0)
    _run(backend, dev, host, Op.LOAD_LAYER, "direct", layer=1)
    first, second = (args[6] for _, args in lib.calls)
    assert first is second  # per-layer calls reuse one validated struct
    assert first.as_dict() == layout_fields(host.strides)
    other = HostPool.wrap(torch.empty(_shape("layer_first"), dtype=torch.bfloat16), "mha",
                          "layer_first", 3, 2, 64, 16)
    _run(backend, dev, other, Op.LOAD_LAYER, "direct", layer=0)
    third = lib.calls[-1][1][6]
    assert third is not first and third.as_dict() == layout_fields(other.strides)


def test_dma_load_of_one_layer_passes_that_layers_tensors_and_cpu_indices() -> None:
    backend, lib, dev, host = _setup("layer_first")
    host_idx, dev_idx = _run(backend, dev, host, Op.LOAD_LAYER, "dma", layer=2)
    (name, args), = lib.calls
    assert name == "dma"
    k, v, layer, base, layout, h, d, n, batched, stream = args
    assert (k, v, layer, base) == (dev.layers(0)[2].data_ptr(), dev.layers(1)[2].data_ptr(), 2,
                                   host.buffer.data_ptr())
    assert (h, d, n, batched, stream) == (host_idx.data_ptr(), dev_idx.data_ptr(), 16, 1, 0)
    assert make_layout(layout).as_dict() == layout_fields(host.strides)


class DmaLibrary(RecordingLibrary):
    """A library with the optional copy-engine load and unchecked calls (as NativeLibrary)."""

    optional = ("kvio_load_layer_dma",)

    def unchecked(self, function: str, last: Any = None) -> Any:
        def call(*args: Any) -> None:
            self.calls.append((function, args[:-1]))
            self.bounds.append(args[-1])

        return call


def test_a_prepared_dma_runner_passes_what_a_job_run_passes_for_each_layer() -> None:
    from kvcore.backend import runner_for

    lib = DmaLibrary()
    backend = CpuNative(torch.device("cpu"), lib)  # type: ignore[arg-type]
    _, _, dev, host = _setup("layer_first")
    job = _job(dev, host, Op.LOAD_LAYER, "dma", layer=0)
    run = runner_for(backend, job)
    for layer in (2, 0):
        one = _job(dev, host, Op.LOAD_LAYER, "dma", layer=layer)
        backend.run(one)
        run(one.host_indices, one.device_indices, layer, None, layer > 0)
        (slow, checked), (fast, args) = lib.calls[-2:]
        assert (slow, fast) == ("dma", "kvio_load_layer_dma")
        assert args[:4] == (dev.layers(0)[layer].data_ptr(), dev.layers(1)[layer].data_ptr(),
                            layer, host.buffer.data_ptr())
        assert make_layout(args[4]).as_dict() == make_layout(checked[4]).as_dict()
        assert args[5:] == (one.host_indices.data_ptr(), one.device_indices.data_ptr(), 16, 1,
                            None)  # None: NULL, the CPU's (legacy) stream
        assert checked[5:9] == args[5:9]
        slow_bounds, fast_bounds = lib.bounds[-2:]
        assert (fast_bounds.host_tokens, fast_bounds.device_tokens) == (
            slow_bounds.host_tokens, slow_bounds.device_tokens) == (64, 64)
        assert fast_bounds.epoch != slow_bounds.epoch  # a report slot of its own


def test_the_dma_variant_is_declared_first_with_both_index_sets_on_the_cpu() -> None:
    import torch as _torch

    from kvcore.capabilities import Residency
    from kvcore.layout import Layout
    from kvcore.native import native_ops

    assert not [s for s in native_ops() if s.variant == "dma"]  # opt-in: kvio_rocm has none
    ops = native_ops(dma_load_layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT))
    loads = [s for s in ops if s.op is Op.LOAD_LAYER]
    assert [s.variant for s in loads] == ["dma", "direct"]
    dma = loads[0]
    assert dma.layouts == {Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT}
    assert dma.host_index.residency is dma.device_index.residency is Residency.HOST
    assert dma.host_index.dtypes == dma.device_index.dtypes == (_torch.int64,)
    assert dma.batched_memcpy and not dma.staged


def test_kvio_cuda_loads_128_kib_layer_slices_by_the_copy_engine_and_smaller_ones_by_kernel(
) -> None:
    from kvcore.layout import Layout

    for layout in Layout:
        plan = _kvio_cuda_plan(Op.LOAD_LAYER, layout, 1024)
        contiguous = layout in (Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT)
        assert plan.select(128 << 10).variant == ("dma" if contiguous else "signaled"), layout
        assert plan.select((128 << 10) - 16).variant == "signaled", layout
        assert plan.select(64 << 10).variant == "signaled", layout
        assert plan.select(32 << 10).variant == "signaled", layout


def test_submit_issues_a_per_layer_load_layer_by_layer_chained_after_the_first() -> None:
    from kvcore.capabilities import HostMemory
    from kvcore.native import native_ops
    from kvcore.plan import TransferPlan
    from kvcore.registry import make_request

    backend, lib, dev, host = _setup("page_first")
    for op, expected in ((Op.LOAD_LAYER, [("direct", 0), ("direct chained", 1),
                                          ("direct chained", 2)]),
                         (Op.LOAD_ALL, [("direct", 0)])):
        lib.calls.clear()
        req = make_request(op, "mha", "page_first", torch.bfloat16, 256, "cpu")
        plan = TransferPlan(request=req, backend_name="native", backend_version="0",
                            host_memory=HostMemory.PLAIN,
                            variants=tuple(s for s in native_ops() if s.op is op),
                            instance=lambda: backend)
        h, d = torch.arange(16, 32), torch.arange(16)
        sub = plan.bind(dev, host).submit(h, d)
        for done in sub.completions:  # one report per job; none refused an index
            assert isinstance(done, BoundsCompletion)
            done.check()
        assert [(name, args[3]) for name, args in lib.calls] == expected


# ------------------------------------------------------------------ the signaled per-layer load


def test_a_signaled_load_of_every_layer_is_one_library_call_with_the_streams_signal_memory(
) -> None:
    from kvcore.native import NativeLayerSignals

    backend, lib, dev, host = _setup("layer_first")
    job = _job(dev, host, Op.LOAD_LAYER, "signaled")
    first, second = backend.run(job), backend.run(job)
    assert isinstance(first, NativeLayerSignals) and isinstance(second, NativeLayerSignals)
    (n1, a1), (n2, a2) = lib.calls
    assert n1 == n2 == "signaled"
    k, v, layers, base, layout, h, h64, d, d64, n, counters, flags, epoch, stream = a1
    assert (k, v, layers, base) == (dev.k_ptrs.data_ptr(), dev.v_ptrs.data_ptr(), 3,
                                    host.buffer.data_ptr())
    assert (h, h64, d, d64, n, stream) == (job.host_indices.data_ptr(), 1,
                                           job.device_indices.data_ptr(), 0, 16, 0)
    assert make_layout(layout).as_dict() == layout_fields(host.strides)
    buf = backend._signal_buffer(0, 3)
    assert (counters, flags) == (buf.counters, buf.flags)
    assert buf.capacity >= 3
    for memory in (buf.counter_memory, buf.flag_memory):
        assert memory.dtype == torch.int32 and memory.numel() == buf.capacity
        assert not memory.any()  # fresh: all zero
    # the same stream, the same memory; every load raises the flags to a new epoch
    assert a2[10:12] == (counters, flags) and (epoch, a2[12]) == (1, 2)
    lib.calls.clear()
    second.wait_layer(2, None)
    assert lib.calls == [("wait", (flags + 8, 2, 0))]


def test_a_wait_for_a_layer_the_host_sees_landed_enqueues_nothing() -> None:
    backend, lib, dev, host = _setup("layer_first")
    job = _job(dev, host, Op.LOAD_LAYER, "signaled")
    first, second = backend.run(job), backend.run(job)
    buf = backend._signal_buffer(0, 3)
    buf.flag_memory[0] = second.epoch  # as the kernel publishes: layer 0 of both loads landed
    buf.flag_memory[1] = first.epoch  # layer 1 of the first load only
    buf.flag_memory[2] = -1  # 0xFFFFFFFF: 2**32 - 1 epochs on, cyclically before both
    lib.calls.clear()
    for signals in (first, second):
        for layer in range(3):
            signals.wait_layer(layer, None)
            signals.wait_layer_current(layer)  # the same stream: covered by the wait above
    flags = buf.flags
    assert lib.calls == [("wait", (flags + 8, first.epoch, 0)),
                         ("wait", (flags + 4, second.epoch, 0)),
                         ("wait", (flags + 8, second.epoch, 0))]


class GroupingLibrary(RecordingLibrary):
    """A library whose signaled loads land ``group`` layers at a time."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    def signaled_layer_group(self, *args: Any) -> int:
        self.calls.append(("group", args))
        return self.group


def _grouping_rig(group: int, layers: int) -> tuple[StreamsNative, GroupingLibrary, Any]:
    """A backend with streams whose library lands ``group`` layers at a time, and a signaled
    per-layer load job of ``layers`` layers."""
    lib = GroupingLibrary(group)
    backend = StreamsNative(torch.device("cpu"), lib, staging_bytes=1 << 20)  # type: ignore[arg-type]
    dev = DevicePool.allocate("mha", layers, 64, 2, 64, torch.bfloat16, "cpu", 16)
    host = HostPool.wrap(torch.empty(_shape("layer_first", layers), dtype=torch.bfloat16),
                         "mha", "layer_first", layers, 2, 64, 16)
    return backend, lib, _job(dev, host, Op.LOAD_LAYER, "signaled")


def test_a_wait_goes_to_the_last_flag_of_its_group_once_per_group_and_stream() -> None:
    from kvcore.native import NativeLayerSignals

    backend, lib, job = _grouping_rig(group=2, layers=5)
    signals = backend.run(job)
    assert isinstance(signals, NativeLayerSignals) and signals.group == 2
    (name, args), _ = lib.calls
    assert name == "group" and args[2] == 5 and args[5] == 16  # layers, tokens of the load
    lib.calls.clear()
    flags, e = signals._flags, signals.epoch
    backend.current = 7
    for layer in range(5):
        signals.wait_layer_current(layer)
    # groups {0, 1}, {2, 3}, {4}: one wait each, on the group's last flag (a group's flags go
    # up together, so flag 1 means layers 0 and 1 are in)
    assert lib.calls == [("wait", (flags + 4, e, 7)), ("wait", (flags + 12, e, 7)),
                         ("wait", (flags + 16, e, 7))]
    lib.calls.clear()
    signals.wait_layer(2, "other")  # another stream waits for itself
    signals.wait_layer(3, "other")
    signals.wait_layer_current(0)  # stream 7 waited for layer 0's group already
    assert lib.calls == [("wait", (flags + 12, e, 11))]
    backend.run(job)  # the same load shape asks the library once
    assert [n for n, _ in lib.calls[1:]] == ["signaled"]


def test_a_wait_for_a_later_group_does_not_cover_an_earlier_one() -> None:
    """A group's flags cover that group only (ABI version 4): a stream that waited for a
    later group first still waits for an earlier one."""
    backend, lib, job = _grouping_rig(group=2, layers=5)
    signals = backend.run(job)
    lib.calls.clear()
    flags, e = signals._flags, signals.epoch
    backend.current = 7
    for layer in (4, 3, 0, 2, 1):
        signals.wait_layer_current(layer)
    assert lib.calls == [("wait", (flags + 16, e, 7)), ("wait", (flags + 12, e, 7)),
                         ("wait", (flags + 4, e, 7))]


def test_a_wait_for_a_landed_layer_is_skipped_even_where_its_group_is_not_in() -> None:
    backend, lib, job = _grouping_rig(group=4, layers=4)
    signals = backend.run(job)
    buf = backend._signal_buffer(0, 4)
    buf.flag_memory[:2] = signals.epoch  # layers 0 and 1 are in, 2 and 3 not yet
    lib.calls.clear()
    backend.current = 7
    signals.wait_layer_current(0)
    signals.wait_layer_current(1)
    assert lib.calls == []
    signals.wait_layer_current(2)
    assert lib.calls == [("wait", (buf.flags + 12, signals.epoch, 7))]


class WaitedEvent:
    """Stands for the event a plan records after a signaled launch: records each wait."""

    def __init__(self) -> None:
        self.waits: list[Any] = []

    def wait(self, stream: Any = None) -> None:
        self.waits.append(stream)


def test_the_last_groups_wait_goes_to_the_event_after_the_launch_once_per_stream() -> None:
    from kvcore.testing.stand_in_streams import stand_in_streams

    backend, lib, job = _grouping_rig(group=2, layers=5)
    signals = backend.run(job)
    end = WaitedEvent()
    signals.ends_with(end)
    lib.calls.clear()
    flags, e = signals._flags, signals.epoch
    backend.current = 7
    with stand_in_streams("cpu") as current:
        for layer in range(5):
            signals.wait_layer_current(layer)
        signals.wait_layer_current(4)  # covered: nothing more
    # groups {0, 1} and {2, 3} wait for their flags; the last, {4}, for the event, on the
    # current stream's object
    assert lib.calls == [("wait", (flags + 4, e, 7)), ("wait", (flags + 12, e, 7))]
    assert end.waits == [current]
    signals.wait_layer(4, "other")  # another stream waits for itself, on its own object
    signals.wait_layer(4, "other")
    assert end.waits == [current, "other"] and len(lib.calls) == 2


def test_a_landed_last_group_waits_for_neither_its_flag_nor_the_event() -> None:
    backend, lib, job = _grouping_rig(group=4, layers=4)
    signals = backend.run(job)
    end = WaitedEvent()
    signals.ends_with(end)
    backend._signal_buffer(0, 4).flag_memory[:] = signals.epoch
    lib.calls.clear()
    for layer in range(4):
        signals.wait_layer_current(layer)
        signals.wait_layer(layer, "other")
    assert lib.calls == [] and end.waits == []


def test_without_an_event_the_last_group_waits_for_its_flag() -> None:
    backend, lib, job = _grouping_rig(group=4, layers=4)
    signals = backend.run(job)  # (a plan on a device without streams records no event)
    lib.calls.clear()
    backend.current = 7
    signals.wait_layer_current(3)
    assert lib.calls == [("wait", (signals._flags + 12, signals.epoch, 7))]


def test_the_signal_memory_grows_for_more_layers_and_keeps_the_memory_it_outgrew() -> None:
    backend, _, _, _ = _setup("layer_first")
    small = backend._signal_buffer(0, 3)
    assert backend._signal_buffer(0, small.capacity) is small
    big = backend._signal_buffer(0, small.capacity + 1)
    assert big is not small and big.capacity == small.capacity + 1
    assert small in backend._retired_signals  # a wait enqueued on it may still read it
    assert big.next_epoch() == 1  # its flags start from zero again


def test_epochs_wrap_past_32_bits_without_handing_out_the_fresh_memorys_zero_first() -> None:
    from kvcore.native import SignalBuffer

    buf = SignalBuffer(torch.device("cpu"), 4)
    assert buf.next_epoch() == 1
    buf.epoch = 0xFFFFFFFF
    assert buf.next_epoch() == 0  # the wait's cyclic compare treats 0 as after 0xFFFFFFFF


def test_without_signals_in_the_library_the_layers_go_one_launch_each() -> None:
    from kvcore.signals import EventLayerSignals

    backend, lib, dev, host = _setup("page_first", signals=False)
    signals = backend.run(_job(dev, host, Op.LOAD_LAYER, "signaled"))
    assert isinstance(signals, EventLayerSignals)
    assert [(name, args[0], args[3], args[4]) for name, args in lib.calls] == [
        ("direct", HOST_TO_DEVICE, 0, 1), ("direct chained", HOST_TO_DEVICE, 1, 1),
        ("direct chained", HOST_TO_DEVICE, 2, 1)]
    signals.wait_layer(1, None)  # no streams here: the layers have run, nothing to wait for


def test_a_job_for_every_layer_on_a_variant_without_signals_is_refused() -> None:

    from kvcore.errors import InvalidArgument

    backend, lib, dev, host = _setup("page_first")
    with pytest.raises(InvalidArgument, match=r"job\.layer.*layer_signals"):
        backend.run(_job(dev, host, Op.LOAD_LAYER, "direct"))
    assert lib.calls == []


def test_a_single_layer_job_on_the_signaled_variant_is_the_direct_kernel() -> None:
    backend, lib, dev, host = _setup("page_first")
    assert isinstance(backend.run(_job(dev, host, Op.LOAD_LAYER, "signaled", layer=1)),
                      BoundsCompletion)
    assert [(name, args[3], args[4]) for name, args in lib.calls] == [("direct", 1, 1)]


def test_signaled_load_declaration() -> None:
    from kvcore.native import native_ops

    plain = [s for s in native_ops() if s.op is Op.LOAD_LAYER]
    assert [(s.variant, s.layer_signals) for s in plain] == [("direct", False)]
    signaled, = (s for s in native_ops(signaled_load=True) if s.op is Op.LOAD_LAYER)
    assert (signaled.variant, signaled.layer_signals) == ("signaled", True)
    assert signaled.host_index == plain[0].host_index
    assert signaled.device_index == plain[0].device_index
    assert not [s for s in native_ops(signaled_load=True) if s.op is not Op.LOAD_LAYER
                and s.layer_signals]


def _signaled_plan(backend: Any) -> Any:
    from kvcore.capabilities import HostMemory
    from kvcore.native import native_ops
    from kvcore.plan import TransferPlan
    from kvcore.registry import make_request

    req = make_request(Op.LOAD_LAYER, "mha", "page_first", torch.bfloat16, 256, "cpu")
    return TransferPlan(request=req, backend_name="native", backend_version="0",
                        host_memory=HostMemory.PLAIN,
                        variants=tuple(s for s in native_ops(signaled_load=True)
                                       if s.op is Op.LOAD_LAYER),
                        instance=lambda: backend)


def test_submit_on_a_signaled_variant_is_one_job_for_every_layer() -> None:
    from kvcore.native import NativeLayerSignals

    backend, lib, dev, host = _setup("page_first")
    plan = _signaled_plan(backend)
    sub = plan.bind(dev, host).submit(torch.arange(16, 32), torch.arange(16))
    assert len(sub.completions) == 1 and isinstance(sub.completions[0], NativeLayerSignals)
    assert [name for name, _ in lib.calls] == ["signaled"]


def test_a_signaled_submit_hands_its_signals_the_event_recorded_after_the_launch() -> None:
    from kvcore.testing.stand_in_streams import stand_in_streams

    class StandInNative(NativeBackend):
        def raw_stream(self, stream: Any) -> int:
            return 0

    _, lib, dev, host = _setup("page_first")
    backend = StandInNative(torch.device("cpu"), lib, staging_bytes=1 << 20)  # type: ignore[arg-type]
    with stand_in_streams("cpu"):
        sub = _signaled_plan(backend).bind(dev, host).submit(torch.arange(16, 32),
                                                             torch.arange(16))
    (signals,) = sub.completions
    assert sub.event is not None and signals._end is sub.event
    assert [name for name, _ in lib.calls] == ["signaled"]


def test_a_signaled_variant_that_returns_no_signals_breaks_the_contract() -> None:

    from kvcore.errors import ContractViolation

    class Forgetful:
        def run(self, job: Any) -> None:
            return None

    plan = _signaled_plan(Forgetful())
    _, _, dev, host = _setup("page_first")
    bound = plan.bind(dev, host)
    with pytest.raises(ContractViolation, match=r"layer_signals.*returned NoneType"):
        bound.submit(torch.arange(16, 32), torch.arange(16))


# ------------------------------------------------------------------ the index ring's upload


class UploadingLibrary(RecordingLibrary):
    """A library that also has the optional kvio_copy_to_device."""

    optional = ("kvio_copy_to_device",)

    def unchecked(self, function: str, last: Any = None) -> Any:
        def call(*args: Any) -> None:
            self.calls.append((function, args + ((last(),) if last is not None else ())))

        return call


def test_a_library_with_its_own_copy_uploads_the_index_rings_slots_and_only_then() -> None:
    lib = UploadingLibrary()
    backend = CpuNative(torch.device("cpu"), lib)  # type: ignore[arg-type]
    backend.upload_indices(4096, 8192, 512, None)  # type: ignore[attr-defined]
    assert lib.calls == [("kvio_copy_to_device", (4096, 8192, 512, None))]  # NULL: no stream
    without = CpuNative(torch.device("cpu"), RecordingLibrary())  # type: ignore[arg-type]
    assert not hasattr(without, "upload_indices")  # the ring copies through torch then


# ------------------------------------------------------------------ the bounds reports


def _report(bounds: Any, field: str, epoch: int, value: int) -> None:
    """Store a report as a kernel does on a violation: the value, then the epoch."""
    from kvcore.native_abi import KvioReport

    report = KvioReport.from_address(bounds.report)
    setattr(report, field.replace("epoch", "value"), value)
    setattr(report, field, epoch)


@pytest.mark.parametrize("field,name,size", [("device_epoch", "device_indices", 40),
                                             ("host_epoch", "host_indices", 96)])
def test_a_completion_raises_the_report_of_its_own_transfer_only(field: str, name: str,
                                                                 size: int) -> None:
    from kvcore.errors import InvalidIndices
    from kvcore.native import ReportRing

    ring = ReportRing(torch.device("cpu"))
    earlier = ring.issue(96, 40, Op.LOAD_LAYER)
    for _ in range(ReportRing.SLOTS - 1):
        ring.issue(96, 40, Op.LOAD_LAYER)
    done = ring.issue(96, 40, Op.LOAD_LAYER)  # the slot of `earlier`, one lap later
    assert done.bounds.report == earlier.bounds.report
    assert done.bounds.epoch == earlier.bounds.epoch + ReportRing.SLOTS
    neighbour = ring.issue(96, 40, Op.LOAD_LAYER)
    _report(earlier.bounds, field, earlier.bounds.epoch, 12345)  # a stale report
    done.check()  # not this transfer's
    _report(done.bounds, field, done.bounds.epoch, size + 7)
    with pytest.raises(InvalidIndices, match=rf"{name}.*\[0, {size}\).*{size + 7}.*refused"):
        done.check()
    neighbour.check()  # the next slot's transfer is untouched


def test_backends_of_one_device_share_its_report_ring_and_never_an_epoch() -> None:
    """Every backend of a device issues its transfers' reports from one ring: a registry made
    again pins no new ring, and two backends' transfers never get the same epoch (a report
    of one would read as the other's)."""
    from kvcore.native import ReportRing

    cpu, meta = torch.device("cpu"), torch.device("meta")
    lib = types.SimpleNamespace(wait_layer_signal=None)  # no optional functions
    first, second = (NativeBackend(cpu, lib) for _ in range(2))  # type: ignore[arg-type]
    assert first._reports() is second._reports() is ReportRing.of(cpu)
    assert ReportRing.of(meta) is not ReportRing.of(cpu)
    epochs = [b._reports().issue(96, 40, Op.WRITE_BACK).bounds.epoch
              for b in (first, second, first, second)]
    assert len(set(epochs)) == 4 and epochs == sorted(epochs)


def _sharing_a_slot(op: Op) -> tuple[Any, Any, Any]:
    """A CPU ReportRing and two transfers of it a lap apart: the same report slot."""
    from kvcore.native import ReportRing

    ring = ReportRing(torch.device("cpu"))
    earlier = ring.issue(96, 40, op)
    for _ in range(ReportRing.SLOTS - 1):
        ring.issue(96, 40, op)
    later = ring.issue(96, 40, op)
    assert later.bounds.report == earlier.bounds.report
    assert later.bounds.epoch == earlier.bounds.epoch + ReportRing.SLOTS
    return ring, earlier, later


def _store(ring: Any, done: Any, side: str, epoch: int, value: int) -> None:
    """Store a report into the slot of ``done`` as a kernel does: the value word, then the
    epoch word (plain stores, at the REPORT_* offsets)."""
    from kvcore.native_abi import (
        REPORT_DEVICE_EPOCH,
        REPORT_DEVICE_VALUE,
        REPORT_HOST_EPOCH,
        REPORT_HOST_VALUE,
    )

    epoch_at, value_at = {"host": (REPORT_HOST_EPOCH, REPORT_HOST_VALUE),
                          "device": (REPORT_DEVICE_EPOCH, REPORT_DEVICE_VALUE)}[side]
    first = (done.bounds.report - ring.base) // 8
    ring.words[first + value_at // 8] = value
    ring.words[first + epoch_at // 8] = epoch


SIDES = [("device", "device_indices", 40), ("host", "host_indices", 96)]


@pytest.mark.parametrize("side,name,size", SIDES)
def test_a_later_transfers_report_over_an_earlier_ones_fails_the_earlier_transfer(
        side: str, name: str, size: int) -> None:
    from kvcore.errors import InvalidIndices, TransferFailed

    ring, earlier, later = _sharing_a_slot(Op.WRITE_BACK)
    _store(ring, earlier, side, earlier.bounds.epoch, size + 3)  # the earlier one refused,
    _store(ring, later, side, later.bounds.epoch, size + 9)  # the later one stored over it
    with pytest.raises(TransferFailed) as info:
        earlier.check()  # not passed: its refusal was overwritten
    message = str(info.value)
    assert not isinstance(info.value, InvalidIndices)
    assert name in message
    assert f"epoch {earlier.bounds.epoch})" in message
    assert f"later transfer (epoch {later.bounds.epoch})" in message
    assert "unknown" in message and "write_back" in message
    with pytest.raises(InvalidIndices, match=rf"{name}.*\[0, {size}\).*{size + 9}.*refused"):
        later.check()  # its own report


@pytest.mark.parametrize("side,name,size", SIDES)
def test_an_older_transfers_report_in_the_slot_passes_the_newer_transfer(
        side: str, name: str, size: int) -> None:
    ring, earlier, later = _sharing_a_slot(Op.LOAD_ALL)
    _store(ring, earlier, side, earlier.bounds.epoch, size + 3)
    later.check()  # a stale report, not this transfer's


def test_a_transfers_own_report_is_raised_before_a_later_ones_on_the_other_side() -> None:
    from kvcore.errors import InvalidIndices

    ring, earlier, later = _sharing_a_slot(Op.LOAD_LAYER)
    _store(ring, earlier, "device", earlier.bounds.epoch, 77)
    _store(ring, later, "host", later.bounds.epoch, 200)
    with pytest.raises(InvalidIndices, match=r"device_indices.*\[0, 40\).*77.*refused"):
        earlier.check()  # a refusal known to be its own
    with pytest.raises(InvalidIndices, match=r"host_indices.*\[0, 96\).*200.*refused"):
        later.check()
