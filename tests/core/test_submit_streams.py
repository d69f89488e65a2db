"""BoundPlan.submit's ``stream`` and ``after`` must be streams of the plan's device: anything
else is refused with InvalidArgument naming the argument, before anything is enqueued (a
kernel on another device's stream would read this device's pools from there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout, Op
from kvcore.plan import BoundPlan
from kvcore.registry import make_request
from kvcore.testing.stand_in_streams import NullStream
from kvcore.verify import random_fill

from .helpers import assert_unchanged, make_pools, page_tokens, reference_only, snapshot

P = 4


def _bound(op: Op) -> BoundPlan:
    reg = reference_only()
    dev, host = make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=3, host_pages=8,
                           device_size=8 * P, head_num=2, head_dim=16, page_size=P,
                           dtype=torch.bfloat16, registry=reg)
    gen = torch.Generator().manual_seed(11)
    for t in (*dev.all_buffers(), host.buffer):
        random_fill(t, gen)
    plan = reg.resolve(make_request(op, Kind.MHA, Layout.PAGE_FIRST, torch.bfloat16,
                                    dev.element_bytes, "cpu"))
    return plan.bind(dev, host)


BAD = [
    ("a string", "s", "str 's'"),
    ("a stream of another device", NullStream(torch.device("meta")), "NullStream on meta"),
    ("a tensor", torch.zeros(1), "Tensor"),
]


@pytest.mark.parametrize("argument", ["stream", "after"])
@pytest.mark.parametrize(("_what", "bad", "named"), BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("op", [Op.WRITE_BACK, Op.LOAD_LAYER])
def test_a_stream_that_is_not_of_the_plans_device_is_refused_and_nothing_moves(
        op: Op, argument: str, _what: str, bad: Any, named: str) -> None:
    bound = _bound(op)
    h, d = page_tokens([1, 6], P), page_tokens([0, 5], P)
    before = snapshot(bound.device_pool, bound.host_pool)
    with pytest.raises(InvalidArgument) as err:
        bound.submit(h, d, **{argument: bad})
    assert err.value.argument == argument
    assert "None or a stream of cpu" in str(err.value) and named in str(err.value)
    assert_unchanged(bound.device_pool, bound.host_pool, before)

    bound.submit(h, d)  # the plan still works: the destination pool changed
    dev_now, host_now, _ = snapshot(bound.device_pool, bound.host_pool)
    if op is Op.WRITE_BACK:
        assert not torch.equal(host_now, before[1])
    else:
        assert any(not torch.equal(a, b) for a, b in zip(dev_now, before[0], strict=True))


def test_a_stream_of_the_plans_device_is_taken() -> None:
    bound = _bound(Op.WRITE_BACK)
    h, d = page_tokens([2], P), page_tokens([3], P)
    stream = NullStream(torch.device("cpu"))
    bound.submit(h, d, stream=stream, after=stream)
    bound.submit(h, d, stream=stream)  # the second time from the remembered stream
