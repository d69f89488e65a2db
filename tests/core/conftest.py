"""Fixtures of the core tests (helpers that are not fixtures live in helpers.py)."""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvcore.registry import Registry

from .helpers import install_fake_plugin, reference_only

_ids = itertools.count()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0x4B56)


@pytest.fixture(scope="session")
def ref_registry() -> Registry:
    """Reference plugin only, immune to the caller's KVCORE_* variables."""
    return reference_only()


@pytest.fixture
def fake_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                ) -> Iterator[Callable[[str], tuple[str, str]]]:
    """``fake_plugin(source) -> (entry_point, distribution)``: a plugin installed for real.

    Each call writes a distinct dist-info and module under ``tmp_path``, which goes on
    sys.path for the test; the modules are dropped from sys.modules afterwards.
    """
    modules: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(source: str) -> tuple[str, str]:
        n = next(_ids)
        ep, dist, module = f"fake{n}", f"kvio-fake{n}", f"kvio_fake_{n}"
        install_fake_plugin(tmp_path, dist, ep, module, source)
        importlib.invalidate_caches()
        modules.append(module)
        return ep, dist

    yield install
    for module in modules:
        sys.modules.pop(module, None)
