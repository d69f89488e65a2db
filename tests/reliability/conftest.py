"""Fixtures of the reliability tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcore.registry import default_registry
from kvcore.testing.faults import FaultInjector, fault_backend


@pytest.fixture
def faults(clean_env: pytest.MonkeyPatch) -> Iterator[FaultInjector]:
    """A faulty backend (over the reference) registered in the process-wide registry."""
    with fault_backend(registry=default_registry()) as injector:
        yield injector
