"""The controller along the path a GPU takes, with real bytes, on the CPU.

kvio_rocm's real host source and kernel bodies, built as a CPU library (``-DKVIO_EMULATE``),
run under :func:`kvcore.testing.stand_in_streams`: the controller's transfer streams, fences
and events are stand-ins, so CPU host indices go through the index ring into "device" memory
with the library's ``kvio_copy_to_device``, as they do on a GPU, and the kernels move real
bytes. Every step is compared byte for byte, whole pools (so untouched slots too), with the
same steps through the reference backend on the same fresh random data; destination pages
hold random poison, never zeros. Ordering between streams is not exercised (nothing here
runs asynchronously); what is: index placement through the ring and its reuse, the staged and
direct native runners, the write queue, load handles and their waits.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvio_rocm import CAPABILITIES
from kvio_rocm._native import NativeLibrary

import kvcore.plan
from kvcore import DevicePool, HiCacheController, HostPool
from kvcore.capabilities import Available, BackendSpec, Capabilities, HostMemory
from kvcore.errors import ControllerUnusable, DeviceFault, KernelError, TransferFailed
from kvcore.layout import Geometry, Kind, Layout, Op, host_shape
from kvcore.native import NativeBackend
from kvcore.placement import SLOT_ALIGN, IndexRing
from kvcore.registry import Registry
from kvcore.testing.stand_in_streams import stand_in_streams
from kvcore.verify import random_fill

REFERENCE = Registry({"KVCORE_PLUGINS": ""})

#: (kind, layout, layers, heads, head_dim, page_size): the first MHA row's pages are 64 KiB,
#: so write-back and all-layer load take kvio_rocm's staged variant; the others go direct
CASES = [
    (Kind.MHA, Layout.PAGE_FIRST, 2, 4, 128, 32),
    (Kind.MHA, Layout.PAGE_FIRST, 3, 2, 16, 4),
    (Kind.MHA, Layout.LAYER_FIRST, 3, 2, 16, 4),
    (Kind.MLA, Layout.PAGE_FIRST, 2, 1, 64, 8),
]
DEVICE_PAGES, HOST_PAGES = 12, 10


def _case_id(case: tuple[Any, ...]) -> str:
    kind, layout, layers, heads, dim, page = case
    return f"{kind.value}-{layout.value}-{layers}x{heads}x{dim}-p{page}"


@pytest.fixture
def on_gpu_path(emulated_library: Path) -> Iterator[Registry]:
    """A registry whose only backend is kvio_rocm's emulated library, claiming the CPU, with
    the CPU treated as a device with streams for the test's duration."""

    class Emulated(NativeBackend):
        def __init__(self, device: torch.device) -> None:
            super().__init__(device, NativeLibrary(emulated_library))
            upload = self.upload_indices
            self.uploads = 0  # index copies to the "device" through the library

            def counted(dst: int, src: int, nbytes: int, stream: Any) -> None:
                self.uploads += 1
                upload(dst, src, nbytes, stream)

            self.upload_indices = counted

        def allocate_host(self, shape: tuple[int, ...],
                          dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
            return torch.empty(shape, dtype=dtype), HostMemory.PLAIN

    registry = Registry({"KVCORE_PLUGINS": ""})
    registry.register(BackendSpec(capabilities=Capabilities(
        name="rocm_emulated", version="0", api_version=CAPABILITIES.api_version,
        platform="cpu emulation", priority=1000, probe=Available, ops=CAPABILITIES.ops,
        host_memory=HostMemory.PLAIN, device_types=frozenset({"cpu"})), factory=Emulated))
    with stand_in_streams("cpu"):
        yield registry


def _pools(case: tuple[Any, ...], seed: int) -> tuple[DevicePool, HostPool]:
    kind, layout, layers, heads, dim, page = case
    gen = torch.Generator().manual_seed(seed)
    dev = DevicePool.allocate(kind, layers, DEVICE_PAGES * page, heads, dim, torch.bfloat16,
                              "cpu", page)
    g = Geometry(kind, layout, layers, HOST_PAGES * page, heads, dim, page)
    host = HostPool.wrap(torch.empty(host_shape(g), dtype=torch.bfloat16), kind, layout,
                         layers, heads, dim, page)
    for t in [*dev.all_buffers(), host.buffer]:
        random_fill(t, gen)
    return dev, host


def _twin(dev: DevicePool, host: HostPool) -> tuple[DevicePool, HostPool]:
    """The same pools, cloned (the reference's copy of the starting state)."""
    g = host.geometry
    twin = DevicePool.allocate(dev.kind, dev.num_layers, dev.size, dev.head_num, dev.head_dim,
                               dev.dtype, "cpu", dev.page_size)
    for a, b in zip(twin.all_buffers(), dev.all_buffers(), strict=True):
        a.copy_(b)
    return twin, HostPool.wrap(host.buffer.clone(), g.kind, g.layout, g.num_layers, g.head_num,
                               g.head_dim, g.page_size)


def _assert_same(what: str, a: tuple[DevicePool, HostPool],
                 b: tuple[DevicePool, HostPool]) -> None:
    assert torch.equal(a[1].buffer.view(torch.int16), b[1].buffer.view(torch.int16)), \
        f"{what}: host pools differ"
    for i, (x, y) in enumerate(zip(a[0].all_buffers(), b[0].all_buffers(), strict=True)):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), \
            f"{what}: device buffer {i} differs"


def _pages(pages: list[int], page: int) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * page + torch.arange(page)).flatten()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_writes_and_loads_move_what_the_reference_moves(on_gpu_path: Registry,
                                                        case: tuple[Any, ...]) -> None:
    page = case[-1]
    gen = torch.Generator().manual_seed(7)
    native = _pools(case, seed=11)
    ref = _twin(*native)
    ctl = HiCacheController(*native, registry=on_gpu_path)
    ref_ctl = HiCacheController(*ref, registry=REFERENCE)
    assert ctl.plan("write_back").backend_name == "rocm_emulated"
    for step in range(4):
        src = _pages(torch.randperm(DEVICE_PAGES, generator=gen)[:2].tolist(), page)
        acks = [c.write(src) for c in (ctl, ref_ctl)]
        assert [len(c.wait_acks()) for c in (ctl, ref_ctl)] == [1, 1]
        assert torch.equal(acks[0].host_indices, acks[1].host_indices)
        _assert_same(f"step {step}: write-back", native, ref)
        dst = _pages(torch.randperm(DEVICE_PAGES, generator=gen)[:2].tolist(), page)
        for all_layers in (False, True):
            for c, ack in zip((ctl, ref_ctl), acks, strict=True):
                handle = c.load(ack.host_indices, dst, all_layers=all_layers)
                for layer in range(handle.num_layers):
                    handle.wait_layer(layer)
                handle.wait()
            _assert_same(f"step {step}: load (all_layers={all_layers})", native, ref)
            # the next load must land on poison again, not on what this one left
            random_fill(native[0].all_buffers()[0], torch.Generator().manual_seed(step))
            random_fill(ref[0].all_buffers()[0], torch.Generator().manual_seed(step))
        for c, ack in zip((ctl, ref_ctl), acks, strict=True):
            c.free_host(ack.host_indices)


def test_the_staged_and_direct_variants_are_the_ones_exercised(on_gpu_path: Registry) -> None:
    ran = set()
    for case in CASES:
        ctl = HiCacheController(*_pools(case, seed=1), registry=on_gpu_path)
        for op in (Op.WRITE_BACK, Op.LOAD_ALL, Op.LOAD_LAYER):
            ran.add((op, ctl.bound[(0, op)].support.variant))
    assert {(Op.WRITE_BACK, "staged"), (Op.LOAD_ALL, "staged"), (Op.WRITE_BACK, "direct"),
            (Op.LOAD_LAYER, "direct")} <= ran


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_per_layer_submits_of_one_cpu_tensor_rewritten_between_layers(
        on_gpu_path: Registry, case: tuple[Any, ...]) -> None:
    """An engine submitting each layer of a load with the same CPU tensor, which it rewrites
    in between (through a NumPy view, which torch's version counter does not see): the ring
    must not hand a layer the slot uploaded for the values of an earlier one."""
    page = case[-1]
    native = _pools(case, seed=3)
    ref = _twin(*native)
    bound = HiCacheController(*native, registry=on_gpu_path).bound[(0, Op.LOAD_LAYER)]
    ref_bound = HiCacheController(*ref, registry=REFERENCE).bound[(0, Op.LOAD_LAYER)]
    layers = native[1].geometry.num_layers
    h = _pages([1, 4], page)
    d = _pages([0, 9], page)
    values = h.numpy()
    for layer in range(layers):
        if layer % 2:  # odd layers from other host pages, same tensor object
            values[:] = _pages([7 - layer, 8], page).numpy()
        else:
            values[:] = _pages([1, 4], page).numpy()
        bound.submit(h, d, layer=layer, chained=layer > 0).check()
        ref_bound.submit(h.clone(), d, layer=layer).check()
    _assert_same("per-layer submits, rewritten", native, ref)
    assert bound.backend.uploads == 1 + layers  # d once, h at every layer (its values moved)

    # unchanged between layers: each tensor is copied to the device once for the whole load
    random_fill(native[0].all_buffers()[0], torch.Generator().manual_seed(5))
    random_fill(ref[0].all_buffers()[0], torch.Generator().manual_seed(5))
    h2, d2 = _pages([2, 6], page), _pages([3, 10], page)
    before = bound.backend.uploads
    for layer in range(layers):
        bound.submit(h2, d2, layer=layer, chained=layer > 0).check()
        ref_bound.submit(h2, d2, layer=layer).check()
    _assert_same("per-layer submits, unchanged", native, ref)
    assert bound.backend.uploads - before == 2


# -- failures along the GPU path -------------------------------------------------------------

#: the index ring's size in the failure tests (4 segments)
RING = 16 << 10

#: the emulation's injectable failures (kvio_emul.h): the next kernel launch, the next
#: async memcpy (the index ring's upload, a staged copy) or the next batched copy
LAUNCH, MEMCPY, BATCH = 0, 1, 2


@pytest.fixture
def inject(emulated_library: Path) -> Iterator[Any]:
    """``inject(which, code)``: fail the emulated runtime's next call of that kind."""
    raw = ctypes.CDLL(str(emulated_library))  # the backend's library (one copy per process)
    raw.kvio_emul_fail_next.argtypes = [ctypes.c_int, ctypes.c_int]
    raw.kvio_emul_reset()
    yield raw.kvio_emul_fail_next
    raw.kvio_emul_reset()


def _controllers(registry: Registry, case: tuple[Any, ...],
                 ) -> tuple[HiCacheController, HiCacheController, Any, Any]:
    native = _pools(case, seed=21)
    ref = _twin(*native)
    return (HiCacheController(*native, registry=registry),
            HiCacheController(*ref, registry=REFERENCE), native, ref)


def _round_trip(ctl: HiCacheController, ref_ctl: HiCacheController, native: Any, ref: Any,
                src: list[int], dst: list[int], page: int) -> None:
    acks = [c.write(_pages(src, page)) for c in (ctl, ref_ctl)]
    for c, ack in zip((ctl, ref_ctl), acks, strict=True):
        c.wait_acks()
        c.load(ack.host_indices, _pages(dst, page)).wait()
    _assert_same("round trip after the failure", native, ref)


@pytest.mark.parametrize("case", CASES[:2], ids=_case_id)  # a staged and a direct write-back
def test_a_failed_write_back_releases_its_slots_is_never_acked_and_the_next_one_works(
        on_gpu_path: Registry, inject: Any, case: tuple[Any, ...]) -> None:
    ctl, ref_ctl, native, ref = _controllers(on_gpu_path, case)
    before = ctl.allocator.state()
    host_before = native[1].buffer.clone()
    for which in (LAUNCH, MEMCPY, BATCH):  # whichever this variant makes first fails
        inject(which, 2)  # out of memory: not sticky
    with pytest.raises(TransferFailed) as err:
        ctl.write(_pages([3, 5], case[-1]))
    assert isinstance(err.value.cause, KernelError)
    assert ctl.allocator.state() == before and ctl.pending_writes == 0
    assert ctl.usable and ctl.wait_acks() == []
    for which in (LAUNCH, MEMCPY, BATCH):
        inject(which, 0)
    # both variants fail at their first launch (the staged one's gather into its staging
    # buffer), before a byte reaches the host pool
    assert torch.equal(native[1].buffer.view(torch.int16), host_before.view(torch.int16))
    ref[1].buffer.copy_(native[1].buffer)
    _round_trip(ctl, ref_ctl, native, ref, [3, 5], [0, 8], case[-1])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_failed_index_upload_fails_the_load_and_the_ring_goes_on(
        on_gpu_path: Registry, inject: Any, case: tuple[Any, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    page = case[-1]
    # a ring of 4 segments of 4 KiB, so that a few dozen loads go round it
    monkeypatch.setattr(kvcore.plan, "IndexRing", functools.partial(IndexRing, capacity=RING))
    ctl, ref_ctl, native, ref = _controllers(on_gpu_path, case)
    ack = ctl.write(_pages([1, 2], page))
    ref_ack = ref_ctl.write(_pages([1, 2], page))
    ctl.wait_acks()
    ref_ctl.wait_acks()
    _assert_same("write-back", native, ref)
    inject(MEMCPY, 2)  # the host indices' copy into the ring's device memory
    with pytest.raises(TransferFailed) as err:
        ctl.load(ack.host_indices, _pages([6, 7], page))
    assert "kvio_copy_to_device" in str(err.value)
    _assert_same("a load whose indices never reached the device moved nothing", native, ref)
    # each load's device indices take a new slot: three times round the ring, every load must
    # still copy its indices through it (not fall back to torch's allocators), so the failed
    # upload's slot must have come back
    fallbacks: list[torch.Tensor] = []
    place = kvcore.plan.place
    monkeypatch.setattr(kvcore.plan, "place", lambda t, *a: fallbacks.append(t) or place(t, *a))
    backend = ctl.bound[(0, Op.LOAD_LAYER)].backend
    uploads = backend.uploads
    slot = -(-2 * page * 8 // SLOT_ALIGN) * SLOT_ALIGN
    loads = 3 * RING // slot
    for n in range(loads):
        dst = _pages([(6 + n) % DEVICE_PAGES, (9 + n) % DEVICE_PAGES], page)
        for c, a in ((ctl, ack), (ref_ctl, ref_ack)):
            c.load(a.host_indices, dst).wait()
    assert fallbacks == []
    assert backend.uploads - uploads > loads  # (the ack's indices again after each reset of
    # the segment their slot is in)
    _assert_same("loads after the failure", native, ref)


def test_a_sticky_launch_failure_makes_the_controller_unusable_and_releases_its_writes(
        on_gpu_path: Registry, inject: Any) -> None:
    case = CASES[1]  # direct write-back and load: every transfer is a kernel launch
    ctl, _, _, _ = _controllers(on_gpu_path, case)
    ack = ctl.write(_pages([0, 1], case[-1]))
    ctl.wait_acks()
    inject(LAUNCH, 719)  # unspecified launch failure: sticky on HIP as on CUDA
    with pytest.raises(TransferFailed) as err:
        ctl.load(ack.host_indices, _pages([4, 5], case[-1]))
    assert isinstance(err.value.cause, DeviceFault)
    assert not ctl.usable
    with pytest.raises(ControllerUnusable, match="device fault"):
        ctl.write(_pages([2, 3], case[-1]))
    with pytest.raises(ControllerUnusable):
        ctl.load(ack.host_indices, _pages([4, 5], case[-1]))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_random_sequences_with_failures_match_the_reference(
        on_gpu_path: Registry, inject: Any, case: tuple[Any, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes, acknowledgements, per-layer and all-layer loads and frees in random order,
    each maybe with the emulated runtime's next launch, copy or batched copy failing: after
    every step both pools and the allocator equal the reference's (which runs exactly the
    steps that succeeded), and the index ring (4 KiB segments, so it goes round often) never
    falls back to torch's allocators."""
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        invariant,
        precondition,
        rule,
        run_state_machine_as_test,
    )

    page = case[-1]
    monkeypatch.setattr(kvcore.plan, "IndexRing", functools.partial(IndexRing, capacity=RING))
    fallbacks: list[torch.Tensor] = []
    place = kvcore.plan.place
    monkeypatch.setattr(kvcore.plan, "place", lambda t, *a: fallbacks.append(t) or place(t, *a))
    failures = st.sampled_from([None, None, LAUNCH, MEMCPY, BATCH])
    page_sets = st.lists(st.integers(0, DEVICE_PAGES - 1), min_size=1, max_size=3, unique=True)

    class Steps(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.native = _pools(case, seed=31)
            self.ref = _twin(*self.native)
            self.ctl = HiCacheController(*self.native, registry=on_gpu_path)
            self.ref_ctl = HiCacheController(*self.ref, registry=REFERENCE)
            self.acks: list[tuple[Any, Any]] = []  # (native, reference), acknowledged

        def _native(self, fail: int | None, call: Any) -> Any:
            """``call()`` on the native controller with ``fail`` armed; None if it failed."""
            if fail is not None:
                inject(fail, 2)  # out of memory: not sticky, the controller goes on
            try:
                return call()
            except TransferFailed as exc:
                assert isinstance(exc.cause, KernelError)
                return None
            finally:
                for which in (LAUNCH, MEMCPY, BATCH):
                    inject(which, 0)

        @rule(pages=page_sets, fail=failures)
        def write(self, pages: list[int], fail: int | None) -> None:
            if self.ref_ctl.allocator.available_size() < len(pages) * page:
                return
            d = _pages(pages, page)
            if self._native(fail, lambda: self.ctl.write(d)) is not None:
                self.ref_ctl.write(d)

        @rule()
        def acknowledge(self) -> None:
            native, ref = self.ctl.wait_acks(), self.ref_ctl.wait_acks()
            assert [a.host_indices.tolist() for a in native] == [
                a.host_indices.tolist() for a in ref]
            self.acks += zip(native, ref, strict=True)

        @precondition(lambda self: self.acks)
        @rule(data=st.data(), pages=page_sets, all_layers=st.booleans(), fail=failures)
        def load(self, data: st.DataObject, pages: list[int], all_layers: bool,
                 fail: int | None) -> None:
            ack, ref_ack = data.draw(st.sampled_from(self.acks))
            n = ack.host_indices.numel() // page  # as many distinct device pages
            dst = _pages([*pages, *(p for p in range(DEVICE_PAGES) if p not in pages)][:n], page)

            def load() -> Any:
                handle = self.ctl.load(ack.host_indices, dst, all_layers=all_layers)
                for layer in range(handle.num_layers):
                    handle.wait_layer(layer)
                handle.wait()
                return handle

            if self._native(fail, load) is not None:
                self.ref_ctl.load(ref_ack.host_indices, dst, all_layers=all_layers).wait()

        @precondition(lambda self: self.acks)
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            ack, ref_ack = self.acks.pop(data.draw(st.integers(0, len(self.acks) - 1)))
            self.ctl.free_host(ack.host_indices)
            self.ref_ctl.free_host(ref_ack.host_indices)

        @invariant()
        def same_as_the_reference(self) -> None:
            _assert_same("after the step", self.native, self.ref)
            assert self.ctl.allocator.state() == self.ref_ctl.allocator.state()
            assert self.ctl.usable and fallbacks == []

    run_state_machine_as_test(Steps, settings=settings(
        max_examples=15, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_bad_input_on_the_gpu_path_gives_the_oracle_result_or_a_typed_error(
        on_gpu_path: Registry) -> None:
    """The reliability suite's random misuse (tests/reliability/bad_input.py: wrong dtypes,
    shapes, devices, out-of-range and duplicate indices, no tensor at all) through a
    controller on the GPU's path with kvio_rocm's emulated kernels: a typed error with
    nothing changed, or exactly the oracle's result. An index that reached the emulated
    kernels out of range would be an out-of-bounds access of this process's memory."""
    from hypothesis import HealthCheck, given, reject, settings
    from hypothesis import strategies as st
    from reliability.bad_input import bad_input_case
    from reliability.helpers import small_pools

    from kvcore.errors import KVCoreError
    from kvcore.layout import head_group_options, layouts_for

    @st.composite
    def controllers(draw: st.DrawFn) -> HiCacheController:
        kind = draw(st.sampled_from(list(Kind)))
        layout = draw(st.sampled_from(layouts_for(kind)))
        head_num = 1 if kind is Kind.MLA else draw(st.integers(1, 2))
        dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
        head_dim = draw(st.sampled_from([8, 16]))  # 16-byte rows: what the kernels move
        if not head_group_options(kind, layout, head_num, head_dim, dtype.itemsize):
            reject()
        pools = small_pools(kind, layout, num_layers=draw(st.integers(1, 2)),
                            head_num=head_num, head_dim=head_dim,
                            page_size=draw(st.sampled_from([1, 2, 4])),
                            device_pages=draw(st.integers(1, 3)),
                            host_pages=draw(st.integers(1, 3)), dtype=dtype,
                            seed=draw(st.integers(0, 2**16)))
        try:
            ctl = HiCacheController(*pools, registry=on_gpu_path)
        except KVCoreError:
            reject()
        assert ctl.plan("write_back").backend_name == "rocm_emulated"
        return ctl

    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        bad_input_case(data, data.draw(controllers()))

    check()
