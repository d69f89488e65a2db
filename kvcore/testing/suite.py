"""The conformance suite. Collected by ``pytest --kvio-backend NAME``; importable to subclass.

Each class checks one family of cases (:func:`kvcore.testing.cases.generate`); the plugin
parametrises ``kvio_case`` from the backend's declared capabilities. To override or
expect-fail a single test for your backend, in the SQLAlchemy dialect-suite style, import the
class into your own test module under the same name and subclass it::

    from kvcore.testing.suite import TestPageCounts as _Base

    class TestPageCounts(_Base):
        @pytest.mark.xfail(reason="page counts over 128 land in 0.3")
        def test_transfer(self, kvio_env, kvio_case):
            super().test_transfer(kvio_env, kvio_case)

and run ``pytest --kvio-backend NAME path/to/that_module.py``.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.layout import Kind, head_group_options
from kvcore.testing import harness
from kvcore.testing.cases import Case, Profile
from kvcore.testing.harness import Env


@pytest.mark.kvio("pages")
class TestPageCounts:
    """Page counts around kernel block sizes and any staging budget (bf16, scattered pages)."""

    def test_transfer(self, kvio_env: Env, kvio_case: Case) -> None:
        harness.check_transfer(kvio_env, kvio_case)


@pytest.mark.kvio("elements")
class TestElementSizes:
    """Element sizes at the alignment edges: 144, 512, 1152, 4096 B, and 72 B where claimed."""

    def test_transfer(self, kvio_env: Env, kvio_case: Case) -> None:
        harness.check_transfer(kvio_env, kvio_case)


@pytest.mark.kvio("dtypes")
class TestDtypesAndIndices:
    """bf16 and fp16, int32 and int64 indices, reversed and scattered host pages, and indices
    handed in at the wrong residency (the plan must move them)."""

    def test_transfer(self, kvio_env: Env, kvio_case: Case) -> None:
        harness.check_transfer(kvio_env, kvio_case)


@pytest.mark.kvio("round_trip")
class TestRoundTrip:
    """Write-back, then load into other device pages: the original bytes come back."""

    def test_round_trip(self, kvio_env: Env, kvio_case: Case) -> None:
        harness.check_round_trip(kvio_env, kvio_case)


@pytest.mark.kvio("bad_input")
class TestBadInputs:
    """Bad calls are refused with a typed KVCoreError before the backend runs; nothing changes."""

    def test_refused(self, kvio_env: Env, kvio_case: Case) -> None:
        harness.check_refusal(kvio_env, kvio_case)


@pytest.mark.kvio("random")
class TestRandomised:
    """Hypothesis varies page count, head split, index dtypes, order and residency per row."""

    def test_transfer(self, kvio_env: Env, kvio_case: Case, kvio_profile: Profile) -> None:
        top = max(kvio_profile.page_counts) + 1
        splits = _head_splits(kvio_case)

        @settings(max_examples=kvio_profile.max_examples, deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(n=st.integers(1, top), split=st.sampled_from(splits),
               order=st.sampled_from(("ascending", "reversed", "scattered")),
               h_dtype=st.sampled_from((torch.int32, torch.int64)),
               d_dtype=st.sampled_from((torch.int32, torch.int64)), swapped=st.booleans())
        def check(n: int, split: tuple[int, int], order: str, h_dtype: torch.dtype,
                  d_dtype: torch.dtype, swapped: bool) -> None:
            case = attrs.evolve(kvio_case, n_pages=n, head_num=split[0], head_dim=split[1],
                                order=order, host_index_dtype=h_dtype,
                                device_index_dtype=d_dtype, swapped=swapped,
                                drawn_from=kvio_case.id)
            harness.check_transfer(kvio_env, case)

        check()


def _head_splits(case: Case) -> list[tuple[int, int]]:
    """(heads, head_dim) pairs with the case's element size (one head for MLA) that its
    layout allows with the case's head_group_num."""
    if case.kind is Kind.MLA:
        return [(1, case.head_dim)]
    items = case.head_num * case.head_dim
    return [(h, items // h) for h in (1, 2, 4, 8) if items % h == 0 and items // h >= 8
            and case.head_group_num in head_group_options(case.kind, case.layout, h,
                                                          items // h, case.dtype.itemsize)]


@pytest.mark.kvio("allocator")
class TestHostMemory:
    """The backend's allocator gives host memory of the kind its capabilities declare."""

    def test_allocator(self, kvio_env: Env) -> None:
        why = harness.host_memory_claim(kvio_env)
        assert why is None, f"{kvio_env.backend} host allocator: {why}"
