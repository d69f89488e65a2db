"""The reference backend refuses an out-of-range index before torch dereferences it.

Through a plan, CPU index values are checked before the backend runs; a job handed to the
backend directly (or device-resident indices on a GPU, where torch's own check is a
device-side assert that costs the process its device) must still be refused, typed, with
nothing moved."""

from __future__ import annotations

import pytest
import torch
from kvio_reference.backend import ReferenceBackend

from kvcore.backend import TransferJob
from kvcore.capabilities import IndexSpec, Residency, op_support
from kvcore.errors import InvalidIndices
from kvcore.layout import Geometry, Kind, Layout, Op, host_shape
from kvcore.pools import DevicePool, HostPool
from kvcore.verify import random_fill


@pytest.mark.parametrize("op", [Op.WRITE_BACK, Op.LOAD_ALL, Op.LOAD_LAYER])
@pytest.mark.parametrize(("name", "bad"), [("host_indices", 64), ("device_indices", 32),
                                           ("device_indices", -1)])
def test_an_out_of_range_index_is_refused_and_nothing_moves(op: Op, name: str,
                                                            bad: int) -> None:
    gen = torch.Generator().manual_seed(11)
    dev = DevicePool.allocate("mha", 2, 32, 2, 8, torch.float16, "cpu", 4)
    g = Geometry(Kind.MHA, Layout.PAGE_FIRST, 2, 64, 2, 8, 4)
    host = HostPool.wrap(torch.empty(host_shape(g), dtype=torch.float16), "mha", "page_first",
                         2, 2, 8, 4)
    for t in (*dev.all_buffers(), host.buffer):
        random_fill(t, gen)
    before = [t.clone() for t in (*dev.all_buffers(), host.buffer)]
    h = torch.arange(8, 12)
    d = torch.arange(4, 8)
    if name == "host_indices":
        h = h.clone()
        h[2] = bad
    else:
        d = d.clone()
        d[1] = bad
    support = op_support(op, (Kind.MHA,), (Layout.PAGE_FIRST,), Residency.HOST,
                         Residency.DEVICE)
    assert support.host_index == IndexSpec(Residency.HOST)
    job = TransferJob(op=op, support=support, device_pool=dev, host_buffer=host.buffer,
                      host_geometry=host.geometry, host_strides=host.strides, host_indices=h,
                      device_indices=d, layer=0 if op is Op.LOAD_LAYER else None)
    with pytest.raises(InvalidIndices) as err:
        ReferenceBackend(torch.device("cpu")).run(job)
    assert err.value.argument == name
    assert str(bad) in str(err.value)
    after = (*dev.all_buffers(), host.buffer)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(after, before, strict=True))
