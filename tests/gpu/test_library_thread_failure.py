"""A write-back that fails part way on kvio_cuda's library thread is reported failed only once
the copies it enqueued before the failure completed (b94d90a): the controller releases its
host slots at the failure, and those copies still write them.

The failure is injected: tests/gpu/fault_shim.c, preloaded into a process of its own
(tests/gpu/thread_failure_scenario.py), fails one cudaEventRecord of the library's thread.
Built here with the C compiler the CUDA toolkit uses; skipped without one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_marks import needs_kvio_cuda

from kvcore.cli.common import default_device

DEVICE = default_device()
pytestmark = needs_kvio_cuda(DEVICE)
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) to build tests/gpu/fault_shim.c")
    out = tmp_path_factory.mktemp("shim") / "fault_shim.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(HERE / "fault_shim.c"),
                    "-ldl", "-lpthread"], check=True)
    return out


def test_a_thread_write_back_failing_part_way_is_reported_after_its_copies(shim: Path) -> None:
    env = dict(os.environ, LD_PRELOAD=str(shim))
    out = subprocess.run([sys.executable, str(HERE / "thread_failure_scenario.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    report = f"rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert out.returncode != 3, f"inconclusive, the injected wait was too short: {report}"
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), report
