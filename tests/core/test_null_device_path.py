"""The GPU-shaped submit path (index ring, fences, layer signals, the write-back routes) runs
end to end on the CPU against the null kvio library (scripts/probe_null_device.py), in every
write-back mode and signaled-load mode. A change that breaks a path only a GPU would take
fails here first."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.native import SIGNALED_LOAD_MODES, WRITE_BACK_MODES

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "probe_null_device.py"

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="needs a C compiler")


@pytest.mark.parametrize("mode", [*(("write", m) for m in sorted(WRITE_BACK_MODES)),
                                  *(("load", m) for m in sorted(SIGNALED_LOAD_MODES))],
                         ids=lambda m: f"{m[0]}-{m[1]}")
def test_every_row_of_the_null_device_probe_runs(mode: tuple[str, str]) -> None:
    variable = "KVCORE_ASYNC_WRITE_BACK" if mode[0] == "write" else "KVCORE_SIGNALED_LOAD_JOB"
    env = dict(os.environ, **{variable: mode[1]})
    # 1 page stays on the caller, 16 MHA pages (128 MiB) reach the library thread's route
    out = subprocess.run([sys.executable, str(PROBE), "--calls", "20", "--pages", "1", "16"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines()
            if line.startswith("| m")]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        (kind, layout, pages) for kind, layout in (("mha", "page_first"), ("mla", "page_first"),
                                                   ("mha", "layer_first"))
        for pages in ("1", "16")]
    assert all(float(v) > 0 for r in rows for v in r[3:])


def test_the_per_layer_submits_of_sglangs_hooks_run_with_indices_on_either_side() -> None:
    out = subprocess.run([sys.executable, str(PROBE), "--per-layer", "--calls", "20",
                          "--pages", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == ["cpu", "device"] and all(float(r[2]) > 0 for r in rows)
