"""Byte accounting, ratio arithmetic, timing statistics and the sweep's expansion."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.bench.row import Row, ratio
from kvcore.bench.runner import index_sets
from kvcore.bench.sweep import PRESETS, bytes_moved, expand, override
from kvcore.bench.timing import Clock, Timing, gib_per_s
from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout, Op

from .helpers import case


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(list(Kind)), op=st.sampled_from(list(Op)),
       layers=st.integers(1, 80), elem=st.sampled_from([64, 96, 128, 256, 576, 2048]),
       page=st.integers(1, 64), batch=st.integers(1, 64),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float8_e4m3fn]))
def test_bytes_follow_the_seed_rule(kind: Kind, op: Op, layers: int, elem: int, page: int,
                                    batch: int, dtype: torch.dtype) -> None:
    c = case(op, kind, layers, elem, page, batch, batch, dtype)
    kv = 2 if kind is Kind.MHA else 1
    assert c.bytes_moved == kv * layers * batch * page * elem * dtype.itemsize
    assert c.head_num * c.head_dim == elem
    assert c.element_bytes == elem * dtype.itemsize
    if kind is Kind.MLA:
        assert c.head_num == 1


def test_bytes_examples() -> None:
    # seed row: MHA, 16 layers, element_dim 1024 bf16, 64 pages of 64 tokens = 256 MiB
    seed = case(Op.LOAD_LAYER, Kind.MHA, 16, 1024, 64, 64, 128)
    assert seed.bytes_moved == 2 * 16 * 64 * 64 * 2048 == 256 * 2**20
    assert seed.head_num == 8 and seed.head_dim == 128
    assert case(kind=Kind.MLA, elem=576).bytes_moved == 3 * 2 * 4 * 576 * 2
    assert case(elem=96).head_num == 1  # not a multiple of 128: one head of 96
    assert bytes_moved(2, 1, 1, 1, 1) == 2


def test_ratio_arithmetic() -> None:
    assert gib_per_s(2**30, 1000.0) == pytest.approx(1.0)
    assert gib_per_s(2**30, 500.0) == pytest.approx(2.0)
    assert gib_per_s(123, 0.0) == 0.0
    # achieved 4 ms, ceiling 1 ms: a quarter of the ceiling
    assert ratio(2**20, 4.0, 1.0) == pytest.approx(0.25)
    assert ratio(2**20, 1.0, 2.0) == pytest.approx(2.0)
    c = case()
    row = Row(c, "x", timing=Timing((3.0, 2.0, 10.0)), ceiling=Timing((1.0, 0.5, 1.5)))
    assert row.gib_s == pytest.approx(c.bytes_moved / 3e-3 / 2**30)
    assert row.ceiling_gib_s == pytest.approx(c.bytes_moved / 1e-3 / 2**30)
    assert row.ratio == pytest.approx(1.0 / 3.0) == pytest.approx(row.gib_s / row.ceiling_gib_s)
    assert Row(c, "x").ratio is None


def test_timing_statistics() -> None:
    t = Timing((4.0, 1.0, 3.0, 2.0, 10.0))
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.max_ms == 10.0
    assert t.spread_pct == pytest.approx(300.0)
    with pytest.raises(InvalidArgument):
        Timing(())


def test_clock_runs_warmup_then_repeats_with_rotating_index() -> None:
    seen: list[int] = []
    timing = Clock(torch.device("cpu"), warmup=2, repeat=4).measure(seen.append)
    assert seen == [0, 1, 2, 3, 4, 5]
    assert len(timing.samples_ms) == 4 and all(s >= 0 for s in timing.samples_ms)
    with pytest.raises(InvalidArgument):
        Clock(torch.device("cpu"), warmup=0, repeat=0)


def test_clock_warms_every_input_set_before_the_first_timed_call() -> None:
    seen: list[int] = []
    timing = Clock(torch.device("cpu"), warmup=1, repeat=3).measure(seen.append, sets=3)
    assert seen == [0, 1, 2, 3, 4, 5]  # sets 0, 1, 2 once untimed, then timed from set 0
    assert len(timing.samples_ms) == 3
    seen.clear()
    Clock(torch.device("cpu"), warmup=0, repeat=2).measure(seen.append, sets=4)
    assert seen == [0, 1]
    with pytest.raises(InvalidArgument, match="sets"):
        Clock(torch.device("cpu"), warmup=1, repeat=1).measure(seen.append, sets=0)


def test_index_sets_are_disjoint_scattered_whole_pages() -> None:
    c = case(page=4, batch=3, total=9)
    sets = index_sets(c, torch.Generator().manual_seed(1), torch.device("cpu"))
    assert len(sets) == 3
    for which in (0, 1):
        pages = torch.cat([s[which].view(-1, 4) for s in sets])
        assert torch.equal(pages % 4, torch.arange(4).expand(9, 4))  # whole, in-order pages
        assert sorted((pages[:, 0] // 4).tolist()) == list(range(9))  # every page once


def test_expand_and_override() -> None:
    sweep = override(PRESETS["seed"], ops=["write_back"], kinds=["mla"],
                     layouts=["page_head", "page_first"], num_layers=["16"])
    cases = expand(sweep)
    assert {c.layout for c in cases} == {Layout.PAGE_FIRST}  # MLA has no page_head
    assert [c.element_dim for c in cases] == [256, 512, 1024, 2048]
    seed = expand(PRESETS["seed"])
    assert {(c.kind, c.layout) for c in seed} == {
        (k, lay) for k in (Kind.MHA, Kind.MLA) for lay in (Layout.PAGE_FIRST, Layout.PAGE_UNIFIED)}
    assert {c.num_layers for c in seed} == set(range(16, 81, 8))
    assert {(c.page_size, c.batch_pages, c.total_pages) for c in seed} == {(64, 64, 128)}
    with pytest.raises(InvalidArgument):
        override(PRESETS["default"], num_layers=["0"])
    with pytest.raises(InvalidArgument):
        override(PRESETS["default"], dtypes=["nonsense"])
    with pytest.raises(InvalidArgument):
        case(batch=4, total=2)


def test_the_ceiling_is_the_fastest_measurement_of_a_size() -> None:
    from kvcore.bench.ceiling import Ceiling

    clock = Clock(torch.device("cpu"), 0, 1)
    ceiling = Ceiling(clock, lambda shape, dtype: (torch.empty(shape, dtype=dtype), None))
    times = iter([Timing((2.0,)), Timing((1.0,)), Timing((3.0,))])
    ceiling._measure = lambda direction, nbytes, sets: next(times)  # type: ignore[method-assign]
    assert ceiling.measure("d2h", 64).median_ms == 2.0
    assert ceiling.measure("d2h", 64).median_ms == 2.0  # cached, not measured again
    assert ceiling.measure("d2h", 64, again=True).median_ms == 1.0  # faster: replaces
    assert ceiling.measure("d2h", 64, again=True).median_ms == 1.0  # slower: ignored
