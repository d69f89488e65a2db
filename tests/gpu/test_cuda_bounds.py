"""kvio_cuda's ABI v2 bounds on the GPU, through the library directly (CUDA machines only;
skipped with the reason elsewhere).

A device-resident index out of range is skipped by the kernels (no byte written for it, the
rest copied exactly) and reported in a pinned kvio_report with the call's epoch; the signaled
load still raises every flag. kvio_load_layer_dma on the legacy default stream (batched on an
internal stream) gives the same bytes as on a side stream. The CPU-side tests of the same
contract are in tests/rocm/test_rocm_emulated.py (the ROCm kernels run on the CPU) and
tests/cuda/test_native_cpu.py (refusals before any CUDA call).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvcore.cli.common import default_device
from kvcore.native_abi import KvioReport, make_bounds

DEVICE = default_device()
LAYERS, PAGE, PAGES, ELEM = 4, 16, 12, 256  # 256-B elements: the 16-B kernels
HOST_TOKENS = PAGES * PAGE
DEV_TOKENS = 160
SLACK = 16  # allocated rows past DEV_TOKENS, where a stray store would show
EPOCH = 0x8000_0000_0000_0005


def _library() -> Any:  # kvio_cuda is imported only on a CUDA machine
    if DEVICE.type != "cuda":
        pytest.skip(f"kvio_cuda needs a CUDA device, not {DEVICE}")
    try:
        from kvio_cuda.backend import CudaBackend
    except ImportError as exc:
        pytest.skip(f"kvio_cuda is not installed: {exc}")
    # the library the plugin itself loads: a wheel's prebuilt one, else built on first use
    return CudaBackend(DEVICE).lib


pytestmark = pytest.mark.gpu


@dataclass
class Rig:
    k: list[torch.Tensor]  # per layer (DEV_TOKENS + SLACK, ELEM) uint8, on the device
    v: list[torch.Tensor]
    ptrs: list[torch.Tensor]  # int64 tables of the layer addresses, on the device
    host: torch.Tensor  # pinned [kv][layer][page][token][ELEM] uint8 (layer_first)
    report: torch.Tensor  # pinned int64 x 4: host_epoch, host_value, device_epoch, ...

    @property
    def layout(self) -> dict[str, int]:
        return {"kv_stride": LAYERS * HOST_TOKENS * ELEM, "layer_stride": HOST_TOKENS * ELEM,
                "page_stride": PAGE * ELEM, "token_stride": ELEM, "chunk_stride": ELEM,
                "page_size": PAGE, "chunk_bytes": ELEM, "num_chunks": 1}

    def fields(self) -> KvioReport:
        return KvioReport.from_buffer_copy(bytes(self.report.numpy().tobytes()))


def _rig(gen: torch.Generator) -> Rig:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    k = [rand(DEV_TOKENS + SLACK, ELEM).to(DEVICE) for _ in range(LAYERS)]
    v = [rand(DEV_TOKENS + SLACK, ELEM).to(DEVICE) for _ in range(LAYERS)]
    ptrs = [torch.tensor([t.data_ptr() for t in per], dtype=torch.int64, device=DEVICE)
            for per in (k, v)]
    host = rand(2, LAYERS, PAGES, PAGE, ELEM).pin_memory()
    report = torch.zeros(4, dtype=torch.int64).pin_memory()
    return Rig(k, v, ptrs, host, report)


def _indices(gen: torch.Generator, bad: int | None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Five whole host pages into distinct device slots; token 17's device index is `bad`.
    The third tensor marks the tokens whose indices are in range (the ones moved)."""
    pages = torch.randperm(PAGES, generator=gen)[:5]
    h = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
    d = torch.randperm(DEV_TOKENS, generator=gen)[:h.numel()]
    good = torch.ones(h.numel(), dtype=torch.bool)
    if bad is not None:
        d[17] = bad
        good[17] = False
    return h, d, good


@pytest.mark.parametrize("bad", [DEV_TOKENS + 3, -1])
def test_a_direct_load_skips_an_out_of_range_device_index_and_reports_it(bad: int) -> None:
    lib = _library()
    gen = torch.Generator().manual_seed(5)
    rig = _rig(gen)
    h, d, good = _indices(gen, bad)
    expected_k = [t.cpu() for t in rig.k]
    expected_v = [t.cpu() for t in rig.v]
    for layer in range(LAYERS):
        hv = rig.host.view(2, LAYERS, HOST_TOKENS, ELEM)
        expected_k[layer][d[good]] = hv[0, layer, h[good]]
        expected_v[layer][d[good]] = hv[1, layer, h[good]]
    h_dev, d_dev = h.to(DEVICE), d.to(DEVICE)
    bounds = make_bounds(HOST_TOKENS, DEV_TOKENS, rig.report.data_ptr(), EPOCH)
    stream = torch.cuda.current_stream(DEVICE)
    lib.transfer_direct(1, rig.ptrs[0].data_ptr(), rig.ptrs[1].data_ptr(), 0, LAYERS,
                        rig.host.data_ptr(), rig.layout, h_dev.data_ptr(), 1, d_dev.data_ptr(),
                        1, h.numel(), stream.cuda_stream, bounds=bounds)
    stream.synchronize()  # the event the report is read after
    for layer in range(LAYERS):
        assert torch.equal(rig.k[layer].cpu(), expected_k[layer]), layer
        assert torch.equal(rig.v[layer].cpu(), expected_v[layer]), layer
    r = rig.fields()
    assert (r.host_epoch, r.device_epoch, r.device_value) == (0, EPOCH, bad)


def test_a_signaled_load_with_an_out_of_range_index_still_raises_every_flag() -> None:
    lib = _library()
    if not lib.has_layer_signals():
        pytest.skip("the runtime cannot wait on a flag")
    gen = torch.Generator().manual_seed(6)
    rig = _rig(gen)
    h, d, good = _indices(gen, DEV_TOKENS + 9)
    before_k = [t.cpu() for t in rig.k]
    counters = torch.zeros(LAYERS, dtype=torch.int32, device=DEVICE)  # one per group
    flags = torch.zeros(LAYERS, dtype=torch.int32, device=DEVICE)
    h_dev, d_dev = h.to(DEVICE), d.to(DEVICE)
    bounds = make_bounds(HOST_TOKENS, DEV_TOKENS, rig.report.data_ptr(), EPOCH)
    stream = torch.cuda.current_stream(DEVICE)
    lib.load_layers_signaled(rig.ptrs[0].data_ptr(), rig.ptrs[1].data_ptr(), LAYERS,
                             rig.host.data_ptr(), rig.layout, h_dev.data_ptr(), 1,
                             d_dev.data_ptr(), 1, h.numel(), counters.data_ptr(),
                             flags.data_ptr(), 7, stream.cuda_stream, bounds=bounds)
    stream.synchronize()
    assert flags.tolist() == [7] * LAYERS
    group = lib.signaled_layer_group(rig.ptrs[0].data_ptr(), rig.ptrs[1].data_ptr(), LAYERS,
                                     rig.host.data_ptr(), rig.layout, h.numel(),
                                     stream.cuda_stream)
    assert 1 <= group <= LAYERS
    # every group counted all its tiles' warps, bad indices included: each count completed,
    # so the warp that completed it zeroed it again for the next load
    assert counters.tolist() == [0] * LAYERS
    hv = rig.host.view(2, LAYERS, HOST_TOKENS, ELEM)
    for layer in range(LAYERS):
        want = before_k[layer].clone()
        want[d[good]] = hv[0, layer, h[good]]
        assert torch.equal(rig.k[layer].cpu(), want), layer
    r = rig.fields()
    assert (r.host_epoch, r.device_epoch, r.device_value) == (0, EPOCH, DEV_TOKENS + 9)


def test_the_dma_load_on_the_legacy_stream_equals_the_one_on_a_side_stream() -> None:
    lib = _library()
    gen = torch.Generator().manual_seed(7)
    rig = _rig(gen)
    h, d, _ = _indices(gen, None)  # every index in range
    twin = [t.clone() for t in rig.k], [t.clone() for t in rig.v]
    bounds = make_bounds(HOST_TOKENS, DEV_TOKENS, rig.report.data_ptr(), EPOCH)
    side = torch.cuda.Stream(DEVICE)
    torch.cuda.synchronize(DEVICE)
    for layer in range(LAYERS):
        lib.load_layer_dma(rig.k[layer].data_ptr(), rig.v[layer].data_ptr(), layer,
                           rig.host.data_ptr(), rig.layout, h.data_ptr(), d.data_ptr(),
                           h.numel(), 1, 0, bounds=bounds)  # 0: the legacy default stream
        lib.load_layer_dma(twin[0][layer].data_ptr(), twin[1][layer].data_ptr(), layer,
                           rig.host.data_ptr(), rig.layout, h.data_ptr(), d.data_ptr(),
                           h.numel(), 1, side.cuda_stream, bounds=bounds)
    # stream 0 waits for the internal stream: work enqueued on it afterwards sees the data
    done = torch.cuda.Event()
    done.record(torch.cuda.default_stream(DEVICE))
    done.synchronize()
    side.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(rig.k[layer], twin[0][layer]) and torch.equal(rig.v[layer],
                                                                          twin[1][layer])
    hv = rig.host.view(2, LAYERS, HOST_TOKENS, ELEM)
    assert torch.equal(rig.k[2][d].cpu(), hv[0, 2, h])
    assert ctypes.sizeof(KvioReport) == 32
    assert not rig.report.any()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_an_inline_signaled_load_moves_the_host_indices_of_the_call(dtype: torch.dtype) -> None:
    """kvio_load_layers_signaled_inline reads its host indices during the call: the load runs
    50 ms later, after the caller overwrote them, and still moves what they named at the call
    (and skips and reports its out-of-range device index, as the uploaded load does)."""
    lib = _library()
    if not lib.has_layer_signals() or "kvio_load_layers_signaled_inline" not in lib.optional:
        pytest.skip("the library has no inline signaled load")
    gen = torch.Generator().manual_seed(9)
    rig = _rig(gen)
    h, d, good = _indices(gen, DEV_TOKENS + 4)
    before = [[t.cpu() for t in side] for side in (rig.k, rig.v)]
    counters = torch.zeros(LAYERS, dtype=torch.int32, device=DEVICE)
    flags = torch.zeros(LAYERS, dtype=torch.int32, device=DEVICE)
    h_cpu, d_dev = h.to(dtype, copy=True), d.to(DEVICE)  # (h itself stays as named)
    bounds = make_bounds(HOST_TOKENS, DEV_TOKENS, rig.report.data_ptr(), EPOCH)
    stream = torch.cuda.current_stream(DEVICE)
    torch.cuda._sleep(100_000_000)  # about 50 ms ahead of the load on its stream
    lib.load_layers_signaled(rig.ptrs[0].data_ptr(), rig.ptrs[1].data_ptr(), LAYERS,
                             rig.host.data_ptr(), rig.layout, h_cpu.data_ptr(),
                             int(dtype is torch.int64), d_dev.data_ptr(), 1, h.numel(),
                             counters.data_ptr(), flags.data_ptr(), 11, stream.cuda_stream,
                             bounds=bounds, inline=True)
    h_cpu.copy_(torch.flip(h, (0,)))  # other host pages, while the load still waits
    stream.synchronize()
    assert flags.tolist() == [11] * LAYERS and counters.tolist() == [0] * LAYERS
    hv = rig.host.view(2, LAYERS, HOST_TOKENS, ELEM)
    for side, tensors in enumerate((rig.k, rig.v)):
        for layer in range(LAYERS):
            want = before[side][layer].clone()
            want[d[good]] = hv[side, layer, h[good]]
            assert torch.equal(tensors[layer].cpu(), want), (side, layer)
    r = rig.fields()
    assert (r.host_epoch, r.device_epoch, r.device_value) == (0, EPOCH, DEV_TOKENS + 4)


def test_an_inline_signaled_load_refuses_a_bad_host_index_and_enqueues_nothing() -> None:
    from kvcore.errors import KernelError

    lib = _library()
    if not lib.has_layer_signals() or "kvio_load_layers_signaled_inline" not in lib.optional:
        pytest.skip("the library has no inline signaled load")
    gen = torch.Generator().manual_seed(10)
    rig = _rig(gen)
    h, d, _ = _indices(gen, None)
    h[3] = HOST_TOKENS  # one past the host pool
    before = [t.cpu() for t in rig.k]
    flags = torch.zeros(LAYERS, dtype=torch.int32, device=DEVICE)
    counters = torch.zeros(LAYERS, dtype=torch.int32, device=DEVICE)
    d_dev = d.to(DEVICE)
    bounds = make_bounds(HOST_TOKENS, DEV_TOKENS, rig.report.data_ptr(), EPOCH)
    stream = torch.cuda.current_stream(DEVICE)
    with pytest.raises(KernelError, match="kvio_load_layers_signaled_inline"):
        lib.load_layers_signaled(rig.ptrs[0].data_ptr(), rig.ptrs[1].data_ptr(), LAYERS,
                                 rig.host.data_ptr(), rig.layout, h.data_ptr(), 1,
                                 d_dev.data_ptr(), 1, h.numel(), counters.data_ptr(),
                                 flags.data_ptr(), 5, stream.cuda_stream, bounds=bounds,
                                 inline=True)
    stream.synchronize()  # the GPU is still usable, and nothing ran
    assert flags.tolist() == [0] * LAYERS
    assert all(torch.equal(t.cpu(), b) for t, b in zip(rig.k, before, strict=True))
    assert rig.fields().host_epoch == 0
