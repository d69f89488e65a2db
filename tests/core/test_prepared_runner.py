"""A prepared runner (NativeBackend.prepare) passes the library exactly what run() passes.

The runner is what every submit calls; run() is the reference the native-glue tests pin down.
Both are driven through a NativeLibrary over a recording stand-in of the ctypes library, so
the values compared are the ones a real library would receive."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore.backend import TransferJob, runner_for
from kvcore.layout import Geometry, Kind, Layout, Op, host_shape
from kvcore.native import NativeBackend, NativeLayerSignals, native_ops
from kvcore.native_abi import ABI_VERSION, KvioBounds, KvioLayout, NativeLibrary
from kvcore.pools import DevicePool, HostPool


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
