"""A bound plan's per-route lanes (kvcore.plan._Lane) decide placement by the rule below
(``fits``), for every form a checked submit can bring: they look the spec's facts up once
and take where a tensor is from its route, so the two must never disagree."""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch

from kvcore.capabilities import IndexSpec, Residency, op_support
from kvcore.layout import Op
from kvcore.plan import _Lane

DEVICE = torch.device("meta")  # a device that is not the CPU, with no data to read


def fits(indices: torch.Tensor, spec: IndexSpec, device: torch.device) -> bool:
    """The rule: ``indices`` already are where and how ``spec`` wants them."""
    if indices.dtype not in spec.dtypes or not indices.is_contiguous():
        return False
    if spec.residency is Residency.HOST:
        return indices.is_cpu
    return not indices.is_cpu and indices.device == device


def _forms() -> list[torch.Tensor]:
    """Index tensors on the CPU and on DEVICE, int32 and int64, contiguous and strided."""
    out = []
    for where, dtype in itertools.product(("cpu", DEVICE), (torch.int32, torch.int64)):
        whole = torch.arange(16, dtype=dtype, device=where)
        out += [whole[:8], whole[::2]]
    return out


SPECS = [IndexSpec(r, d) for r in Residency
         for d in ((torch.int64,), (torch.int32,), (torch.int64, torch.int32))]


@pytest.mark.parametrize("h_spec, d_spec", list(itertools.product(SPECS, SPECS)))
def test_a_lane_places_exactly_what_fits_places(h_spec: IndexSpec, d_spec: IndexSpec) -> None:
    support = attrs.evolve(op_support(Op.WRITE_BACK, "mha", "page_first", "host", "host"),
                           host_index=h_spec, device_index=d_spec)

    def run(*_: object) -> None:
        return None

    for h, d in itertools.product(_forms(), _forms()):
        lane = _Lane(support, h.is_cpu, d.is_cpu, {id(support): run}, Op.WRITE_BACK)
        assert lane.fit(h, d, 0) == (fits(h, h_spec, DEVICE), fits(d, d_spec, DEVICE)), (
            h.dtype, h.device, h.is_contiguous(), d.dtype, d.device, d.is_contiguous())


def test_host_indices_the_runner_takes_in_its_launch_count_as_placed_up_to_its_limit() -> None:
    support = op_support(Op.WRITE_BACK, "mha", "page_first", "device", "device")
    lane = _Lane(support, True, False, {id(support): lambda *_: None}, Op.WRITE_BACK)
    h, d = torch.arange(8), torch.arange(8, device=DEVICE)
    assert lane.fit(h, d, 0) == (False, True)  # wanted on the device, no launch to carry them
    assert lane.fit(h, d, 8) == (True, True)
    assert lane.fit(h, d, 7) == (False, True)
    assert lane.fit(torch.arange(16)[::2], d, 8) == (False, True)  # strided: uploaded
    # an empty tensor too goes as it is only to a runner with a launch form (one without
    # would get CPU indices it cannot read): placed, which for no index moves nothing
    empty = torch.arange(0)
    assert lane.fit(empty, d[:0], 0) == (False, True)
    assert lane.fit(empty, d[:0], 8) == (True, True)


def test_a_runner_follows_the_callers_stream_only_for_a_whole_transfer() -> None:
    def run(*_: object) -> None:
        return None

    run.follows = True  # type: ignore[attr-defined]
    for op, follows in ((Op.WRITE_BACK, True), (Op.LOAD_ALL, True), (Op.LOAD_LAYER, False)):
        support = op_support(op, "mha", "page_first", "host", "device")
        assert _Lane(support, True, False, {id(support): run}, op).follows is follows
