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
#: last group's on the event recorded after the launch (on the current stream, known by its
#: handle: no stream lookup)
WAITS = "event.wait 1, kvio_wait_layer_signal 7"


def test_what_each_controller_call_asks_of_the_runtime() -> None:
    """The GPU path's runtime calls per controller call, counted through the stand-ins and
    the null library (each one costs the caller 0.4-4 us on an H200 host): a change that adds
    one to the submit path, or makes a new event where the pool has a free one, fails here.
    Default mode (KVCORE_ASYNC_WRITE_BACK unset)."""
    rows = _counts()
    # the caller's stream known by its handle, as the last call's (kvcore.streams.
    # CurrentStream: no stream lookup); its point fenced (a record, a wait); one library
    # call; one completion event recorded; a load's device indices also recorded on the load
    # stream. Its CPU host indices travel in the launch (whole pages, up to
    # KVIO_INLINE_INDEX_PAGES of them): no upload through the ring
    inline = ("event.record 2, kvio_load_layers_signaled_inline 1, stream.wait_event 1, "
              "tensor.record_stream 1")
    # 8 MiB (DIRECT_WRITE_BACK_MAX_BYTES): the direct kernel, which the library orders after
    # the caller's stream and whose completion it records itself (kvio_transfer_direct_after)
    assert rows[("mha", "page_first", "1")] == [
        "kvio_transfer_direct_after 1", inline, WAITS]
    # 128 MiB: handed to the library's thread, which records the caller's point itself
    assert rows[("mha", "page_first", "16")][0] == (
        "kvio_write_back_staged_async 1")
    # layer_first: the direct kernel's write-back, its host indices in the launch, as from
    # page_first up to DIRECT_WRITE_BACK_MAX_BYTES (here one MLA page, 2.25 MiB). The library
    # orders it after the caller's stream and records its completion
    # (kvio_transfer_direct_after): no fence or event of kvcore's
    direct = "kvio_transfer_direct_after 1"
    for pages in ("1", "16"):
        assert rows[("mha", "layer_first", pages)][0] == direct
    assert rows[("mla", "page_first", "1")][0] == direct
    assert rows[("mla", "page_first", "16")][0] == (  # 36 MiB
        "kvio_write_back_staged_async 1")
    assert all(r[1] == inline and r[2] == WAITS for r in rows.values())


def test_what_a_controller_call_asks_of_the_runtime_with_its_indices_uploaded() -> None:
    """CPU host indices that do not go in the launch (the probe's --upload makes none do) are
    uploaded through the ring, on its own stream: one copy, and the transfer's stream waits
    for it (a record, a wait), on top of the calls counted above."""
    rows = _counts("--upload")
    uploaded = "event.record 3, {}stream.wait_event 2{}"
    assert all(r[1] == uploaded.format("kvio_copy_to_device 1, kvio_load_layers_signaled 1, ",
                                       ", tensor.record_stream 1") and r[2] == WAITS
               for r in rows.values())
    # a direct write-back's fence and completion are the library's (kvio_transfer_direct_after,
    # its host indices on the device): only the upload's record and wait are kvcore's
    for pages in ("1", "16"):
        assert rows[("mha", "layer_first", pages)][0] == (
            "event.record 1, kvio_copy_to_device 1, kvio_transfer_direct_after 1, "
            "stream.wait_event 1")


def test_per_layer_submits_of_the_same_cpu_indices_upload_them_once_and_a_change_again() -> None:
    """SGLang's direct io backend: 32 per-layer submits of the same CPU tensors check them
    once and copy the device indices once (the ring's slot is reused under the check's
    proof). A value written into the tensor since (through NumPy: no version bump) is checked
    and uploaded again; an out-of-range one is refused before any copy."""
    import collections
    import importlib.util
    import tempfile

    import torch

    from kvcore.errors import InvalidIndices
    from kvcore.layout import Op
    from kvcore.testing.stand_in_streams import stand_in_streams

    spec = importlib.util.spec_from_file_location("probe_null_device", PROBE)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    calls: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp, stand_in_streams(probe.DEVICE.type,
                                                                calls) as current:
        registry = probe.null_registry(probe.build_library(Path(tmp)), current, calls)
        bound = probe.controller(registry, "mha", "page_first", 1).bound[(0, Op.LOAD_LAYER)]
        h = torch.arange(64)  # host page 0
        d = torch.arange(64, 128)  # device slots 64..127 of 256
        calls.clear()
        for layer in range(32):
            bound.submit(h, d, layer=layer, stream=current)
        assert calls["kvio_copy_to_device"] == 1 and calls["kvio_transfer_direct_inline"] == 32
        d.numpy()[5] = 200  # still in range and unique
        bound.submit(h, d, layer=3, stream=current)
        assert calls["kvio_copy_to_device"] == 2
        bound.submit(h, d, layer=4, stream=current)
        assert calls["kvio_copy_to_device"] == 2
        d.numpy()[5] = 256  # one past the device pool
        with pytest.raises(InvalidIndices, match="device_indices"):
            bound.submit(h, d, layer=5, stream=current)
        assert calls["kvio_copy_to_device"] == 2 and calls["kvio_transfer_direct_inline"] == 34
