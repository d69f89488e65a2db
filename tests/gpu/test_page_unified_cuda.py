"""kvio_cuda on page_unified host pools (SGLang 0.5.23), head groups included, against the
reference on the GPU (CUDA machines only; skipped with the reason elsewhere).

`kvio check cuda` covers page_unified through the capability records (one head group and the
most groups up to 4 its elements allow); these add 1, 2 and 4 groups on one 8-head element and
every index pattern of test_cuda_paths, for each op as the plan selects its variant (the
staged variants for whole pages: MHA stages K and V together, they alternate inside a page;
MLA's pages are one run).
"""

from __future__ import annotations

import pytest
import torch
from cuda_marks import needs_kvio_cuda

from kvcore import DevicePool, HostPool
from kvcore.cli.common import default_device
from kvcore.layout import Op
from kvcore.registry import allocate_host_pool, default_registry, make_request
from kvcore.verify import random_fill

DEVICE = default_device()
PAGE, LAYERS, POOL_PAGES = 64, 6, 48


pytestmark = needs_kvio_cuda(DEVICE)

GEOMETRIES = {"mha": (8, 128), "mla": (1, 576)}  # 2048-B and 1152-B elements in bf16


def _pools(kind: str, groups: int, gen: torch.Generator) -> tuple[DevicePool, HostPool]:
    heads, dim = GEOMETRIES[kind]
    dev = DevicePool.allocate(kind, LAYERS, POOL_PAGES * PAGE, heads, dim, torch.bfloat16,
                              DEVICE, PAGE)
    host = allocate_host_pool(kind, "page_unified", LAYERS, POOL_PAGES * PAGE, heads, dim,
                             torch.bfloat16, PAGE, DEVICE, backend="cuda",
                             head_group_num=groups)
    for t in (*dev.all_buffers(), host.buffer):
        random_fill(t, gen)
    return dev, host


def _plan(op: Op, kind: str, backend: str):
    heads, dim = GEOMETRIES[kind]
    req = make_request(op, kind, "page_unified", torch.bfloat16, heads * dim * 2, DEVICE)
    return default_registry().resolve(req, backend)


def _tokens(pages: list[int]) -> torch.Tensor:
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * PAGE + torch.arange(PAGE)).flatten()


def _index_patterns(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """test_cuda_paths' patterns: merged runs, scattered reversed pages, single tokens, and
    device slots starting mid-page."""
    perm = torch.randperm(POOL_PAGES, generator=gen).tolist()
    within = _tokens([3, 4])
    return {
        "adjacent": (_tokens([5, 6, 7, 20, 21]), _tokens([30, 31, 32, 1, 2])),
        "scattered": (_tokens(perm[:17][::-1]), _tokens(perm[17:34])),
        "tokens": (within, within[torch.randperm(within.numel(), generator=gen)]),
        "ragged": (_tokens([8, 9]), torch.arange(7, 7 + 2 * PAGE)),
    }


@pytest.mark.parametrize(("kind", "groups"), [("mha", 1), ("mha", 2), ("mha", 4), ("mla", 1)])
@pytest.mark.parametrize("op", list(Op), ids=[o.value for o in Op])
def test_page_unified_equals_the_reference(kind: str, groups: int, op: Op) -> None:
    gen = torch.Generator().manual_seed(groups * 31 + list(Op).index(op))
    plan, ref = _plan(op, kind, "cuda"), _plan(op, kind, "reference")
    for name, (h, d) in _index_patterns(gen).items():
        dev, host = _pools(kind, groups, gen)
        d = d.to(DEVICE)
        if plan.select(plan.page_bytes(PAGE, LAYERS)).variant == "staged" and \
                name in ("tokens", "ragged"):
            continue  # the staged variants move whole pages only
        ref_dev = dev.clone()
        g = host.geometry
        ref_host = HostPool.wrap(host.buffer.clone(), kind, "page_unified", LAYERS,
                                 g.head_num, g.head_dim, PAGE, head_group_num=groups)
        layers = range(LAYERS) if op is Op.LOAD_LAYER else [None]
        for layer in layers:
            plan.transfer(dev, host, h, d, layer=layer)
            ref.transfer(ref_dev, ref_host, h, d, layer=layer)
        torch.cuda.synchronize()
        # everything compared, untouched bytes included (both sides started equal)
        assert torch.equal(host.buffer.view(torch.int16), ref_host.buffer.view(torch.int16)), \
            name
        for got, want in zip(dev.all_buffers(), ref_dev.all_buffers(), strict=True):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("op", [Op.WRITE_BACK, Op.LOAD_ALL], ids=["write_back", "load_all"])
@pytest.mark.parametrize("staging_pages", [1, 3, 64], ids=lambda n: f"staging{n}")
def test_whole_page_staging_equals_the_reference(groups: int, op: Op,
                                                 staging_pages: int) -> None:
    """The library's staged functions on MHA page_unified pages (K and V alternate inside one
    run, so whole pages are staged), called directly: one page of staging (no pipeline), three
    (chunks), 64 (pipelined halves)."""
    from kvio_cuda.backend import CudaBackend

    from kvcore.native import layout_fields

    gen = torch.Generator().manual_seed(groups * 7 + staging_pages)
    lib = CudaBackend(torch.device(DEVICE)).lib
    fn = lib.write_back_staged if op is Op.WRITE_BACK else lib.load_all_staged
    ref = _plan(op, "mha", "reference")
    for name, (h, d) in _index_patterns(gen).items():
        if name in ("tokens", "ragged"):
            continue  # whole pages only
        dev, host = _pools("mha", groups, gen)
        ref_dev = dev.clone()
        g = host.geometry
        ref_host = HostPool.wrap(host.buffer.clone(), "mha", "page_unified", LAYERS,
                                 g.head_num, g.head_dim, PAGE, head_group_num=groups)
        d = d.to(DEVICE)
        block = 2 * LAYERS * PAGE * g.head_num * g.head_dim * 2
        staging = torch.empty(staging_pages * block, dtype=torch.uint8, device=DEVICE)
        fn(dev.k_ptrs.data_ptr(), dev.v_ptrs.data_ptr(), LAYERS, host.buffer.data_ptr(),
           layout_fields(host.strides), h.data_ptr(), d.data_ptr(), 1, h.numel(),
           staging.data_ptr(), staging.numel(), 1, torch.cuda.current_stream().cuda_stream)
        ref.transfer(ref_dev, ref_host, h, d)
        torch.cuda.synchronize()
        assert torch.equal(host.buffer.view(torch.int16), ref_host.buffer.view(torch.int16)), \
            name
        for got, want in zip(dev.all_buffers(), ref_dev.all_buffers(), strict=True):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
