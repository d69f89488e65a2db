"""What the ROCm tests share: kvio_rocm's CPU emulation library, built once per session."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kvio_rocm import build

from kvcore.errors import BuildError


@pytest.fixture(scope="session")
def emulated_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvio_rocm's host source and kernel bodies built for the CPU (-DKVIO_EMULATE), in a
    private cache; skipped without a C++ compiler, failed where CI requires the codegen."""
    try:
        cxx = build.find_emulation_compiler()
    except BuildError as exc:
        if os.environ.get("KVIO_REQUIRE_CODEGEN"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    cache = tmp_path_factory.mktemp("kvio_rocm_emul_cache")
    cache.chmod(stat.S_IRWXU)
    return build.build_emulated(cache_dir=Path(cache), cxx=cxx)
