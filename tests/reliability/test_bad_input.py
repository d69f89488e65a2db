"""Random shapes, dtypes, devices and index values through the public API either give the
result of an independent oracle or raise a KVCoreError, never another exception, and leave
both pools and the allocator unchanged when they raise."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.controller import HiCacheController
from kvcore.layout import Kind, head_group_options, layouts_for
from kvcore.registry import Registry

from .bad_input import bad_input_case
from .helpers import small_pools

REGISTRY = Registry({"KVCORE_PLUGINS": ""})  # the reference only, whatever is installed
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8]


@st.composite
def pools(draw: st.DrawFn) -> HiCacheController:
    kind = draw(st.sampled_from(list(Kind)))
    layout = draw(st.sampled_from(layouts_for(kind)))
    head_num = 1 if kind is Kind.MLA else draw(st.integers(1, 2))
    head_dim, dtype = draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from(DTYPES))
    if not head_group_options(kind, layout, head_num, head_dim, dtype.itemsize):
        head_dim = 16  # page_unified's 16-byte rows
    ctl = HiCacheController(*small_pools(
        kind, layout, num_layers=draw(st.integers(1, 2)), head_num=head_num,
        head_dim=head_dim, page_size=draw(st.sampled_from([1, 2, 4])),
        device_pages=draw(st.integers(1, 3)), host_pages=draw(st.integers(1, 3)),
        dtype=dtype, seed=draw(st.integers(0, 2**16))),
        registry=REGISTRY)
    return ctl


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_input_gives_the_oracle_result_or_a_typed_error(data: st.DataObject) -> None:
    bad_input_case(data, data.draw(pools()))
