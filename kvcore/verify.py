"""Start-up verification: a small round trip through each resolved plan, against the reference.

Runs on scratch pools of the controller's geometry (two pages), never on the engine's own
tensors, so it can be used on a live server at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from kvcore.errors import TransferFailed
from kvcore.layout import Geometry, Op, host_shape
from kvcore.pools import DevicePool, HostPool

if TYPE_CHECKING:
    from kvcore.plan import TransferPlan
    from kvcore.registry import Registry

REFERENCE = "reference"


#: bytes generated per step when random data is made on an accelerator
FILL_CHUNK_BYTES = 256 << 20


def random_fill(t: torch.Tensor, generator: torch.Generator,
                on: torch.device | None = None) -> None:
    """Fill with random bytes (any dtype, NaN patterns included), never zeros.

    The bytes are drawn from ``generator`` (a CPU generator) where ``on`` is None or the CPU.
    With ``on`` an accelerator (default for a tensor that lives on one), a seed drawn from
    ``generator`` drives a generator on that device, which makes gigabytes of test data in
    milliseconds; a host tensor filled this way gets the bytes copied over in chunks.
    """
    where = on if on is not None else t.device
    flat = t.view(-1).view(torch.uint8)
    if where.type in ("cpu", "meta"):
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8,
                                 generator=generator))
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    device_gen = torch.Generator(device=where).manual_seed(seed)
    for start in range(0, flat.numel(), FILL_CHUNK_BYTES):
        n = min(FILL_CHUNK_BYTES, flat.numel() - start)
        flat[start:start + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8,
                                                  device=where, generator=device_gen))


def _scratch_device(m_device: DevicePool, g: Geometry, gen: torch.Generator) -> DevicePool:
    dev = DevicePool.allocate(g.kind, g.num_layers, 2 * g.page_size, g.head_num, g.head_dim,
                              m_device.dtype, m_device.device, g.page_size)
    for t in dev.all_buffers():
        random_fill(t, gen)
    return dev


def _same_bytes(a: DevicePool | torch.Tensor, b: DevicePool | torch.Tensor) -> bool:
    ta = a.all_buffers() if isinstance(a, DevicePool) else [a]
    tb = b.all_buffers() if isinstance(b, DevicePool) else [b]
    pairs = zip(ta, tb, strict=True)
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


def verify_plans(pairs: Sequence[tuple[DevicePool, HostPool]],
                 plans_of: dict[tuple[int, Op], TransferPlan], registry: Registry) -> None:
    """For each pool pair whose plans (``plans_of[(pair index, op)]``) are not the
    reference's: write back one page and load it back (per layer and all layers) on scratch
    pools, with the plan and with the reference, and require identical bytes. Raises
    TransferFailed naming the plan that differs."""
    gen = torch.Generator().manual_seed(0x6B76)
    for i, (m_device, m_host) in enumerate(pairs):
        plans = {op: plans_of[(i, op)] for op in Op}
        if all(p.backend_name == REFERENCE for p in plans.values()):
            continue
        g = m_host.geometry
        small = attrs.evolve(g, size=2 * g.page_size)
        dev = _scratch_device(m_device, g, gen)
        host_buf, memory = plans[Op.WRITE_BACK].instance().allocate_host(host_shape(small),
                                                                          m_device.dtype)
        host = HostPool(small, host_buf, memory)
        ref_host = HostPool(small, torch.empty_like(host_buf, device="cpu"), memory)
        random_fill(host.buffer, gen)
        ref_host.buffer.copy_(host.buffer)
        h = torch.arange(g.page_size, 2 * g.page_size, dtype=torch.int64)
        d = torch.arange(g.page_size, dtype=torch.int64, device=m_device.device).flip(0)
        for op, plan in plans.items():
            ref = registry.resolve(plan.request, REFERENCE)
            outcome: tuple[DevicePool | torch.Tensor, DevicePool | torch.Tensor]
            if op is Op.WRITE_BACK:
                subs = [plan.transfer(dev, host, h, d), ref.transfer(dev, ref_host, h, d)]
                outcome = (host.buffer, ref_host.buffer)
            else:
                target = _scratch_device(m_device, g, gen)
                ref_target = target.clone()
                subs = [plan.transfer(target, host, h, d), ref.transfer(ref_target, host, h, d)]
                outcome = (target, ref_target)
            for sub in subs:
                sub.synchronize()
                sub.check()
            if not _same_bytes(*outcome):
                raise TransferFailed(
                    f"start-up verification: {plan.context} (member {i}, "
                    f"{g.kind.value}/{g.layout.value}) produced bytes that differ from the "
                    "reference's; refusing to start")
