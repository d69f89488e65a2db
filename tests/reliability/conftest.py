"""Fixtures of the reliability tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcore.registry import default_registry, reset_default_registry
from kvcore.testing.faults import FaultInjector, fault_backend


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    """These tensors are tiny: intra-op threads only add overhead on a 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No KVCORE_* variables, and a fresh process-wide registry before and after the test."""
    for var in ("KVCORE_PLUGINS", "KVCORE_BACKEND", "KVCORE_STRICT"):
        monkeypatch.delenv(var, raising=False)
    reset_default_registry()
    yield monkeypatch
    reset_default_registry()


@pytest.fixture
def faults(clean_env: pytest.MonkeyPatch) -> Iterator[FaultInjector]:
    """A faulty backend (over the reference) registered in the process-wide registry."""
    with fault_backend(registry=default_registry()) as injector:
        yield injector
