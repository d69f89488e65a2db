"""check_cpu_indices against the plain definitions: values in range, whole pages, and no
value twice, whether duplicates are found among all values or among the starts of the
tensor's runs (whole pages, or runs of the usual length on the device side)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import InvalidIndices
from kvcore.validate import RUNS_FROM, check_cpu_indices

RUN = 4
SIZE = 40 * RUN


def _duplicates(a: np.ndarray) -> set[int]:
    values, counts = np.unique(a, return_counts=True)
    return {int(v) for v in values[counts > 1]}


@st.composite
def made_of_runs(draw: st.DrawFn) -> np.ndarray:
    """Runs of RUN consecutive values, starting anywhere (so they may overlap), sometimes
    with one value changed (so the tensor is not made of runs any more)."""
    count = draw(st.integers(1, 2 * RUNS_FROM))
    starts = draw(st.lists(st.integers(0, SIZE - RUN), min_size=count, max_size=count))
    a = (np.array(starts)[:, None] + np.arange(RUN)).ravel()
    if draw(st.booleans()):
        a[draw(st.integers(0, a.size - 1))] = draw(st.integers(0, SIZE - 1))
    return a


@settings(max_examples=400, deadline=None)
@given(made_of_runs())
def test_duplicates_are_found_exactly_where_a_value_repeats(a: np.ndarray) -> None:
    dups = _duplicates(a)
    for runs in (None, RUN):
        if not dups:
            check_cpu_indices("device_indices", torch.from_numpy(a), SIZE, unique=True,
                              runs=runs)
            continue
        with pytest.raises(InvalidIndices, match="more than once") as err:
            check_cpu_indices("device_indices", torch.from_numpy(a), SIZE, unique=True,
                              runs=runs)
        reported = int(str(err.value).split("got ")[-1].split(" ")[0])
        assert reported == min(dups)  # the smallest repeated value, either way


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 39), min_size=1, max_size=2 * RUNS_FROM))
def test_whole_pages_repeated_are_refused_by_their_first_token(pages: list[int]) -> None:
    a = (np.array(pages)[:, None] * RUN + np.arange(RUN)).ravel()
    t = torch.from_numpy(a)
    if len(set(pages)) == len(pages):
        check_cpu_indices("host_indices", t, SIZE, page_size=RUN, unique=True)
        return
    with pytest.raises(InvalidIndices, match="more than once") as err:
        check_cpu_indices("host_indices", t, SIZE, page_size=RUN, unique=True)
    first = min(p for p in pages if pages.count(p) > 1) * RUN
    assert f"got {first} more than once" in str(err.value)


def test_out_of_range_and_broken_pages_are_named_before_duplicates() -> None:
    runs = (np.array([3, 3] * RUNS_FROM)[:, None] * RUN + np.arange(RUN)).ravel()
    runs[-1] = SIZE  # out of range too
    with pytest.raises(InvalidIndices, match=f"values in \\[0, {SIZE}\\)"):
        check_cpu_indices("device_indices", torch.from_numpy(runs), SIZE, unique=True, runs=RUN)
    broken = np.array([0, 1, 2, 4, 8, 9, 10, 11], dtype=np.int64)  # page 0 broken
    with pytest.raises(InvalidIndices, match="consecutive tokens within each page"):
        check_cpu_indices("host_indices", torch.from_numpy(broken), SIZE, page_size=RUN,
                          unique=True)
