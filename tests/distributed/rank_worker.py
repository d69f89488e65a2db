"""What each spawned rank runs in the distributed tests (imported by the child processes).

A rank joins a gloo group over TCP, plays one scenario and puts ``(rank, outcome)`` on the
result queue, where ``outcome`` is plain data: ``("ok", detail)`` or ``("raised", type
name, message)``. Ranks then linger until every rank that is still alive has finished, so the
rank hosting the TCP store does not take it away from a peer still reading it.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from kvcore.capabilities import BackendSpec, IndexSpec, Residency
from kvcore.controller import HiCacheController
from kvcore.layout import canonical_view
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import Registry, allocate_host_pool
from kvcore.verify import random_fill

PAGE = 4
LAYERS = 2
SIZE = 8 * PAGE
TWIN = "reference_twin"


def run_rank(rank: int, world: int, port: int, plays: list[tuple[str, int, float]],
             queue: Any, joined: Any) -> None:
    """Entry point of one spawned rank: play each ``(scenario, odd_rank, timeout_s)`` in turn.

    Puts ``(scenario, rank, outcome)`` on ``queue`` after each. ``die`` ends the odd rank
    without a word, so it must come last. ``joined`` is a barrier of all ranks.
    """
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    # every rank has joined before any scenario runs: a rank dying while a peer is still
    # connecting its gloo group (or still waiting on the store for a barrier built on it)
    # would fail that peer outside the scenario; a process barrier needs no store
    joined.wait(timeout=60)
    dead = None
    for scenario, odd_rank, timeout_s in plays:
        if scenario == "die":
            if rank == odd_rank:
                os._exit(17)  # gone before the exchange
            dead = odd_rank
        if scenario == "dead_acks":
            dead = odd_rank  # exits inside the scenario, after the exchange
        started = time.monotonic()
        try:
            outcome: tuple = ("ok", SCENARIOS[scenario](rank, world, odd_rank, timeout_s))
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome = ("raised", type(exc).__name__, str(exc))
        queue.put((scenario, rank, (*outcome, time.monotonic() - started)))
    _linger(rank, world, dead)


def _linger(rank: int, world: int, dead: int | None) -> None:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"test/done/{rank}", b"1")
        if rank == 0:
            store.wait([f"test/done/{r}" for r in range(world) if r != dead],
                       timedelta(seconds=20))
    except Exception:  # noqa: BLE001 - a lost store or a stuck peer shows in the outcomes
        pass
    dist.destroy_process_group()


def registry_for(rank: int, odd_rank: int, scenario: str) -> tuple[Registry, str | None]:
    """This rank's registry and forced backend: the odd rank gets a twin or moved indices."""
    reg = Registry({"KVCORE_PLUGINS": ""})
    reg.discover()
    if rank != odd_rank:
        return reg, None
    spec = reg.get("reference").spec
    caps = spec.capabilities
    if scenario == "backend":
        reg.register(BackendSpec(attrs.evolve(caps, name=TWIN), spec.factory))
        return reg, TWIN
    if scenario == "residency":
        ops = tuple(attrs.evolve(o, host_index=IndexSpec(Residency.DEVICE)) for o in caps.ops)
        reg.unregister("reference")
        reg.register(BackendSpec(attrs.evolve(caps, ops=ops), spec.factory))
        return reg, None
    if scenario == "raise":
        return reg, "no_such_backend"
    return reg, None


def build(rank: int, odd_rank: int, scenario: str, timeout_s: float,
          ) -> tuple[HiCacheController, DevicePool, HostPool]:
    reg, backend = registry_for(rank, odd_rank, scenario)
    dev = DevicePool.allocate("mha", LAYERS, SIZE, 2, 8, torch.float16, "cpu", PAGE)
    host = allocate_host_pool("mha", "page_first", LAYERS, SIZE, 2, 8, torch.float16, PAGE,
                             "cpu", registry=reg)
    ctl = HiCacheController(dev, host, backend=backend, registry=reg,
                            process_group=dist.group.WORLD, agreement_timeout_s=timeout_s)
    return ctl, dev, host


def construct(rank: int, world: int, odd_rank: int, timeout_s: float,
              scenario: str = "agree") -> object:
    ctl, _, _ = build(rank, odd_rank, scenario, timeout_s)
    return ctl.plan_facts()


class _Gate:
    """Fake completion events for one rank: event ``i`` is complete while ``i < done``."""

    def __init__(self) -> None:
        self.done = 0
        self.made = 0

    def recorded_event(self, device: torch.device, stream: object) -> _FakeEvent:
        self.made += 1
        return _FakeEvent(self, self.made - 1)


@attrs.define
class _FakeEvent:
    gate: _Gate
    index: int

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return self.index < self.gate.done

    def synchronize(self) -> None:
        self.gate.done = max(self.gate.done, self.index + 1)


#: per world size: how many of the 3 writes each rank has completed at each poll
ACK_SCHEDULE = {2: [[3, 0], [3, 2]], 4: [[3, 0, 2, 3], [3, 1, 2, 3]]}  # never decreasing
WRITES = 3


def acks(rank: int, world: int, odd_rank: int, timeout_s: float) -> object:
    """Write 3 batches; complete them at different times per rank; record every poll."""
    import kvcore.plan as controller_module  # where the submit records its events

    gate = _Gate()
    real_recorded_event = controller_module.recorded_event
    # completion on our say-so, in this child
    controller_module.recorded_event = gate.recorded_event
    try:
        return _acks(gate, rank, world, odd_rank, timeout_s)
    finally:
        controller_module.recorded_event = real_recorded_event


def _acks(gate: _Gate, rank: int, world: int, odd_rank: int, timeout_s: float) -> object:
    ctl, dev, host = build(rank, odd_rank, "acks", timeout_s)
    gen = torch.Generator().manual_seed(rank)
    for t in dev.all_buffers():
        random_fill(t, gen)
    host.buffer.fill_(-7.0)
    pages = torch.randperm(SIZE // PAGE, generator=gen)[:WRITES]
    written = [ctl.write(p * PAGE + torch.arange(PAGE)) for p in pages]
    polls = []
    for done in ACK_SCHEDULE[world]:
        gate.done = done[rank]
        polls.append(([a.id for a in ctl.poll_acks()], ctl.pending_writes))
    polls.append(([a.id for a in ctl.wait_acks()], ctl.pending_writes))
    view = canonical_view(host.buffer, host.geometry)
    for ack in written:
        hp = ack.host_indices.view(-1, PAGE)[:, 0] // PAGE
        for layer in range(LAYERS):
            for kv in range(2):
                got = view[kv, layer, hp].reshape(-1, 2, 8)
                want = dev.layers(kv)[layer][ack.device_indices]
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    raise AssertionError(f"write {ack.id} layer {layer} kv {kv} not backed up")
    return {"polls": polls, "completed": ctl.completed_writes}


def failed_ack(rank: int, world: int, odd_rank: int, timeout_s: float) -> object:
    """Every rank writes 3 pages; the odd rank's second write fails at completion. Every rank
    waits for its acks twice."""
    from kvcore.layout import Op
    from kvcore.testing.faults import Fault, FaultMode, fault_backend

    reg = Registry({"KVCORE_PLUGINS": ""})
    with fault_backend(registry=reg) as faults:
        if rank == odd_rank:
            faults.arm(Fault(Op.WRITE_BACK, nth=2, mode=FaultMode.ASYNC))
        dev = DevicePool.allocate("mha", LAYERS, SIZE, 2, 8, torch.float16, "cpu", PAGE)
        host = allocate_host_pool("mha", "page_first", LAYERS, SIZE, 2, 8, torch.float16, PAGE,
                                 "cpu", registry=reg)
        ctl = HiCacheController(dev, host, backend=faults.name, registry=reg,
                                process_group=dist.group.WORLD, agreement_timeout_s=timeout_s)
        free_before = host.allocator.available_size()
        for page in range(WRITES):
            ctl.write(page * PAGE + torch.arange(PAGE))
        polls = []
        for _ in range(2):
            try:
                polls.append(("acked", [a.id for a in ctl.wait_acks()]))
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                polls.append((type(exc).__name__, str(exc)))
        return {"polls": polls, "pending": ctl.pending_writes,
                "completed": ctl.completed_writes,
                "held": free_before - host.allocator.available_size()}


ACK_TIMEOUT_S = 2.0
FROZEN_S = 8.0


def _one_write(rank: int, odd_rank: int, timeout_s: float,
               ) -> tuple[HiCacheController, HostPool, int]:
    reg, _ = registry_for(rank, -1, "acks")
    dev = DevicePool.allocate("mha", LAYERS, SIZE, 2, 8, torch.float16, "cpu", PAGE)
    host = allocate_host_pool("mha", "page_first", LAYERS, SIZE, 2, 8, torch.float16, PAGE,
                             "cpu", registry=reg)
    ctl = HiCacheController(dev, host, registry=reg, process_group=dist.group.WORLD,
                            agreement_timeout_s=timeout_s, ack_timeout_s=ACK_TIMEOUT_S)
    free = host.allocator.available_size()
    ctl.write(torch.arange(PAGE))
    return ctl, host, free


def _poll_after_peer_left(ctl: HiCacheController, host: HostPool, free: int) -> object:
    """Poll once (must fail naming the peer, in bounded time), then again (refused)."""
    from kvcore.errors import ControllerUnusable, RanksFailed

    started = time.monotonic()
    try:
        ctl.poll_acks()
    except RanksFailed as exc:
        first = {"error": str(exc), "missing": exc.missing,
                 "seconds": time.monotonic() - started}
    else:
        raise AssertionError("poll_acks() acknowledged with a peer gone")
    try:
        ctl.poll_acks()
    except ControllerUnusable as exc:
        second = str(exc)
    else:
        raise AssertionError("the controller polled again after the group was lost")
    return {**first, "second": second, "leaked": free - host.allocator.available_size()}


def frozen_acks(rank: int, world: int, odd_rank: int, timeout_s: float) -> object:
    """The odd rank stops (never polls); the others poll with a 2-s bound."""
    ctl, host, free = _one_write(rank, odd_rank, timeout_s)
    if rank == odd_rank:
        time.sleep(FROZEN_S)
        return "stopped"
    return _poll_after_peer_left(ctl, host, free)


def dead_acks(rank: int, world: int, odd_rank: int, timeout_s: float) -> object:
    """The odd rank exits after its write; the others poll."""
    ctl, host, free = _one_write(rank, odd_rank, timeout_s)
    if rank == odd_rank:
        os._exit(17)
    time.sleep(1.0)  # let the exit land first
    return _poll_after_peer_left(ctl, host, free)


SCENARIOS = {
    "agree": lambda r, w, o, t: construct(r, w, o, t, "agree"),
    "agree_again": lambda r, w, o, t: construct(r, w, o, t, "agree"),
    "backend": lambda r, w, o, t: construct(r, w, o, t, "backend"),
    "residency": lambda r, w, o, t: construct(r, w, o, t, "residency"),
    "raise": lambda r, w, o, t: construct(r, w, o, t, "raise"),
    "die": lambda r, w, o, t: construct(r, w, o, t, "die"),
    "acks": acks,
    "failed_ack": failed_ack,
    "frozen_acks": frozen_acks,
    "dead_acks": dead_acks,
}
