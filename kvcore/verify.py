"""Start-up verification: a small round trip through each resolved plan, against the reference.

Runs on scratch pools of the controller's geometry (two pages), never on the engine's own
tensors, so it can be used on a live server at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcore.errors import TransferFailed
from kvcore.layout import Geometry, Op, host_shape
from kvcore.pools import DevicePool, HostPool

if TYPE_CHECKING:
    from kvcore.controller import HiCacheController

REFERENCE = "reference"


def random_fill(t: torch.Tensor, generator: torch.Generator) -> None:
    """Fill with random bytes (any dtype, NaN patterns included), never zeros."""
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                        generator=generator)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


def verify_plans(ctl: HiCacheController) -> None:
    """Write back and load one page per member with its plan and with the reference; compare."""
    gen = torch.Generator().manual_seed(0x6B76)
    for i, m in enumerate(ctl.members):
        plan = ctl.plans[(i, Op.WRITE_BACK)]
        if plan.backend_name == REFERENCE:
            continue
        g = m.host.geometry
        small = Geometry(g.kind, g.layout, g.num_layers, 2 * g.page_size, g.head_num,
                         g.head_dim, g.page_size)
        dev = DevicePool.allocate(g.kind, g.num_layers, 2 * g.page_size, g.head_num,
                                  g.head_dim, m.device.dtype, m.device.device, g.page_size)
        for t in dev.all_buffers():
            random_fill(t, gen)
        host_buf, memory = plan.instance().allocate_host(host_shape(small), m.device.dtype)
        host = HostPool(small, host_buf, memory)
        ref_host = HostPool(small, torch.empty_like(host_buf, device="cpu"), memory)
        random_fill(host.buffer, gen)
        ref_host.buffer.copy_(host.buffer)
        h = torch.arange(g.page_size, 2 * g.page_size, dtype=torch.int64)
        d = torch.arange(g.page_size, dtype=torch.int64, device=m.device.device).flip(0)
        plan.transfer(dev, host, h, d)
        ref = ctl.registry.resolve(plan.request, REFERENCE)
        ref.transfer(dev, ref_host, h, d)
        if m.device.device.type != "cpu":
            torch.get_device_module(m.device.device).synchronize(m.device.device)
        if not torch.equal(host.buffer.view(torch.uint8), ref_host.buffer.view(torch.uint8)):
            raise TransferFailed(
                f"start-up verification: {plan.context} wrote a page that differs from the "
                f"reference's (member {i}, {g.kind.value}/{g.layout.value}); refusing to start")
