"""A controller dropped with transfers in flight on its streams: the memory its pools held is
handed out again by torch at once, so unless the drop waits for those transfers they read and
write memory that is a later tensor's by then. It is a race: with the release detached, on
H100s, the load cases faulted the device on one host (an illegal memory access, which loses
the GPU for the process) and a layer_first write-back overwrote pinned memory taken after
the drop on another (docs/benchmarks/h100-2026-12-06d); with it, no run failed.

Each case runs in a process of its own (tests/gpu/release_scenario.py): a fault there must
not take this process's GPU along."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cuda_marks import needs_kvio_cuda

from kvcore.cli.common import default_device

DEVICE = default_device()
pytestmark = needs_kvio_cuda(DEVICE)
SCENARIO = Path(__file__).with_name("release_scenario.py")


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("op", ["load", "write"])
def test_dropping_a_controller_with_transfers_in_flight_touches_no_later_memory(
        op: str, layout: str) -> None:
    out = subprocess.run([sys.executable, str(SCENARIO), op, layout], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (
        f"{op} {layout}: rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")

