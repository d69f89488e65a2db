"""kvio_rocm's launcher and kernel index math, run on the CPU.

The real host source (csrc/kvio_rocm.hip) and the real kernel bodies (csrc/kvio_device.h) are
compiled as a CPU library with -DKVIO_EMULATE (csrc/kvio_emul.h stands in for the HIP calls)
and driven through the real ctypes binding. Results must equal what kvcore.layout's
canonical view says, bit for bit, with poisoned destinations and untouched regions checked.
Launches are split at 32768 work-items and run on 8 workgroups in emulation, so the launch
split and the grid-stride loop are covered too.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from kvio_rocm._native import NativeLibrary, make_layout

from kvcore.errors import DeviceFault, InvalidArgument, KernelError
from kvcore.layout import (
    Geometry,
    Kind,
    Layout,
    byte_strides,
    canonical_view,
    host_shape,
    join_heads,
    page_block_contiguous,
    page_contiguous,
    split_heads,
)
from kvcore.native import layout_fields
from kvcore.native_abi import ABI_VERSION, KvioBounds, KvioReport, make_bounds, unchecked_bounds

POISON = 0x5A


def layout_of(g: Geometry, itemsize: int) -> dict[str, int]:
    """The kvio_layout fields of ``g``'s host buffer, as NativeBackend passes them."""
    return layout_fields(byte_strides(g, itemsize))


@pytest.fixture(scope="module")
def emul(emulated_library: Path) -> tuple[NativeLibrary, ctypes.CDLL]:
    path = emulated_library
    raw = ctypes.CDLL(str(path))
    raw.kvio_emul_counters.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    raw.kvio_emul_fail_next.argtypes = [ctypes.c_int, ctypes.c_int]
    return NativeLibrary(path), raw


def counters(raw: ctypes.CDLL) -> dict[str, int]:
    buf = (ctypes.c_int64 * 6)()
    raw.kvio_emul_counters(buf)
    names = ("launches", "items", "memcpy", "batch_calls", "batch_copies", "bytes")
    return dict(zip(names, (int(x) for x in buf), strict=True))


@dataclass
class Pool:
    """A 'device' pool on the CPU: per layer one K and one V tensor (MLA: one latent)."""

    layers: list[list[torch.Tensor]]  # [kv][layer] -> (tokens, heads, dim)
    ptrs: list[torch.Tensor]  # [kv] -> int64 table of layer addresses

    @property
    def k_ptrs(self) -> int:
        return self.ptrs[0].data_ptr()

    @property
    def v_ptrs(self) -> int:
        return self.ptrs[1].data_ptr() if len(self.ptrs) > 1 else 0


def random_like(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen,
                        dtype=torch.uint8)
    return raw.view(dtype)


def make_pool(g: Geometry, dtype: torch.dtype, tokens: int, gen: torch.Generator,
              poison: bool = False) -> Pool:
    layers = []
    for _ in range(g.kv_count):
        per = []
        for _ in range(g.num_layers):
            if poison:
                t = torch.full((tokens, g.head_num, g.head_dim * dtype.itemsize), POISON,
                               dtype=torch.uint8).view(dtype)
            else:
                t = random_like((tokens, g.head_num, g.head_dim), dtype, gen)
            per.append(t)
        layers.append(per)
    ptrs = [torch.tensor([t.data_ptr() for t in per], dtype=torch.int64) for per in layers]
    return Pool(layers, ptrs)


def page_indices(g: Geometry, pages: list[int], dtype: torch.dtype) -> torch.Tensor:
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * g.page_size + torch.arange(g.page_size)).flatten().to(dtype)


CASES = [
    # kind, layout, heads, head_dim, dtype -> chunk bytes 16k (v16), 8 (v8), odd (v1)
    (Kind.MHA, Layout.LAYER_FIRST, 2, 8, torch.bfloat16),
    (Kind.MHA, Layout.PAGE_FIRST, 2, 8, torch.float16),
    (Kind.MHA, Layout.PAGE_FIRST_DIRECT, 2, 8, torch.bfloat16),
    (Kind.MHA, Layout.PAGE_HEAD, 3, 8, torch.bfloat16),
    (Kind.MHA, Layout.PAGE_HEAD, 2, 4, torch.float16),  # 8-byte chunks
    (Kind.MHA, Layout.PAGE_FIRST, 1, 4, torch.float16),  # 8-byte elements
    (Kind.MHA, Layout.LAYER_FIRST, 1, 5, torch.uint8),  # 5-byte elements: byte path
    (Kind.MHA, Layout.PAGE_HEAD, 2, 3, torch.uint8),  # 3-byte chunks: byte path
    (Kind.MLA, Layout.LAYER_FIRST, 1, 72, torch.bfloat16),  # 144 bytes
    (Kind.MLA, Layout.PAGE_FIRST, 1, 36, torch.bfloat16),  # 72 bytes: v8
    (Kind.MLA, Layout.PAGE_FIRST_DIRECT, 1, 11, torch.uint8),
]


def case_id(c: tuple) -> str:
    kind, layout, h, d, dt = c
    return f"{kind.value}-{layout.value}-h{h}d{d}-{str(dt).removeprefix('torch.')}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("direction", [0, 1], ids=["d2h", "h2d"])
@pytest.mark.parametrize("idx", [(torch.int64, torch.int64), (torch.int32, torch.int32),
                                 (torch.int64, torch.int32)], ids=["i64", "i32", "mixed"])
def test_transfer_direct_matches_layout(emul, case, direction, idx) -> None:
    lib, _ = emul
    kind, layout, heads, dim, dtype = case
    L, P, size, dev_tokens = 4, 4, 64, 80
    g = Geometry(kind=kind, layout=layout, num_layers=L, size=size, head_num=heads,
                 head_dim=dim, page_size=P)
    gen = torch.Generator().manual_seed(hash((case_id(case), direction)) & 0xFFFF)
    pages = torch.randperm(g.num_pages, generator=gen)[:9].tolist()
    host_idx = page_indices(g, pages, idx[0])
    n = host_idx.numel()
    dev_idx = torch.randperm(dev_tokens, generator=gen)[:n].to(idx[1])
    layer_begin, layer_count = (0, L) if direction == 0 else (1, 2)
    layers = range(layer_begin, layer_begin + layer_count)
    strides = layout_of(g, dtype.itemsize)

    if direction == 0:
        pool = make_pool(g, dtype, dev_tokens, gen)
        host = torch.full((int(torch.tensor(host_shape(g)).prod()) * dtype.itemsize,), POISON,
                          dtype=torch.uint8).view(dtype).view(host_shape(g))
        expected = host.clone()
        view = canonical_view(expected, g)
        h = host_idx.long()
        for kv, layer in itertools.product(range(g.kv_count), layers):
            view[kv, layer, h // P, h % P] = split_heads(pool.layers[kv][layer][dev_idx.long()], g)
    else:
        pool = make_pool(g, dtype, dev_tokens, gen, poison=True)
        host = random_like(host_shape(g), dtype, gen)
        view = canonical_view(host, g)
        h = host_idx.long()
        expected_layers = [[t.clone() for t in per] for per in pool.layers]
        for kv, layer in itertools.product(range(g.kv_count), layers):
            expected_layers[kv][layer][dev_idx.long()] = join_heads(view[kv, layer, h // P, h % P])

    lib.transfer_direct(direction, pool.k_ptrs, pool.v_ptrs, layer_begin, layer_count,
                        host.data_ptr(), strides, host_idx.data_ptr(),
                        int(host_idx.dtype == torch.int64), dev_idx.data_ptr(),
                        int(dev_idx.dtype == torch.int64), n, 0)

    if direction == 0:
        assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))
    else:
        for kv, layer in itertools.product(range(g.kv_count), range(L)):
            got, want = pool.layers[kv][layer], expected_layers[kv][layer]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (kv, layer)


def test_launch_is_split_and_grid_strided(emul) -> None:
    """51200 byte-path items: two launches (split at 32768), each over 8 workgroups."""
    lib, raw = emul
    g = Geometry(kind=Kind.MHA, layout=Layout.PAGE_FIRST, num_layers=4, size=256, head_num=1,
                 head_dim=25, page_size=8)
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(g, torch.uint8, 300, gen)
    host = torch.zeros(host_shape(g), dtype=torch.uint8)
    host_idx = page_indices(g, list(range(g.num_pages))[::-1], torch.int64)
    dev_idx = torch.randperm(300, generator=gen)[: host_idx.numel()]
    raw.kvio_emul_reset()
    lib.transfer_direct(0, pool.k_ptrs, pool.v_ptrs, 0, 4, host.data_ptr(),
                        layout_of(g, 1), host_idx.data_ptr(), 1, dev_idx.data_ptr(), 1,
                        host_idx.numel(), 0)
    c = counters(raw)
    assert c["launches"] == 2
    assert c["items"] == 2 * 8 * 256  # two launches of 8 workgroups of 256 work-items
    view = canonical_view(host, g)
    for kv, layer in itertools.product(range(2), range(4)):
        assert torch.equal(join_heads(view[kv, layer, host_idx // 8, host_idx % 8]),
                           pool.layers[kv][layer][dev_idx])


STAGED = [
    (Kind.MHA, Layout.PAGE_FIRST, 2, 8, torch.bfloat16),
    (Kind.MHA, Layout.PAGE_FIRST_DIRECT, 2, 8, torch.bfloat16),
    (Kind.MHA, Layout.PAGE_HEAD, 2, 8, torch.float16),
    (Kind.MLA, Layout.PAGE_FIRST, 1, 36, torch.bfloat16),
    (Kind.MLA, Layout.PAGE_FIRST_DIRECT, 1, 5, torch.uint8),
    # K and V alternate inside a page: whole pages are staged and copied
    (Kind.MHA, Layout.PAGE_UNIFIED, 4, 8, torch.bfloat16),
    (Kind.MHA, Layout.PAGE_UNIFIED, 4, 8, torch.bfloat16, 2),
    (Kind.MHA, Layout.PAGE_UNIFIED, 4, 8, torch.float16, 4),
]


def staged_id(c: tuple) -> str:
    return case_id(c[:5]) + (f"-g{c[5]}" if len(c) > 5 else "")


def expected_runs(pages: list[int], per_chunk: int, kv_count: int) -> int:
    """Copies the staged write-back issues: per chunk and K/V, one per run of consecutive
    host pages."""
    total = 0
    for c0 in range(0, len(pages), per_chunk):
        chunk = pages[c0:c0 + per_chunk]
        runs = 1 + sum(1 for a, b in itertools.pairwise(chunk) if b != a + 1)
        total += runs * kv_count
    return total


STAGED_PAGES = [3, 4, 5, 9, 1, 2, 20, 21, 22, 23, 7]  # runs, breaks and a reversed step
STAGED_PER_CHUNK = 4  # pages (per K/V) the staging buffer holds


@dataclass
class StagedRig:
    """One staged transfer's inputs: 3 layers of 4-token pages, a 120-slot pool."""

    g: Geometry
    dtype: torch.dtype
    pool: Pool
    host_idx: torch.Tensor
    dev_idx: torch.Tensor
    page_bytes: int
    staging: torch.Tensor

    def args(self, host: torch.Tensor, dev64: int, use_batched: int) -> tuple:
        """The arguments of kvio_write_back_staged / kvio_load_all_staged."""
        return (self.pool.k_ptrs, self.pool.v_ptrs, self.g.num_layers, host.data_ptr(),
                layout_of(self.g, self.dtype.itemsize), self.host_idx.data_ptr(),
                self.dev_idx.data_ptr(), dev64, self.host_idx.numel(), self.staging.data_ptr(),
                self.staging.numel(), use_batched, 0)

    def check_counters(self, raw: ctypes.CDLL, use_batched: int) -> None:
        """One kernel per chunk, every page's bytes copied once, one copy per run."""
        c = counters(raw)
        chunks = -(-len(STAGED_PAGES) // STAGED_PER_CHUNK)
        # whole pages (K and V together one run, neither alone): one copy per run, not per K/V
        whole = page_block_contiguous(self.g) and not page_contiguous(self.g)
        runs = expected_runs(STAGED_PAGES, STAGED_PER_CHUNK, 1 if whole else self.g.kv_count)
        assert c["launches"] == chunks
        assert c["bytes"] == len(STAGED_PAGES) * self.page_bytes * self.g.kv_count
        if use_batched:
            assert (c["batch_calls"], c["batch_copies"], c["memcpy"]) == (chunks, runs, 0)
        else:
            assert (c["batch_calls"], c["memcpy"]) == (0, runs)


def staged_rig(case: tuple, dev64: int, gen: torch.Generator, poison_pool: bool) -> StagedRig:
    kind, layout, heads, dim, dtype = case[:5]
    g = Geometry(kind=kind, layout=layout, num_layers=3, size=96, head_num=heads,
                 head_dim=dim, page_size=4, head_group_num=case[5] if len(case) > 5 else 1)
    pool = make_pool(g, dtype, 120, gen, poison=poison_pool)
    host_idx = page_indices(g, STAGED_PAGES, torch.int64)
    dev_idx = torch.randperm(120, generator=gen)[:host_idx.numel()].to(
        torch.int64 if dev64 else torch.int32)
    page_bytes = g.num_layers * g.page_size * heads * dim * dtype.itemsize
    staging = torch.full((STAGED_PER_CHUNK * page_bytes * g.kv_count + 5,), POISON,
                         dtype=torch.uint8)
    return StagedRig(g, dtype, pool, host_idx, dev_idx, page_bytes, staging)


@pytest.mark.parametrize("case", STAGED, ids=[staged_id(c) for c in STAGED])
@pytest.mark.parametrize("use_batched", [1, 0], ids=["batched", "per-run"])
@pytest.mark.parametrize("dev64", [1, 0], ids=["dev-i64", "dev-i32"])
def test_write_back_staged(emul, case, use_batched, dev64) -> None:
    lib, raw = emul
    rig = staged_rig(case, dev64, torch.Generator().manual_seed(11), poison_pool=False)
    g, P, h, d = rig.g, rig.g.page_size, rig.host_idx, rig.dev_idx.long()
    host = torch.full(host_shape(g), 0, dtype=rig.dtype)
    host.view(torch.uint8).fill_(POISON)
    expected = host.clone()
    view = canonical_view(expected, g)
    for kv, layer in itertools.product(range(g.kv_count), range(g.num_layers)):
        view[kv, layer, h // P, h % P] = split_heads(rig.pool.layers[kv][layer][d], g)

    raw.kvio_emul_reset()
    lib.write_back_staged(*rig.args(host, dev64, use_batched))
    assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))
    assert lib.has_batched_memcpy()
    rig.check_counters(raw, use_batched)


@pytest.mark.parametrize("case", STAGED, ids=[staged_id(c) for c in STAGED])
@pytest.mark.parametrize("use_batched", [1, 0], ids=["batched", "per-run"])
@pytest.mark.parametrize("dev64", [1, 0], ids=["dev-i64", "dev-i32"])
def test_load_all_staged(emul, case, use_batched, dev64) -> None:
    lib, raw = emul
    assert lib.has_load_all_staged()
    gen = torch.Generator().manual_seed(12)
    rig = staged_rig(case, dev64, gen, poison_pool=True)
    g, P, h, d = rig.g, rig.g.page_size, rig.host_idx, rig.dev_idx.long()
    host = random_like(host_shape(g), rig.dtype, gen)
    view = canonical_view(host, g)
    untouched = torch.ones(rig.pool.layers[0][0].shape[0], dtype=torch.bool)
    untouched[d] = False

    raw.kvio_emul_reset()
    lib.load_all_staged(*rig.args(host, dev64, use_batched))
    for kv, layer in itertools.product(range(g.kv_count), range(g.num_layers)):
        got = rig.pool.layers[kv][layer].view(torch.uint8)
        want = join_heads(view[kv, layer, h // P, h % P]).contiguous().view(torch.uint8)
        assert torch.equal(got[d], want), (kv, layer)
        assert bool((got[untouched] == POISON).all()), (kv, layer)  # untouched slots
    rig.check_counters(raw, use_batched)


def test_staged_load_refuses_what_the_staged_write_back_refuses(emul) -> None:
    lib, _ = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    staging = torch.empty(1 << 12, dtype=torch.uint8)
    for n, staging_bytes, idx in ((6, staging.numel(), host_idx), (8, 100, host_idx),
                                  (8, staging.numel(), host_idx + 1)):
        with pytest.raises(KernelError, match=r"^kvio_load_all_staged: invalid argument"):
            lib.load_all_staged(pool.k_ptrs, pool.v_ptrs, 2, host.data_ptr(), layout_of(g, 2),
                                idx.data_ptr(), dev_idx.data_ptr(), 1, n, staging.data_ptr(),
                                staging_bytes, 1, 0)


def _mha_page_first() -> tuple[Geometry, Pool, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = Geometry(kind=Kind.MHA, layout=Layout.PAGE_FIRST, num_layers=2, size=16, head_num=1,
                 head_dim=8, page_size=4)
    pool = make_pool(g, torch.float16, 16, torch.Generator().manual_seed(1))
    host = torch.zeros(host_shape(g), dtype=torch.float16)
    host_idx = page_indices(g, [1, 2], torch.int64)
    dev_idx = torch.arange(8, dtype=torch.int64)
    return g, pool, host, host_idx, dev_idx


def test_launch_error_becomes_kernel_error(emul) -> None:
    """A launch failure (sticky on HIP as on CUDA) is the DeviceFault kind of KernelError."""
    lib, raw = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    raw.kvio_emul_reset()
    raw.kvio_emul_fail_next(0, 719)  # the launch fails; hipGetLastError reports it
    with pytest.raises(DeviceFault) as err:
        lib.transfer_direct(1, pool.k_ptrs, pool.v_ptrs, 0, 2, host.data_ptr(),
                            layout_of(g, 2), host_idx.data_ptr(), 1, dev_idx.data_ptr(), 1,
                            8, 0)
    assert err.value.code == 719
    assert str(err.value).startswith("kvio_transfer_direct: unspecified launch failure "
                                     "(hip error 719); a sticky fault")


@pytest.mark.parametrize("which,use_batched", [(1, 0), (2, 1)], ids=["memcpy", "batch"])
def test_copy_error_becomes_kernel_error(emul, which, use_batched) -> None:
    lib, raw = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    staging = torch.empty(1 << 12, dtype=torch.uint8)
    raw.kvio_emul_reset()
    raw.kvio_emul_fail_next(which, 2)
    with pytest.raises(KernelError, match=r"kvio_write_back_staged: out of memory "
                                          r"\(hip error 2\)") as err:
        lib.write_back_staged(pool.k_ptrs, pool.v_ptrs, 2, host.data_ptr(), layout_of(g, 2),
                              host_idx.data_ptr(), dev_idx.data_ptr(), 1, 8,
                              staging.data_ptr(), staging.numel(), use_batched, 0)
    assert err.value.code == 2


def test_batch_not_supported_falls_back_to_per_run(emul) -> None:
    lib, raw = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    staging = torch.empty(1 << 12, dtype=torch.uint8)
    raw.kvio_emul_reset()
    raw.kvio_emul_fail_next(2, 801)  # hipErrorNotSupported from the batch entry point
    lib.write_back_staged(pool.k_ptrs, pool.v_ptrs, 2, host.data_ptr(), layout_of(g, 2),
                          host_idx.data_ptr(), dev_idx.data_ptr(), 1, 8, staging.data_ptr(),
                          staging.numel(), 1, 0)
    c = counters(raw)
    assert c["memcpy"] == 2  # pages 1, 2 merged: one run per K/V
    view = canonical_view(host, g)
    for kv, layer in itertools.product(range(2), range(2)):
        got = join_heads(view[kv, layer, host_idx // 4, host_idx % 4])
        assert torch.equal(got.view(torch.uint8), pool.layers[kv][layer][dev_idx].view(torch.uint8))


@pytest.mark.parametrize("what", ["unaligned-tokens", "tiny-staging", "not-contiguous",
                                  "unaligned-page"])
def test_staged_refusals_are_invalid_value(emul, what) -> None:
    lib, _ = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    strides = layout_of(g, 2)
    staging = torch.empty(1 << 12, dtype=torch.uint8)
    n, staging_bytes = 8, staging.numel()
    if what == "unaligned-tokens":
        n = 6
    elif what == "tiny-staging":
        staging_bytes = 100
    elif what == "not-contiguous":
        lf = Geometry(kind=Kind.MHA, layout=Layout.LAYER_FIRST, num_layers=2, size=16,
                      head_num=1, head_dim=8, page_size=4)
        strides = layout_of(lf, 2)
    else:
        host_idx = host_idx + 1
    with pytest.raises(KernelError, match=r"invalid argument \(hip error 1\)") as err:
        lib.write_back_staged(pool.k_ptrs, pool.v_ptrs, 2, host.data_ptr(), strides,
                              host_idx.data_ptr(), dev_idx.data_ptr(), 1, n,
                              staging.data_ptr(), staging_bytes, 1, 0)
    assert err.value.code == 1


def test_direct_refusals_and_no_ops(emul) -> None:
    lib, raw = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    fields = layout_of(g, 2)
    # a bad direction: the binding refuses it before any call, the library on its own too
    with pytest.raises(InvalidArgument, match="direction"):
        lib.transfer_direct(2, pool.k_ptrs, pool.v_ptrs, 0, 2, host.data_ptr(), fields,
                            host_idx.data_ptr(), 1, dev_idx.data_ptr(), 1, 8, 0)
    assert lib._lib.kvio_transfer_direct(2, pool.k_ptrs, pool.v_ptrs, 0, 2, host.data_ptr(),
                                         make_layout(fields), host_idx.data_ptr(), 1,
                                         dev_idx.data_ptr(), 1, 8, None,
                                         unchecked_bounds()) == 1
    with pytest.raises(KernelError):
        lib.transfer_direct(0, pool.k_ptrs, pool.v_ptrs, 0, 2, host.data_ptr(),
                            {**fields, "chunk_bytes": 0}, host_idx.data_ptr(), 1,
                            dev_idx.data_ptr(), 1, 8, 0)
    raw.kvio_emul_reset()
    lib.transfer_direct(0, pool.k_ptrs, pool.v_ptrs, 0, 2, host.data_ptr(), fields,
                        host_idx.data_ptr(), 1, dev_idx.data_ptr(), 1, 0, 0)  # no tokens
    lib.transfer_direct(0, pool.k_ptrs, pool.v_ptrs, 0, 0, host.data_ptr(), fields,
                        host_idx.data_ptr(), 1, dev_idx.data_ptr(), 1, 8, 0)  # no layers
    assert counters(raw)["launches"] == 0


def test_library_facts(emul) -> None:
    lib, _ = emul
    assert lib.abi_version() == ABI_VERSION
    assert lib.has_batched_memcpy() is True  # found by dladdr + dlsym, like libamdhip64's
    assert lib.error_string(1) == "invalid argument"


# --------------------------------------------------------------------------- ABI v2 bounds

EPOCH = 0x8000_0000_0000_0007  # a full 64-bit epoch
SLACK = 8  # rows allocated past the valid range, where a stray write would show


def _report() -> tuple[KvioReport, int]:
    """A kvio_report (host memory: the emulated GPU stores to it at the same address),
    poisoned so an unwritten field shows."""
    report = KvioReport(host_epoch=0x1111, host_value=-0x1111, device_epoch=0x2222,
                        device_value=-0x2222)
    return report, ctypes.addressof(report)


def _fields(report: KvioReport) -> tuple[int, int, int, int]:
    return (report.host_epoch, report.host_value, report.device_epoch, report.device_value)


BOUNDS_CASES = [
    (Kind.MHA, Layout.PAGE_FIRST, 2, 8, torch.bfloat16),  # v16, layers innermost
    (Kind.MHA, Layout.LAYER_FIRST, 1, 4, torch.float16),  # v8, tokens innermost
    (Kind.MHA, Layout.PAGE_HEAD, 2, 3, torch.uint8),  # v1, chunks
]


@pytest.mark.parametrize("case", BOUNDS_CASES, ids=[case_id(c) for c in BOUNDS_CASES])
@pytest.mark.parametrize("direction", [0, 1], ids=["d2h", "h2d"])
@pytest.mark.parametrize("bad", ["device-high", "device-negative", "host-high", "both"])
def test_direct_skips_an_out_of_range_index_and_reports_it(emul, case, direction, bad) -> None:
    """One token's index out of its bounds: no byte of that token is read or written (the
    valid range is followed by SLACK allocated rows, so a stray access would show), every
    other token is copied exactly onto random destinations, the report holds the epoch and
    the bad value."""
    lib, _ = emul
    kind, layout, heads, dim, dtype = case
    L, P, size, dev_tokens = 3, 4, 64, 40
    g = Geometry(kind=kind, layout=layout, num_layers=L, size=size, head_num=heads,
                 head_dim=dim, page_size=P)
    host_tokens = size - SLACK  # the host buffer holds `size` tokens, only these are valid
    gen = torch.Generator().manual_seed(hash((case_id(case), direction, bad)) & 0xFFFF)
    host_idx = page_indices(g, [1, 6, 3], torch.int64)
    n = host_idx.numel()
    dev_idx = torch.randperm(dev_tokens, generator=gen)[:n]
    j = 5  # the bad token
    if bad in ("device-high", "both"):
        dev_idx[j] = dev_tokens + 3
    if bad == "device-negative":
        dev_idx[j] = -2
    if bad in ("host-high", "both"):
        host_idx[j] = host_tokens + 1  # a host slot inside the allocation, past the bounds
    good = torch.ones(n, dtype=torch.bool)
    good[j] = False
    # the pool has SLACK rows past device_tokens; negative indices would land before it, so
    # every layer tensor is a view that starts SLACK rows into its allocation
    pool = make_pool(g, dtype, dev_tokens + 2 * SLACK, gen)
    for per in pool.layers:
        for i, t in enumerate(per):
            per[i] = t[SLACK:]
    pool.ptrs = [torch.tensor([t.data_ptr() for t in per], dtype=torch.int64)
                 for per in pool.layers]
    backing = [[t._base if t._base is not None else t for t in per] for per in pool.layers]
    host = random_like(host_shape(g), dtype, gen)
    view = canonical_view(host, g)
    h, d = host_idx[good], dev_idx[good]
    layers = range(L)
    if direction == 0:
        expected_host = host.clone()
        ev = canonical_view(expected_host, g)
        for kv, layer in itertools.product(range(g.kv_count), layers):
            ev[kv, layer, h // P, h % P] = split_heads(pool.layers[kv][layer][d], g)
        expected_pool = [[b.clone() for b in per] for per in backing]
    else:
        expected_host = host.clone()
        expected_pool = [[b.clone() for b in per] for per in backing]
        for kv, layer in itertools.product(range(g.kv_count), layers):
            expected_pool[kv][layer][SLACK:][d] = join_heads(view[kv, layer, h // P, h % P])
    report, addr = _report()
    bounds = make_bounds(host_tokens, dev_tokens, addr, EPOCH)

    lib.transfer_direct(direction, pool.k_ptrs, pool.v_ptrs, 0, L, host.data_ptr(),
                        layout_of(g, dtype.itemsize), host_idx.data_ptr(), 1,
                        dev_idx.data_ptr(), 1, n, 0, bounds=bounds)

    assert torch.equal(host.view(torch.uint8), expected_host.view(torch.uint8))
    for kv, layer in itertools.product(range(g.kv_count), layers):
        assert torch.equal(backing[kv][layer].view(torch.uint8),
                           expected_pool[kv][layer].view(torch.uint8)), (kv, layer)
    host_bad = bad in ("host-high", "both")
    dev_bad = bad != "host-high"
    assert _fields(report) == (
        EPOCH if host_bad else 0x1111, int(host_idx[j]) if host_bad else -0x1111,
        EPOCH if dev_bad else 0x2222, int(dev_idx[j]) if dev_bad else -0x2222)


def test_direct_in_range_leaves_the_report_alone(emul) -> None:
    lib, _ = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    host.view(torch.uint8).copy_(torch.randint(0, 256, host.view(torch.uint8).shape,
                                               generator=torch.Generator().manual_seed(3),
                                               dtype=torch.uint8))
    report, addr = _report()
    # the bounds are exact: the largest index of each side is the last valid one
    lib.transfer_direct(0, pool.k_ptrs, pool.v_ptrs, 0, 2, host.data_ptr(), layout_of(g, 2),
                        host_idx.data_ptr(), 1, dev_idx.data_ptr(), 1, 8, 0,
                        bounds=make_bounds(int(host_idx.max()) + 1, int(dev_idx.max()) + 1,
                                           addr, EPOCH))
    assert _fields(report) == (0x1111, -0x1111, 0x2222, -0x2222)
    view = canonical_view(host, g)
    for kv, layer in itertools.product(range(2), range(2)):
        assert torch.equal(join_heads(view[kv, layer, host_idx // 4, host_idx % 4])
                           .view(torch.uint8), pool.layers[kv][layer][dev_idx].view(torch.uint8))


@pytest.mark.parametrize("case", STAGED[:3] + STAGED[4:], ids=[staged_id(c) for c in
                                                               STAGED[:3] + STAGED[4:]])
@pytest.mark.parametrize("dev64", [1, 0], ids=["dev-i64", "dev-i32"])
def test_staged_load_skips_an_out_of_range_device_index_and_reports_it(emul, case,
                                                                       dev64) -> None:
    lib, raw = emul
    gen = torch.Generator().manual_seed(21)
    rig = staged_rig(case, dev64, gen, poison_pool=False)
    g, P = rig.g, rig.g.page_size
    dev_tokens = 120 - SLACK  # the rig's pool has 120 rows: the last SLACK are past bounds
    d = torch.randperm(dev_tokens, generator=gen)[:rig.dev_idx.numel()]  # no duplicates
    j = 9
    d[j] = dev_tokens + 2
    rig.dev_idx.copy_(d.to(rig.dev_idx.dtype))
    good = torch.ones(d.numel(), dtype=torch.bool)
    good[j] = False
    host = random_like(host_shape(g), rig.dtype, gen)
    view = canonical_view(host, g)
    h = rig.host_idx
    before = [[t.clone() for t in per] for per in rig.pool.layers]
    report, addr = _report()

    raw.kvio_emul_reset()
    lib.load_all_staged(*rig.args(host, dev64, 1),
                        bounds=make_bounds(g.size, dev_tokens, addr, EPOCH))
    for kv, layer in itertools.product(range(g.kv_count), range(g.num_layers)):
        want = before[kv][layer].clone()
        want[d[good]] = join_heads(view[kv, layer, h[good] // P, h[good] % P])
        got = rig.pool.layers[kv][layer]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (kv, layer)
    assert _fields(report) == (0x1111, -0x1111, EPOCH, dev_tokens + 2)


@pytest.mark.parametrize("dev64", [1, 0], ids=["dev-i64", "dev-i32"])
def test_staged_write_back_skips_an_out_of_range_device_index_and_reports_it(emul,
                                                                             dev64) -> None:
    """The gather reads no pool byte for the bad token and the report names it; every valid
    token reaches its host slot and every page outside the transfer is untouched. (The page
    image is copied to the host whole, so the bad token's own host slot receives what the
    staging buffer held there: docs/native-abi.md.)"""
    lib, _ = emul
    gen = torch.Generator().manual_seed(22)
    rig = staged_rig(STAGED[0], dev64, gen, poison_pool=False)
    g, P = rig.g, rig.g.page_size
    dev_tokens = 120 - SLACK
    d = torch.randperm(dev_tokens, generator=gen)[:rig.dev_idx.numel()]  # no duplicates
    j = 13
    d[j] = -1 if dev64 else dev_tokens
    rig.dev_idx.copy_(d.to(rig.dev_idx.dtype))
    host = random_like(host_shape(g), rig.dtype, gen)
    expected = host.clone()
    ev = canonical_view(expected, g)
    good = torch.ones(d.numel(), dtype=torch.bool)
    good[j] = False
    h = rig.host_idx
    for kv, layer in itertools.product(range(g.kv_count), range(g.num_layers)):
        ev[kv, layer, h[good] // P, h[good] % P] = split_heads(
            rig.pool.layers[kv][layer][d[good]], g)
    report, addr = _report()

    lib.write_back_staged(*rig.args(host, dev64, 0),
                          bounds=make_bounds(g.size, dev_tokens, addr, EPOCH))
    got = canonical_view(host, g).clone()
    # the bad token's slot is the one place that may differ
    got[:, :, h[j] // P, h[j] % P] = 0
    ev[:, :, h[j] // P, h[j] % P] = 0
    assert torch.equal(got.view(torch.uint8), ev.view(torch.uint8))
    assert _fields(report) == (0x1111, -0x1111, EPOCH, int(d[j]))


@pytest.mark.parametrize("function", ["write_back_staged", "load_all_staged"])
@pytest.mark.parametrize("where", ["first-token", "inside-a-page", "negative"])
def test_staged_refuses_an_out_of_range_cpu_host_index_before_enqueueing(emul, function,
                                                                         where) -> None:
    lib, raw = emul
    gen = torch.Generator().manual_seed(23)
    rig = staged_rig(STAGED[0], 1, gen, poison_pool=False)
    g = rig.g
    host_tokens = 23 * g.page_size  # STAGED_PAGES reach page 23: its tokens are now invalid
    if where == "inside-a-page":  # whole pages in bounds but the last page's tail
        host_tokens = 24 * g.page_size - 1
    if where == "negative":
        host_tokens = g.size
        rig.host_idx[4 * g.page_size + 1] = -1  # not a whole page either; the bounds say no
    host = random_like(host_shape(g), rig.dtype, gen)
    host_before = host.clone()
    pool_before = [[t.clone() for t in per] for per in rig.pool.layers]
    report, addr = _report()

    raw.kvio_emul_reset()
    with pytest.raises(KernelError, match=rf"^kvio_{function}: invalid argument") as err:
        getattr(lib, function)(*rig.args(host, 1, 1),
                               bounds=make_bounds(host_tokens, 120, addr, EPOCH))
    assert err.value.code == 1
    c = counters(raw)
    assert (c["launches"], c["memcpy"], c["batch_calls"]) == (0, 0, 0)  # nothing enqueued
    assert torch.equal(host.view(torch.uint8), host_before.view(torch.uint8))
    for kv, layer in itertools.product(range(g.kv_count), range(g.num_layers)):
        assert torch.equal(rig.pool.layers[kv][layer].view(torch.uint8),
                           pool_before[kv][layer].view(torch.uint8))
    assert _fields(report) == (0x1111, -0x1111, 0x2222, -0x2222)


def test_a_null_bounds_pointer_or_report_is_invalid(emul) -> None:
    lib, raw = emul
    g, pool, host, host_idx, dev_idx = _mha_page_first()
    layout = make_layout(layout_of(g, 2))
    staging = torch.empty(1 << 12, dtype=torch.uint8)
    no_report = KvioBounds(host_tokens=16, device_tokens=16, report=0, epoch=1)
    raw.kvio_emul_reset()
    for bounds in (None, no_report):
        assert lib._lib.kvio_transfer_direct(0, pool.k_ptrs, pool.v_ptrs, 0, 2,
                                             host.data_ptr(), layout, host_idx.data_ptr(), 1,
                                             dev_idx.data_ptr(), 1, 8, None, bounds) == 1
        assert lib._lib.kvio_write_back_staged(pool.k_ptrs, pool.v_ptrs, 2, host.data_ptr(),
                                               layout, host_idx.data_ptr(),
                                               dev_idx.data_ptr(), 1, 8, staging.data_ptr(),
                                               staging.numel(), 1, None, bounds) == 1
    assert counters(raw)["launches"] == 0
    with pytest.raises(InvalidArgument, match=r"bounds\.report"):
        lib.transfer_direct(0, pool.k_ptrs, pool.v_ptrs, 0, 2, host.data_ptr(), layout,
                            host_idx.data_ptr(), 1, dev_idx.data_ptr(), 1, 8, 0,
                            bounds=no_report)


# -- page_unified against the reference backend -------------------------------------------------
#
# page_unified's native strides cut an element into head-group chunks (chunk_stride = the
# head group's stride), which kvio_device.h's kvio_copy_body addresses as
#   host_base + kv*kv_stride + l*layer_stride + page*page_stride + off*token_stride
#             + c*chunk_stride  <->  layer_ptr + d*elem_bytes + c*chunk_bytes
# (kvio_cuda.cu's locate is the same formula). These run the real kernel bodies and compare
# with kvio_reference's result on the same random data, destinations poisoned.

UNIFIED_CASES = [  # kind, heads, head_dim, dtype, head_group_num
    (Kind.MHA, 8, 8, torch.bfloat16, 1),
    (Kind.MHA, 8, 8, torch.bfloat16, 2),
    (Kind.MHA, 8, 8, torch.bfloat16, 4),
    (Kind.MHA, 6, 4, torch.float16, 3),  # 16-byte chunks of 2 heads
    (Kind.MHA, 4, 2, torch.float32, 2),  # 16-byte chunks of 2 heads of 8-byte items
    (Kind.MLA, 1, 40, torch.bfloat16, 1),  # 80 B (page_unified rows are 16-byte multiples)
]


def _unified_id(c: tuple) -> str:
    kind, h, d, dt, groups = c
    return f"{kind.value}-h{h}d{d}g{groups}-{str(dt).removeprefix('torch.')}"


def _unified_pools(case: tuple, gen: torch.Generator, poison_device: bool):
    from kvcore.pools import DevicePool, HostPool

    kind, heads, dim, dtype, groups = case
    g = Geometry(kind=kind, layout=Layout.PAGE_UNIFIED, num_layers=3, size=48, head_num=heads,
                 head_dim=dim, page_size=4, head_group_num=groups)
    dev = DevicePool.allocate(kind, 3, 60, heads, dim, dtype, "cpu", 4)
    for t in dev.all_buffers():
        if poison_device:
            t.view(torch.uint8).fill_(POISON)
        else:
            t.copy_(random_like(tuple(t.shape), dtype, gen))
    buf = (torch.full(host_shape(g), 0, dtype=dtype) if not poison_device
           else random_like(host_shape(g), dtype, gen))
    if not poison_device:
        buf.view(torch.uint8).fill_(POISON)
    host = HostPool.wrap(buf, kind, Layout.PAGE_UNIFIED, 3, heads, dim, 4,
                         head_group_num=groups)
    return g, dev, host


def _reference(op: str, dev, host, h: torch.Tensor, d: torch.Tensor,
               layer: int | None = None) -> None:
    from kvcore.registry import Registry, make_request

    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    g = host.geometry
    req = make_request(op, g.kind, g.layout, dev.dtype, dev.element_bytes, "cpu")
    reg.resolve(req, "reference").transfer(dev, host, h, d, layer=layer)


def _pool_bytes(dev) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in dev.all_buffers()]


@pytest.mark.parametrize("case", UNIFIED_CASES, ids=[_unified_id(c) for c in UNIFIED_CASES])
@pytest.mark.parametrize("op", ["write_back", "load_all", "load_layer"])
def test_page_unified_direct_equals_the_reference(emul, case, op) -> None:
    lib, _ = emul
    gen = torch.Generator().manual_seed(hash(_unified_id(case) + op) & 0xFFFF)
    g, dev, host = _unified_pools(case, gen, poison_device=op != "write_back")
    h = page_indices(g, [7, 2, 3, 10, 0], torch.int64)
    d = torch.randperm(60, generator=gen)[:h.numel()]
    ref_dev = dev.clone()
    ref_host = _twin_host(host)
    fields = layout_of(g, dev.dtype.itemsize)
    if op == "write_back":
        lib.transfer_direct(0, dev.k_ptrs.data_ptr(), _v(dev), 0, 3, host.buffer.data_ptr(),
                            fields, h.data_ptr(), 1, d.data_ptr(), 1, h.numel(), 0)
        _reference(op, ref_dev, ref_host, h, d)
        assert torch.equal(host.buffer.view(torch.uint8), ref_host.buffer.view(torch.uint8))
        return
    layers = range(3) if op == "load_layer" else [None]
    for layer in layers:
        begin, count = (0, 3) if layer is None else (layer, 1)
        lib.transfer_direct(1, dev.k_ptrs.data_ptr(), _v(dev), begin, count,
                            host.buffer.data_ptr(), fields, h.data_ptr(), 1, d.data_ptr(), 1,
                            h.numel(), 0)
        _reference(op, ref_dev, host, h, d, layer=layer)
    for got, want in zip(_pool_bytes(dev), _pool_bytes(ref_dev), strict=True):
        assert torch.equal(got, want)
    untouched = torch.ones(60, dtype=torch.bool)
    untouched[d] = False
    assert all(bool((t.view(torch.uint8)[untouched] == POISON).all()) for t in dev.all_buffers())


def _twin_host(host):  # a pool over a copy of the buffer
    from kvcore.pools import HostPool

    g = host.geometry
    return HostPool.wrap(host.buffer.clone(), g.kind, g.layout, g.num_layers, g.head_num,
                         g.head_dim, g.page_size, head_group_num=g.head_group_num)


def _v(dev) -> int:
    return dev.v_ptrs.data_ptr() if dev.v_ptrs is not None else 0


@pytest.mark.parametrize("direction", ["write_back", "load_all"])
def test_page_unified_mla_staged_equals_the_reference(emul, direction) -> None:
    """MLA page_unified pages are one run each, so the staged path takes them."""
    lib, raw = emul
    case = (Kind.MLA, 1, 40, torch.bfloat16, 1)
    gen = torch.Generator().manual_seed(21)
    g, dev, host = _unified_pools(case, gen, poison_device=direction == "load_all")
    h = page_indices(g, [5, 6, 1, 9], torch.int64)
    d = torch.randperm(60, generator=gen)[:h.numel()]
    ref_dev, ref_host = dev.clone(), _twin_host(host)
    staging = torch.full((1 << 14,), POISON, dtype=torch.uint8)
    fn = lib.write_back_staged if direction == "write_back" else lib.load_all_staged
    raw.kvio_emul_reset()
    fn(dev.k_ptrs.data_ptr(), 0, 3, host.buffer.data_ptr(), layout_of(g, 2), h.data_ptr(),
       d.data_ptr(), 1, h.numel(), staging.data_ptr(), staging.numel(), 1, 0)
    _reference(direction, ref_dev, ref_host, h, d)
    assert torch.equal(host.buffer.view(torch.uint8), ref_host.buffer.view(torch.uint8))
    for got, want in zip(_pool_bytes(dev), _pool_bytes(ref_dev), strict=True):
        assert torch.equal(got, want)
    assert counters(raw)["bytes"] == 4 * 3 * 4 * 80  # whole pages copied, nothing else


def test_the_staged_path_refuses_pages_that_are_not_one_run(emul) -> None:
    """layer_first: a page of K is one slice per layer and K and V are apart, so neither a page
    of K nor the whole page is one run: the library refuses the staged path (and kvcore does
    not declare it there, native_ops)."""
    lib, _ = emul
    g = Geometry(kind=Kind.MHA, layout=Layout.LAYER_FIRST, num_layers=3, size=16, head_num=2,
                 head_dim=8, page_size=4)
    assert not page_contiguous(g) and not page_block_contiguous(g)
    pool = make_pool(g, torch.bfloat16, 16, torch.Generator().manual_seed(3))
    host = torch.zeros(host_shape(g), dtype=torch.bfloat16)
    h = page_indices(g, [1], torch.int64)
    d = torch.arange(4)
    staging = torch.empty(1 << 14, dtype=torch.uint8)
    with pytest.raises(KernelError, match=r"invalid argument"):
        lib.write_back_staged(pool.k_ptrs, pool.v_ptrs, 3, host.data_ptr(), layout_of(g, 2),
                              h.data_ptr(), d.data_ptr(), 1, 4, staging.data_ptr(),
                              staging.numel(), 1, 0)


def test_copy_to_device_is_one_async_copy_and_reports_the_runtimes_error(
        emul: tuple[NativeLibrary, ctypes.CDLL]) -> None:
    lib, raw = emul
    assert "kvio_copy_to_device" in lib.optional
    copy = lib.unchecked("kvio_copy_to_device")
    src = torch.randint(-2**62, 2**62, (37,), generator=torch.Generator().manual_seed(8))
    dst = torch.full((40,), -1, dtype=torch.int64)  # poisoned, three slots past the copy
    before = counters(raw)
    copy(dst.data_ptr(), src.data_ptr(), 37 * 8, None)
    after = counters(raw)
    assert (after["memcpy"] - before["memcpy"], after["bytes"] - before["bytes"]) == (1, 37 * 8)
    assert torch.equal(dst[:37], src) and (dst[37:] == -1).all()
    raw.kvio_emul_fail_next(1, 2)  # the runtime's copy fails: out of memory
    with pytest.raises(KernelError, match=r"^kvio_copy_to_device: out of memory"):
        copy(dst.data_ptr(), src.data_ptr(), 8, None)
    with pytest.raises(KernelError, match=r"^kvio_copy_to_device: invalid argument"):
        copy(None, src.data_ptr(), 8, None)
