"""The case of tests/gpu/test_controller_release.py, run in a process of its own:

    python tests/gpu/release_scenario.py load page_first               # ok, or what broke
    python tests/gpu/release_scenario.py load page_first --no-release  # the release detached

A controller queues transfers and is dropped with its pools at once. At once its host pool's
pinned memory is taken again (torch hands the same block back) and marked every 4 KiB, and
a smaller controller is made and writes back; then the device is synchronized, the marks and
the later controller's data checked. Before the release existed, loads still running faulted
the device (an illegal memory access, most likely from reading the later pool's layer
pointers where theirs had been: scripts/probe_cold_calls.py --gpu met it,
docs/benchmarks/h100-2026-12-06d), and write-backs still running wrote into the pinned
memory taken after the drop; each on some runs only (a race). Exit status 1 names what
faulted or changed."""

from __future__ import annotations

import sys

import torch

LAYERS, PAGE, PAGES, CALLS = 32, 64, 64, 2
MARK, MARK_EVERY = 0x5A5A5A5A5A5A5A5A, 512  # one int64 every 4 KiB


def _pools(layout: str, pages: int, host_pages: int, device: torch.device) -> tuple:
    from kvcore import DevicePool
    from kvcore.registry import allocate_host_pool

    dev = DevicePool.allocate("mha", LAYERS, pages * PAGE, 8, 128, torch.bfloat16, device, PAGE)
    host = allocate_host_pool("mha", layout, LAYERS, host_pages * PAGE, 8, 128, torch.bfloat16,
                              PAGE, device)
    return dev, host


def scenario(op: str, layout: str, release: bool) -> str:
    """What is wrong after the drop, or ''."""
    from kvcore import HiCacheController

    device = torch.device("cuda", torch.cuda.current_device())
    n = PAGES * PAGE
    dev, host = _pools(layout, 4 * PAGES, 8 * PAGES, device)
    ctl = HiCacheController(dev, host)
    d = torch.arange(n, device=device)
    d2 = torch.arange(n, 2 * n, device=device)
    hosts = [ctl.write(d).host_indices for _ in range(CALLS)]
    ctl.wait_acks()
    torch.cuda.synchronize()
    for h in hosts:
        ctl.load(h, d2) if op == "load" else ctl.write(d)
    if not release:
        ctl._release.detach()
    host_bytes = host.buffer.numel() * host.buffer.element_size()
    del ctl, dev, host, d, d2, hosts, h
    pinned = torch.empty(host_bytes // 8, dtype=torch.int64, pin_memory=True)
    marks = pinned.numpy()[::MARK_EVERY]
    marks[:] = MARK
    # at once, a controller of one page per call, as the next row of a sweep makes it
    dev, host = _pools("layer_first", 4, 8, device)
    small = HiCacheController(dev, host)
    one = torch.arange(PAGE, device=device)
    for layer in dev.all_buffers():
        layer.view(torch.int16).fill_(0x5A5A)
    acks = [small.write(one) for _ in range(2)]
    try:
        done = small.wait_acks()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the fault is the finding
        return f"the device faulted: {str(exc).splitlines()[0]}"
    if not bool((marks == MARK).all()):
        return f"{int((marks != MARK).sum())} of {marks.size} marks in pinned memory taken " \
               "after the drop changed"
    if len(done) != len(acks):
        return f"{len(done)} of {len(acks)} write-backs acknowledged"
    changed = sum(not bool((t.view(torch.int16) == 0x5A5A).all()) for t in dev.all_buffers())
    if changed:
        return f"{changed} layer tensors of the later pool changed"
    return ""


if __name__ == "__main__":
    wrong = scenario(sys.argv[1], sys.argv[2], release="--no-release" not in sys.argv)
    print(wrong or "ok")
    sys.exit(1 if wrong else 0)
