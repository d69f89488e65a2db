"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvcore.registry import reset_default_registry


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    """Test tensors are tiny: intra-op threads only add overhead on a 2-core CI runner."""
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
