"""A prepared runner (NativeBackend.prepare) passes the library exactly what run() passes.

The runner is what every submit calls; run() is the reference the native-glue tests pin down.
Both are driven through a NativeLibrary over a recording stand-in of the ctypes library, so
the values compared are the ones a real library would receive."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore.backend import TransferJob, runner_for
from kvcore.errors import InvalidArgument
from kvcore.layout import Geometry, Kind, Layout, Op, host_shape
from kvcore.native import NativeBackend, NativeLayerSignals, native_ops
from kvcore.native_abi import (
    ABI_VERSION,
    INLINE_GRID_BYTES,
    INLINE_INDEX_PAGES,
    INLINE_INDEX_TOKENS,
    KvioBounds,
    KvioLayout,
    NativeLibrary,
    inline_index_limit,
)
from kvcore.pools import DevicePool, HostPool

#: the page size of _inline_runner's pools, and how many CPU host indices its launches carry
INLINE_PAGE = 16
INLINE_LIMIT = INLINE_INDEX_PAGES * INLINE_PAGE


class RawLib:
    """The ctypes library's exports as Python functions: each records its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def kvio_abi_version(self) -> int:
        return ABI_VERSION

    def kvio_has_batched_memcpy(self) -> int:
        return 1

    def kvio_has_layer_signals(self) -> int:
        return 1

    def kvio_error_string(self, code: Any) -> bytes:
        return b"error"

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("kvio_"):
            raise AttributeError(name)

        def record(*args: Any) -> int:
            self.calls.append((name, args))
            return 0

        return record


class CpuNative(NativeBackend):
    def raw_stream(self, stream: Any) -> int:
        assert stream is None
        return 0


def _comparable(call: tuple[str, tuple[Any, ...]]) -> tuple[Any, ...]:
    """A call with its layout as fields and its bounds as sizes (each transfer has its own
    report slot and epoch, by design, and each signaled load its own signal epoch)."""
    name, args = call
    out: list[Any] = [name]
    if name == "kvio_load_layers_signaled":
        args = (*args[:12], "epoch", *args[13:])
    for a in args:
        if isinstance(a, KvioLayout):
            out.append(("layout", tuple(a.as_dict().items())))
        elif isinstance(a, KvioBounds):
            assert a.report != 0
            out.append(("bounds", a.host_tokens, a.device_tokens))
        else:
            out.append(a)
    return tuple(out)


def _rig(layout: str, kind: str = "mha") -> tuple[CpuNative, RawLib, DevicePool, HostPool]:
    raw = RawLib()
    backend = CpuNative(torch.device("cpu"),
                        NativeLibrary(None, runtime="cpu", name="raw", lib=raw),  # type: ignore[arg-type]
                        staging_bytes=1 << 20)
    heads = 2 if kind == "mha" else 1
    dev = DevicePool.allocate(kind, 3, 64, heads, 64, torch.bfloat16, "cpu", 16)
    g = Geometry(Kind(kind), Layout(layout), 3, 64, heads, 64, 16)
    host = HostPool.wrap(torch.empty(host_shape(g), dtype=torch.bfloat16), kind, layout, 3,
                         heads, 64, 16)
    return backend, raw, dev, host


CASES = [  # (op, variant, layer, chained)
    (Op.WRITE_BACK, "staged", None, False),
    (Op.WRITE_BACK, "direct", None, False),
    (Op.LOAD_ALL, "staged", None, False),
    (Op.LOAD_ALL, "direct", None, False),
    (Op.LOAD_LAYER, "direct", 1, False),
    (Op.LOAD_LAYER, "direct", 2, True),
    (Op.LOAD_LAYER, "signaled", None, False),
    (Op.LOAD_LAYER, "signaled", 0, False),
    (Op.LOAD_LAYER, "dma", 1, False),
]


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize(("op", "variant", "layer", "chained"), CASES)
def test_a_prepared_runner_makes_the_calls_run_makes(op: Op, variant: str, layer: int | None,
                                                     chained: bool, kind: str) -> None:
    backend, raw, dev, host = _rig("layer_first" if variant == "dma" else "page_first", kind)
    ops = (*native_ops(dma_load_layouts=(Layout.LAYER_FIRST,), staged_load=True),
           *native_ops(signaled_load=True))
    support = next(s for s in ops if s.op is op and s.variant == variant)
    gen = torch.Generator().manual_seed(7)
    h = (torch.randperm(4, generator=gen)[:2, None] * 16 + torch.arange(16)).flatten()
    d = torch.randperm(64, generator=gen)[:32].to(torch.int32)
    if support.host_index.residency.value == "host":
        d = d.to(torch.int64)
    job = TransferJob(op=op, support=support, device_pool=dev, host_buffer=host.buffer,
                      host_geometry=host.geometry, host_strides=host.strides, host_indices=h,
                      device_indices=d, layer=layer, chained=chained)
    by_run = backend.run(job)
    # the backend asks how many layers land together once per load shape (both paths share it)
    ran = [_comparable(c) for c in raw.calls if c[0] != "kvio_signaled_layer_group"]
    raw.calls.clear()
    template = TransferJob(op=op, support=support, device_pool=dev, host_buffer=host.buffer,
                           host_geometry=host.geometry, host_strides=host.strides,
                           host_indices=torch.empty(0, dtype=torch.int64),
                           device_indices=torch.empty(0, dtype=torch.int64))
    by_runner = runner_for(backend, template)(h, d, layer, None, chained)
    assert [_comparable(c) for c in raw.calls] == ran
    assert ran, "the library was called"
    assert type(by_runner) is type(by_run)
    if isinstance(by_run, NativeLayerSignals):
        raw.calls.clear()
        by_runner.wait_layer(1, None)
        by_run.wait_layer(1, None)
        (w1, a1), (w2, a2) = raw.calls
        assert w1 == w2 == "kvio_wait_layer_signal"
        assert a1[0] == a2[0] and a1[1] == by_runner.epoch and a2[1] == by_run.epoch


def test_a_library_object_without_unchecked_entry_points_gets_run_itself() -> None:
    calls: list[TransferJob] = []

    class Backend:
        def run(self, job: TransferJob) -> None:
            calls.append(job)

        def allocate_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
            raise AssertionError

    _, _, dev, host = _rig("page_first")
    support = next(s for s in native_ops() if s.op is Op.LOAD_ALL)
    none = torch.empty(0, dtype=torch.int64)
    template = TransferJob(op=Op.LOAD_ALL, support=support, device_pool=dev,
                           host_buffer=host.buffer, host_geometry=host.geometry,
                           host_strides=host.strides, host_indices=none, device_indices=none)
    h, d = torch.arange(16), torch.arange(16)
    runner_for(Backend(), template)(h, d, None, "stream", False)  # type: ignore[arg-type]
    (job,) = calls
    assert job.host_indices is h and job.device_indices is d and job.stream == "stream"
    assert (job.op, job.support, job.device_pool, job.layer, job.chained) == (
        Op.LOAD_ALL, support, dev, None, False)


def test_a_wait_the_library_refuses_raises_kernel_error_naming_it() -> None:
    from kvcore.errors import KernelError

    class Refusing(RawLib):
        def kvio_wait_layer_signal(self, *args: Any) -> int:
            return 1

    _, _, dev, host = _rig("page_first")
    backend = CpuNative(torch.device("cpu"),
                        NativeLibrary(None, runtime="cpu", name="raw", lib=Refusing()),  # type: ignore[arg-type]
                        staging_bytes=1 << 20)
    support = next(s for s in native_ops(signaled_load=True) if s.layer_signals)
    none = torch.empty(0, dtype=torch.int64)
    template = TransferJob(op=Op.LOAD_LAYER, support=support, device_pool=dev,
                           host_buffer=host.buffer, host_geometry=host.geometry,
                           host_strides=host.strides, host_indices=none, device_indices=none)
    signals = runner_for(backend, template)(torch.arange(16), torch.arange(16), None, None,
                                            False)
    with pytest.raises(KernelError, match=r"^kvio_wait_layer_signal: error"):
        signals.wait_layer(0, None)


class MetaNative(CpuNative):
    """Stands for a GPU backend: its pool lives off the CPU (torch's meta device)."""


def _inline_runner(raw: RawLib, op: Op = Op.LOAD_LAYER) -> tuple[Any, torch.Tensor]:
    """A runner of ``op`` (the signaled load, or the direct write-back) on a pool off the
    CPU."""
    backend = MetaNative(torch.device("meta"),
                         NativeLibrary(None, runtime="cpu", name="raw", lib=raw),  # type: ignore[arg-type]
                         staging_bytes=1 << 20)
    dev = DevicePool.allocate("mla", 3, 64, 1, 64, torch.bfloat16, "meta", INLINE_PAGE)
    g = Geometry(Kind.MLA, Layout.PAGE_FIRST, 3, 64, 1, 64, INLINE_PAGE)
    host = HostPool.wrap(torch.empty(host_shape(g), dtype=torch.bfloat16), "mla", "page_first",
                         3, 1, 64, INLINE_PAGE)
    support = next(s for s in native_ops(signaled_load=True) if s.op is op
                   and (s.layer_signals if op is Op.LOAD_LAYER else s.variant == "direct"))
    none = torch.empty(0, dtype=torch.int64)
    template = TransferJob(op=op, support=support, device_pool=dev,
                           host_buffer=host.buffer, host_geometry=host.geometry,
                           host_strides=host.strides, host_indices=none, device_indices=none)
    return runner_for(backend, template), torch.arange(16, device="meta")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cpu_host_indices_of_a_signaled_load_go_to_the_library_in_the_call(
        dtype: torch.dtype) -> None:
    """Host indices on the CPU (up to INLINE_INDEX_PAGES whole pages) reach
    kvio_load_layers_signaled_inline as they are (pointer, width, count): no upload."""
    raw = RawLib()
    run, d = _inline_runner(raw)
    assert run.inline_host_tokens == INLINE_LIMIT
    h = torch.arange(16, 32, dtype=dtype)
    run(h, d, None, None, False)
    (name, args), = [c for c in raw.calls if c[0] != "kvio_signaled_layer_group"]
    assert name == "kvio_load_layers_signaled_inline"
    assert args[5:8] == (h.data_ptr(), int(dtype is torch.int64), None) and args[9] == 16


@pytest.mark.parametrize(("op", "layer", "chained", "function"), [
    (Op.LOAD_LAYER, 1, False, "kvio_transfer_direct_inline"),
    (Op.LOAD_LAYER, 2, True, "kvio_transfer_direct_inline"),  # (never the early kernel)
    (Op.WRITE_BACK, None, False, "kvio_transfer_direct_inline"),
])
def test_cpu_host_indices_of_a_direct_launch_go_to_the_library_in_the_call(
        op: Op, layer: int | None, chained: bool, function: str) -> None:
    raw = RawLib()
    run, d = _inline_runner(raw, op)
    assert run.inline_host_tokens == INLINE_LIMIT
    h = torch.arange(16, 32)
    run(h, d, layer, None, chained)
    (name, args), = raw.calls
    assert name == function
    first, count = (0, 3) if layer is None else (layer, 1)
    assert args[3:5] == (first, count) and args[7:9] == (h.data_ptr(), 1) and args[11] == 16


@pytest.mark.parametrize("op", [Op.LOAD_LAYER, Op.WRITE_BACK])
@pytest.mark.parametrize("layer", [None, 1])
def test_cpu_host_indices_the_library_cannot_carry_are_refused_before_any_call(
        op: Op, layer: int | None) -> None:
    """More host indices on the CPU than a launch carries (a page more than
    INLINE_INDEX_PAGES) raise InvalidArgument naming them and the limit: no kernel ever gets
    a CPU address to dereference."""
    raw = RawLib()
    run, _ = _inline_runner(raw, op)
    tokens = INLINE_LIMIT + INLINE_PAGE
    with pytest.raises(InvalidArgument, match=rf"host_indices.*at most {INLINE_LIMIT} here"):
        run(torch.arange(tokens), torch.arange(tokens, device="meta"), layer, None, False)
    assert [c for c in raw.calls if c[0] != "kvio_signaled_layer_group"] == []


@pytest.mark.parametrize(("page_size", "grid_bytes", "limit"), [
    (64, 4096, INLINE_INDEX_PAGES * 64),   # whole pages: one index per page in the launch
    (16, 1, INLINE_INDEX_PAGES * 16),
    (1, 4096, INLINE_INDEX_TOKENS),        # a page of one token: one index per token
    (48, 4096, INLINE_INDEX_TOKENS),       # not a power of two: one per token
    (64, 1 << 20, (INLINE_GRID_BYTES - 1) >> 20),  # the grid's 32-bit flat index bounds it
    (64, INLINE_GRID_BYTES, 0),
])
def test_how_many_cpu_host_indices_a_launch_carries(page_size: int, grid_bytes: int,
                                                    limit: int) -> None:
    assert inline_index_limit(page_size, grid_bytes) == limit


def test_a_write_back_launch_carries_fewer_indices_where_its_grid_moves_every_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write-back's one grid moves every layer, a per-layer load's one layer: each runner's
    limit keeps its own grid under INLINE_GRID_BYTES (here 1 MiB, so that it binds)."""
    import kvcore.native_abi

    monkeypatch.setattr(kvcore.native_abi, "INLINE_GRID_BYTES", 1 << 20)
    token_bytes = 64 * 2  # (one MLA element of _inline_runner's pools, per layer)
    write, _ = _inline_runner(RawLib(), Op.WRITE_BACK)
    load, _ = _inline_runner(RawLib(), Op.LOAD_LAYER)
    assert load.inline_host_tokens == ((1 << 20) - 1) // token_bytes
    assert write.inline_host_tokens == ((1 << 20) - 1) // (3 * token_bytes)
    raw = RawLib()
    write, _ = _inline_runner(raw, Op.WRITE_BACK)
    n = write.inline_host_tokens // INLINE_PAGE * INLINE_PAGE + INLINE_PAGE
    with pytest.raises(InvalidArgument, match="host_indices"):
        write(torch.arange(n), torch.arange(n, device="meta"), None, None, False)
    assert raw.calls == []


@pytest.mark.parametrize("missing", ["kvio_load_layers_signaled_inline",
                                     "kvio_transfer_direct_inline"])
def test_a_library_without_an_inline_launch_takes_no_cpu_host_indices(missing: str) -> None:
    """The signaled runner takes CPU host indices only where both launches it makes (all
    layers, one layer) can carry them."""
    class Plain(RawLib):
        def __getattr__(self, name: str) -> Any:
            if name == missing:
                raise AttributeError(name)
            return super().__getattr__(name)

    run, d = _inline_runner(Plain())
    assert getattr(run, "inline_host_tokens", 0) == 0
    with pytest.raises(InvalidArgument, match="host_indices"):
        run(torch.arange(16), d, None if "signaled" in missing else 1, None, False)
