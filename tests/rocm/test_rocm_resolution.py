"""Pretend to be a ROCm machine and show where the controller puts index tensors.

The availability probe is fed the facts of an MI300 (gfx942) machine, and the backend's
device type is mapped to ``meta`` so pools can exist without an AMD GPU. Everything else is
kvio_rocm's real capability records, resolved by the real registry and controller; the
recording backend stands in only for the native library. The staged write-back must get host
indices on the CPU and every other kernel path must get them on the device: the exact
decision SGLang got wrong on ROCm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import kvio_rocm
import kvio_rocm.probe as rocm_probe
import pytest
import torch

from kvcore import BackendSpec, DevicePool, HiCacheController, HostMemory, HostPool
from kvcore.backend import TransferJob
from kvcore.layout import Op
from kvcore.registry import Registry

MI300 = rocm_probe.RocmFacts(torch_hip_version="6.4.43482", device_count=8, gcn_arch="gfx942",
                             compiler=Path("/opt/rocm/bin/hipcc"),
                             compiler_targets=frozenset({"gfx90a", "gfx942"}),
                             torch_version="2.7.0+rocm6.4", rocm_version="6.4.1")
DEVICE = torch.device("meta")  # stands in for the AMD GPU
LAYERS, PAGE = 4, 64


class RecordingRocm:
    """Records what kvcore hands the kernels (kind, layout, op, variant, index placement)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def allocate_host(self, shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, HostMemory]:
        return torch.empty(shape, dtype=dtype), HostMemory.PINNED

    def run(self, job: TransferJob) -> None:
        self.calls.append({"op": job.op, "variant": job.support.variant, "kind": job.kind,
                           "layout": job.layout, "host": job.host_indices.device.type,
                           "device": job.device_indices.device.type,
                           "host_dtype": job.host_indices.dtype})


@pytest.fixture
def rocm_machine(monkeypatch: pytest.MonkeyPatch) -> tuple[Registry, RecordingRocm]:
    monkeypatch.setattr(rocm_probe, "gather_facts", lambda: MI300)
    assert kvio_rocm.check_availability(), "the injected facts must make kvio_rocm available"
    registry = Registry(environ={"KVCORE_PLUGINS": "rocm"})
    recorder = RecordingRocm()
    caps = attrs.evolve(kvio_rocm.CAPABILITIES, device_types=frozenset({DEVICE.type}))
    registry.discover()
    registry.unregister("rocm")
    registry.register(BackendSpec(caps, lambda device: recorder))
    return registry, recorder


def _pools(kind: str, layout: str, head_dim: int) -> tuple[DevicePool, HostPool]:
    heads = 2 if kind == "mha" else 1
    dev = DevicePool.allocate(kind, LAYERS, 8 * PAGE, heads, head_dim, torch.bfloat16, DEVICE,
                              PAGE)
    host = HostPool.wrap(torch.empty(_host_shape(kind, layout, heads, head_dim),
                                     dtype=torch.bfloat16), kind, layout, LAYERS, heads,
                         head_dim, PAGE, memory=HostMemory.PINNED)
    return dev, host


def _host_shape(kind: str, layout: str, heads: int, dim: int) -> tuple[int, ...]:
    from kvcore.layout import Geometry, Kind, Layout, host_shape

    return host_shape(Geometry(Kind(kind), Layout(layout), LAYERS, 8 * PAGE, heads, dim, PAGE))


def _exercise(ctl: HiCacheController) -> None:
    pages = torch.tensor([3, 1], dtype=torch.int32)
    tokens = (pages[:, None] * PAGE + torch.arange(PAGE, dtype=torch.int32)).flatten()
    ack = ctl.write(tokens)
    ctl.wait_acks()
    ctl.load(ack.host_indices, tokens + 4 * PAGE).wait()
    ctl.load(ack.host_indices, tokens + 4 * PAGE, all_layers=True).wait()


def _expected_host(op: Op, variant: str) -> str:
    return "cpu" if variant == "staged" else DEVICE.type


@pytest.mark.parametrize("kind, head_dim", [("mha", 128), ("mla", 576)])
def test_staged_transfers_get_cpu_host_indices_and_all_else_device(
        rocm_machine: tuple[Registry, RecordingRocm], kind: str, head_dim: int) -> None:
    registry, recorder = rocm_machine
    ctl = HiCacheController(*_pools(kind, "page_first", head_dim), registry=registry)
    assert ctl.plan(Op.WRITE_BACK).backend_name == "rocm"
    _exercise(ctl)
    ops = [(c["op"], c["variant"]) for c in recorder.calls]
    assert ops[0] == (Op.WRITE_BACK, "staged")  # 64 tokens x 4 layers x >=512 B >= 64 KiB
    assert (Op.LOAD_ALL, "staged") in ops
    assert {o for o, _ in ops} == set(Op)
    for call in recorder.calls:
        assert call["device"] == DEVICE.type, call
        assert call["host"] == _expected_host(call["op"], call["variant"]), call
        if call["variant"] == "staged":
            assert call["host_dtype"] == torch.int64  # the staged path reads int64 on the CPU


def test_small_pages_take_the_direct_write_back_with_device_indices(
        rocm_machine: tuple[Registry, RecordingRocm]) -> None:
    registry, recorder = rocm_machine
    ctl = HiCacheController(*_pools("mla", "page_first", 16), registry=registry)  # 8 KiB pages
    _exercise(ctl)
    write = [c for c in recorder.calls if c["op"] is Op.WRITE_BACK]
    assert [c["variant"] for c in write] == ["direct"]
    assert all(c["host"] == DEVICE.type for c in recorder.calls)


def test_pool_group_members_resolve_their_own_residency(
        rocm_machine: tuple[Registry, RecordingRocm]) -> None:
    registry, recorder = rocm_machine
    main = _pools("mha", "page_first", 128)  # staged write-back
    other = _pools("mla", "layer_first", 576)  # pages not contiguous: direct write-back
    ctl = HiCacheController(*main, members=[other], registry=registry)
    _exercise(ctl)
    writes = [c for c in recorder.calls if c["op"] is Op.WRITE_BACK]
    assert [(c["kind"].value, c["variant"], c["host"]) for c in writes] == [
        ("mha", "staged", "cpu"), ("mla", "direct", DEVICE.type)]
    for call in recorder.calls:
        assert call["host"] == _expected_host(call["op"], call["variant"]), call
