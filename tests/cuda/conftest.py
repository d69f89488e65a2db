"""Fixtures shared by the CPU tests of kvio_cuda."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvio_cuda import build


@pytest.fixture
def no_toolkit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No nvcc anywhere: empty PATH, no CUDA_HOME/CUDA_PATH, no nvidia-cuda-nvcc package, no
    default install."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build, "_site_dirs", lambda: [tmp_path / "site-packages"])
    monkeypatch.setattr(build, "DEFAULT_NVCC", tmp_path / "no-cuda" / "bin" / "nvcc")
    return tmp_path
