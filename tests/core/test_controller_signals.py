"""A per-layer load submitted as one job (a ``layer_signals`` variant) through the controller.

On the CPU there are no streams, so the layers have run once ``load`` returns; these tests
check what the controller submits and how a handle uses the signals. The GPU tests check the
stream-side waits of kvio_cuda's signaled load (tests/gpu).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from kvio_reference.backend import ReferenceBackend

from kvcore.capabilities import BackendSpec
from kvcore.controller import HiCacheController
from kvcore.errors import ContractViolation, TransferFailed
from kvcore.handles import LoadHandle
from kvcore.layout import Kind, Layout, Op
from kvcore.plan import Submission
from kvcore.registry import Registry
from kvcore.verify import random_fill

from .helpers import make_pools, reference_only

LAYERS, PAGE = 3, 4


class Signals:
    def __init__(self) -> None:
        self.waits: list[tuple[int, Any]] = []
        self.checks = 0

    def wait_layer(self, layer: int, stream: Any) -> None:
        self.waits.append((layer, stream))

    def check(self) -> None:
        self.checks += 1


class SignaledReference:
    """The reference, answering a job for every layer with Signals; remembers the jobs."""

    def __init__(self, device: torch.device, forget: bool = False) -> None:
        self.inner = ReferenceBackend(device)
        self.jobs: list[Any] = []
        self.forget = forget

    def allocate_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        return self.inner.allocate_host(shape, dtype)

    def run(self, job: Any) -> Signals | None:
        self.jobs.append(job)
        self.inner.run(job)
        if job.layer is None and job.op is Op.LOAD_LAYER and not self.forget:
            return Signals()
        return None


def _registry(forget: bool = False) -> tuple[Registry, list[SignaledReference]]:
    registry = reference_only()
    ref = registry.get("reference").spec.capabilities
    ops = tuple(attrs.evolve(s, layer_signals=True) if s.op is Op.LOAD_LAYER else s
                for s in ref.ops)
    instances: list[SignaledReference] = []

    def factory(device: torch.device) -> SignaledReference:
        instances.append(SignaledReference(device, forget))
        return instances[-1]

    registry.register(BackendSpec(
        capabilities=attrs.evolve(ref, name="signaled", ops=ops, priority=50),
        factory=factory))
    return registry, instances


def _pools(registry: Registry) -> tuple[Any, Any]:
    dev, host = make_pools(Kind.MHA, Layout.LAYER_FIRST, num_layers=LAYERS, host_pages=8,
                           device_size=16 * PAGE, head_num=2, head_dim=8, page_size=PAGE,
                           dtype=torch.bfloat16, registry=registry)
    gen = torch.Generator().manual_seed(7)
    for t in dev.all_buffers():
        random_fill(t, gen)
    return dev, host


def _pages(first: int, count: int) -> torch.Tensor:
    return (torch.arange(first, first + count)[:, None] * PAGE + torch.arange(PAGE)).flatten()


def test_a_single_pool_load_is_one_job_for_every_layer_and_lands_exactly() -> None:
    registry, instances = _registry()
    dev, host = _pools(registry)
    ctl = HiCacheController(dev, host, registry=registry)
    src = _pages(2, 3)
    ack = ctl.write(src)
    ctl.wait_acks()
    dst = _pages(9, 3)
    jobs = instances[0].jobs
    del jobs[:]
    handle = ctl.load(ack.host_indices, dst)
    assert [(j.op, j.layer) for j in jobs] == [(Op.LOAD_LAYER, None)]
    for layer in range(LAYERS):
        handle.wait_layer(layer)
    handle.wait()
    for kv in range(2):
        for layer in range(LAYERS):
            t = dev.layers(kv)[layer]
            assert torch.equal(t[dst].view(torch.int16), t[src].view(torch.int16))


def test_a_pool_group_keeps_one_job_per_layer_and_member() -> None:
    registry, instances = _registry()
    dev, host = _pools(registry)
    dev2, host2 = _pools(registry)
    ctl = HiCacheController(dev, host, registry=registry, members=[(dev2, host2)])
    ack = ctl.write(_pages(0, 2))
    ctl.wait_acks()
    for inst in instances:
        del inst.jobs[:]
    ctl.load(ack.host_indices, _pages(10, 2)).wait()
    layers = sorted(j.layer for inst in instances for j in inst.jobs)
    assert layers == sorted(list(range(LAYERS)) * 2)  # one member's job would hold the next's


def test_a_pool_group_places_its_indices_on_its_load_stream_after_the_fence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of the indices live on the stream whose layers read them: made on the caller's
    stream, they went back to the caller's memory when load() returned, free for its next
    allocation while later layers still read them (a GPU-only race; here the order of the
    calls is what is checked, on stand-in streams). The variant takes int32 host indices
    only, so the ack's int64 ones are copied, once per member for all its layers."""
    import contextlib

    import kvcore.plan
    from kvcore.capabilities import IndexSpec
    from kvcore.plan import BoundPlan
    from kvcore.testing.stand_in_streams import stand_in_streams

    seen: list[str] = []
    current: list[Any] = [None]
    place_on_stream = BoundPlan._place_on_stream

    def placing(self: BoundPlan, t: torch.Tensor, *a: Any) -> Any:
        seen.append(f"place on {current[0]}")
        return place_on_stream(self, t, *a)

    @contextlib.contextmanager
    def switched(stream: Any) -> Any:
        current[0], before = stream, current[0]
        try:
            yield
        finally:
            current[0] = before

    registry, _ = _registry()
    spec = registry.get("signaled").spec
    ops = tuple(attrs.evolve(s, host_index=IndexSpec(s.host_index.residency, (torch.int32,)))
                if s.op is Op.LOAD_LAYER else s for s in spec.capabilities.ops)
    registry.register(attrs.evolve(spec, capabilities=attrs.evolve(
        spec.capabilities, name="int32_hosts", ops=ops, priority=60)))
    monkeypatch.setattr(BoundPlan, "_place_on_stream", placing)
    with stand_in_streams("cpu"):
        ctl = HiCacheController(*_pools(registry), registry=registry,
                                members=[_pools(registry)])
        assert ctl.bound[(0, Op.LOAD_LAYER)].plan.backend_name == "int32_hosts"
        ack = ctl.write(_pages(0, 2))
        ctl.wait_acks()
        fence = ctl.bound[(0, Op.LOAD_LAYER)]._fence
        order = fence.order
        monkeypatch.setattr(kvcore.plan, "on_stream", switched)
        del seen[:]  # (the start-up verification placed some)
        monkeypatch.setattr(fence, "order", lambda s, after: (seen.append("fence"),
                                                              order(s, after))[1])
        try:
            handle = ctl.load(ack.host_indices, _pages(10, 2))
        finally:
            monkeypatch.undo()  # (before stand_in_streams puts its own back)
        handle.wait()
    # both tensors of each member (on a CPU device, a device-resident spec places even a
    # CPU tensor), once for all layers
    assert seen == ["fence", *[f"place on {ctl.load_stream}"] * 4]
    for pool in (ctl.members[0].device, ctl.members[1].device):
        for kv in range(2):
            for layer in range(LAYERS):
                t = pool.layers(kv)[layer]
                assert torch.equal(t[_pages(10, 2)].view(torch.int16),
                                   t[_pages(0, 2)].view(torch.int16))


def test_a_variant_that_forgets_its_signals_fails_the_load_with_the_cause() -> None:
    registry, _ = _registry(forget=True)
    dev, host = _pools(registry)
    ctl = HiCacheController(dev, host, registry=registry)
    ack = ctl.write(_pages(0, 1))
    ctl.wait_acks()
    with pytest.raises(TransferFailed, match=r"ContractViolation.*declares layer_signals") as err:
        ctl.load(ack.host_indices, _pages(12, 1))
    assert isinstance(err.value.cause, ContractViolation)


class Event:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _handle(signals: Signals, failures: list[BaseException]) -> LoadHandle:
    sub = Submission({}, Event(), [(None, signals)], one=signals, layers=LAYERS)
    return LoadHandle([sub], LAYERS, torch.device("cpu"), failures.append)


@pytest.mark.parametrize("form", ["one object for every layer", "a wait per layer"])
def test_a_submission_with_signals_waits_on_the_layers_own_signal(form: str) -> None:
    signals = Signals()
    sub = (Submission({}, Event(), [(None, signals)], one=signals, layers=LAYERS)
           if form.startswith("one") else
           Submission(dict.fromkeys(range(LAYERS), signals), Event(), [(None, signals)]))
    assert sub.layers == tuple(range(LAYERS))
    sub.wait_layer(2, "stream")
    sub.wait_layer(0, "stream")
    sub.wait_layer(LAYERS, "stream")  # a layer it did not move needs no wait
    sub.wait_layer(-1, "stream")
    sub.wait_layer(1, None)  # no stream (the CPU): nothing to order
    assert signals.waits == [(2, "stream"), (0, "stream")]
    assert sub.query() and signals.checks == 0


def test_a_handle_stops_checking_a_signaled_load_once_it_passed() -> None:
    signals, failures = Signals(), []
    handle = _handle(signals, failures)
    handle.wait_layer(2)  # on the CPU the load already ran: its outcome is checked here
    handle.wait_layer(0)
    assert signals.waits == []  # the CPU has no stream to order
    assert signals.checks == 2  # one job for every layer answers for each layer
    assert handle.done()
    handle.check()
    handle.wait_layer(1)
    assert signals.checks == 3 and failures == []  # once the whole load passed, never again


def test_a_failed_signaled_load_fails_every_later_wait() -> None:
    class Failing(Signals):
        def check(self) -> None:
            raise RuntimeError("device said no")

    signals, failures = Failing(), []
    handle = _handle(signals, failures)
    with pytest.raises(TransferFailed, match="device said no"):
        handle.wait()
    with pytest.raises(TransferFailed):
        handle.wait_layer(0)
    with pytest.raises(TransferFailed):
        handle.check()
    assert len(failures) == 1


def test_the_fault_wrapper_passes_a_signaled_loads_signals_through() -> None:
    """Per-layer loads over fault_backend(base=a signaled backend) land and wait on the
    wrapped backend's own signals (they raised ContractViolation: issue 25, item 9)."""
    from kvcore.testing.faults import fault_backend

    registry, _ = _registry()
    with fault_backend(registry=registry, base="signaled") as injector:
        dev, host = _pools(registry)
        ctl = HiCacheController(dev, host, registry=registry, backend="faulty")
        src, dst = _pages(1, 2), _pages(8, 2)
        ack = ctl.write(src)
        ctl.wait_acks()
        handle = ctl.load(ack.host_indices, dst)
        for layer in range(LAYERS):
            handle.wait_layer(layer)
        handle.wait()
    assert injector.calls[Op.LOAD_LAYER] == 1  # one job for every layer, through the wrapper
    for kv in range(2):
        for layer in range(LAYERS):
            t = dev.layers(kv)[layer]
            assert torch.equal(t[dst].view(torch.int16), t[src].view(torch.int16))


class ReturnsANumber(SignaledReference):
    """Runs every job right, then returns 42 instead of a completion or None."""

    def run(self, job: Any) -> Any:
        self.inner.run(job)
        return 42


@pytest.mark.parametrize("op", ["write", "load", "load_layer"])
def test_a_run_that_returns_no_completion_is_named_a_contract_violation(op: str) -> None:
    """Not "run() raised AttributeError" later, when its result is asked for check()."""
    registry = reference_only()
    ref = registry.get("reference").spec.capabilities
    registry.register(BackendSpec(capabilities=attrs.evolve(ref, name="number", priority=50),
                                  factory=ReturnsANumber))
    dev, host = _pools(registry)
    ctl = HiCacheController(dev, host, registry=registry, backend="number")
    expected = (r"the run\(\) of variant 'default' returned int \(42\); expected None or a "
                r"completion with check\(\)")
    if op == "write":
        with pytest.raises(TransferFailed, match=expected) as err:
            ctl.write(_pages(0, 1))
        assert isinstance(err.value.cause, ContractViolation)
        return
    taken = ctl.allocator.alloc(PAGE)
    if op == "load":
        with pytest.raises(TransferFailed, match=expected):
            ctl.load(taken, _pages(4, 1))
    else:
        with pytest.raises(ContractViolation, match=expected):
            ctl.bound[(0, Op.LOAD_LAYER)].submit(taken, _pages(4, 1), layer=0)
