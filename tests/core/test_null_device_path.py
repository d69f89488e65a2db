"""The GPU-shaped submit path (index ring, fences, layer signals, the write-back routes) runs
end to end on the CPU against the null kvio library (scripts/probe_null_device.py), in every
write-back mode. A change that breaks a path only a GPU would take
fails here first."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.native import WRITE_BACK_MODES

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "probe_null_device.py"

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="needs a C compiler")


@pytest.mark.parametrize("mode", sorted(WRITE_BACK_MODES))
def test_every_row_of_the_null_device_probe_runs(mode: str) -> None:
    env = dict(os.environ, KVCORE_ASYNC_WRITE_BACK=mode)
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


def _counts(*flags: str, **modes: str) -> dict[tuple[str, ...], list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "KVCORE_ASYNC_WRITE_BACK"}
    out = subprocess.run([sys.executable, str(PROBE), "--count", "--pages", "1", "16", *flags],
                         env={**env, **modes}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {tuple(c.strip() for c in line.split("|")[1:4]): [
        c.strip() for c in line.split("|")[4:-1]] for line in out.stdout.splitlines()
        if line.startswith("| m")}


#: the null library says 4 layers of a signaled load land together: 32 layers, 8 waits, the
#: last group's on the event recorded after the launch (on the current stream, looked up)
WAITS = "event.wait 1, kvio_wait_layer_signal 7, stream.current 1"


def test_what_each_controller_call_asks_of_the_runtime() -> None:
    """The GPU path's runtime calls per controller call, counted through the stand-ins and
    the null library (each one costs the caller 0.4-4 us on an H200 host): a change that adds
    one to the submit path, or makes a new event where the pool has a free one, fails here.
    Default mode (KVCORE_ASYNC_WRITE_BACK unset)."""
    rows = _counts()
    # the caller's stream looked up once; its point fenced (a record, a wait); one library
    # call; one completion event recorded; a load's device indices also recorded on the load
    # stream. Its CPU host indices travel in the launch (whole pages, up to
    # KVIO_INLINE_INDEX_PAGES of them): no upload through the ring
    inline = ("event.record 2, kvio_load_layers_signaled_inline 1, stream.current 1, "
              "stream.wait_event 1, tensor.record_stream 1")
    # 8 MiB: issued by the caller, which the library orders after the caller's stream and
    # whose completion it records itself (kvio_write_back_staged_after)
    assert rows[("mha", "page_first", "1")] == [
        "kvio_write_back_staged_after 1, stream.current 1", inline, WAITS]
    # 128 MiB: handed to the library's thread, which records the caller's point itself
    assert rows[("mha", "page_first", "16")][0] == (
        "kvio_write_back_staged_async 1, stream.current 1")
    # layer_first: the direct kernel's write-back, its host indices in the launch
    for pages in ("1", "16"):
        assert rows[("mha", "layer_first", pages)][0] == (
            "event.record 2, kvio_transfer_direct_inline 1, stream.current 1, "
            "stream.wait_event 1")
    assert all(r[1] == inline and r[2] == WAITS for r in rows.values())


def test_what_a_controller_call_asks_of_the_runtime_with_its_indices_uploaded() -> None:
    """CPU host indices that do not go in the launch (the probe's --upload makes none do) are
    uploaded through the ring, on its own stream: one copy, and the transfer's stream waits
    for it (a record, a wait), on top of the calls counted above."""
    rows = _counts("--upload")
    uploaded = "event.record 3, {}stream.current 1, stream.wait_event 2{}"
    assert all(r[1] == uploaded.format("kvio_copy_to_device 1, kvio_load_layers_signaled 1, ",
                                       ", tensor.record_stream 1") and r[2] == WAITS
               for r in rows.values())
    for pages in ("1", "16"):
        assert rows[("mha", "layer_first", pages)][0] == uploaded.format(
            "kvio_copy_to_device 1, kvio_transfer_direct 1, ", "")
