"""Concurrent callers: threads sharing one controller, controllers sharing one host pool.

The controller and the slot allocator hold a lock per call, so concurrent writes never get the
same host page and every acknowledged page holds its own device source (issue 25, item 3).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kvcore.controller import HiCacheController, WriteAck
from kvcore.layout import Kind, Layout, canonical_view, join_heads
from kvcore.pools import DevicePool, HostPool
from kvcore.verify import random_fill

from .helpers import make_pools, reference_only

PAGE, LAYERS, THREADS, WRITES = 4, 2, 8, 12


def _pools() -> tuple[DevicePool, HostPool]:
    dev, host = make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=LAYERS,
                           host_pages=THREADS * WRITES * 2, device_size=THREADS * WRITES * PAGE,
                           head_num=2, head_dim=8, page_size=PAGE, dtype=torch.bfloat16,
                           registry=reference_only())
    random_fill(host.buffer, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    for t in dev.all_buffers():
        random_fill(t, gen)
    return dev, host


def _hammer(calls: list[Callable[[], list[WriteAck]]]) -> list[WriteAck]:
    """Run every call on its own thread, all released at once; their acks, errors re-raised."""
    start = threading.Barrier(len(calls))
    results: list[list[WriteAck]] = [[] for _ in calls]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [a for r in results for a in r]


def _writer(ctl: HiCacheController, first_page: int) -> Callable[[], list[WriteAck]]:
    def call() -> list[WriteAck]:
        acks = []
        for n in range(WRITES):
            tokens = torch.arange(PAGE) + (first_page + n) * PAGE
            acks.append(ctl.write(tokens))
            ctl.poll_acks()  # interleaved with the other threads' writes
        return acks
    return call


def _assert_every_page_once_and_exact(acks: list[WriteAck], dev: DevicePool,
                                      host: HostPool) -> None:
    pages = [int(p) for a in acks for p in a.host_indices[::PAGE] // PAGE]
    assert len(pages) == len(set(pages)), "a host page was given to two writes"
    view = canonical_view(host.buffer, host.geometry)
    for a in acks:
        h = a.host_indices
        for kv in range(2):
            for layer in range(LAYERS):
                got = join_heads(view[kv, layer, h // PAGE, h % PAGE])
                want = dev.layers(kv)[layer][a.device_indices]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (a.id, kv)


def test_eight_threads_on_one_controller_never_share_a_page() -> None:
    dev, host = _pools()
    ctl = HiCacheController(dev, host, registry=reference_only())
    acks = _hammer([_writer(ctl, i * WRITES) for i in range(THREADS)])
    ctl.wait_acks()
    assert len(acks) == THREADS * WRITES
    assert ctl.allocator.available_size() == host.geometry.size - THREADS * WRITES * PAGE
    _assert_every_page_once_and_exact(acks, dev, host)


def test_two_controllers_on_one_host_pool_never_share_a_page() -> None:
    dev, host = _pools()
    ctls = [HiCacheController(dev, host, registry=reference_only()) for _ in range(2)]
    assert ctls[0].allocator is ctls[1].allocator  # one pool, one allocator
    acks = _hammer([_writer(ctls[i % 2], i * WRITES) for i in range(THREADS)])
    for c in ctls:
        c.wait_acks()
    _assert_every_page_once_and_exact(acks, dev, host)
