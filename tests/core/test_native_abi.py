"""kvcore.native_abi on its own: the vendor label and library name come from the caller, and
every function of the ABI must be present before anything is called."""

from __future__ import annotations

import ctypes
import types
from pathlib import Path
from typing import Any

import pytest

from kvcore import native_abi
from kvcore.errors import BuildError, InvalidArgument, KernelError
from kvcore.native_abi import (
    ABI_VERSION,
    PROTOTYPES,
    KvioBounds,
    KvioReport,
    NativeLibrary,
    make_bounds,
    unchecked_bounds,
)


def stand_in(status: int = 0, **drop: bool) -> types.SimpleNamespace:
    """A Python object with the ABI's functions; ``drop`` leaves some out."""
    calls: list[tuple[Any, ...]] = []
    impl = {
        "kvio_abi_version": lambda: ABI_VERSION,
        "kvio_error_string": lambda code: b"out of memory" if code.value == 2 else None,
        "kvio_has_batched_memcpy": lambda: 0,
        "kvio_transfer_direct": lambda *args: calls.append(args) or status,
        "kvio_write_back_staged": lambda *args: calls.append(args) or status,
    }
    assert set(impl) == set(PROTOTYPES)
    return types.SimpleNamespace(calls=calls,
                                 **{k: v for k, v in impl.items() if not drop.get(k)})


LAYOUT = dict(kv_stride=4096, layer_stride=2048, page_stride=256, token_stride=32,
              chunk_stride=32, page_size=8, chunk_bytes=32, num_chunks=1)


@pytest.mark.parametrize("runtime", ["cuda", "hip", "level0"])
def test_status_is_labelled_with_the_callers_runtime(runtime: str) -> None:
    lib = NativeLibrary(runtime=runtime, name=f"kvio_{runtime}", lib=stand_in(status=2))
    with pytest.raises(KernelError) as err:
        lib.write_back_staged(1, None, 2, 3, LAYOUT, 4, 5, 1, 8, 6, 1 << 20, 1, 0)
    assert str(err.value) == f"kvio_write_back_staged: out of memory ({runtime} error 2)"
    assert err.value.code == 2
    assert lib.error_string(3) == "unknown error"
    assert lib.has_batched_memcpy() is False


def test_missing_function_and_missing_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"does not export kvio_has_batched_memcpy .*kvio_x"):
        NativeLibrary(runtime="x", name="kvio_x", lib=stand_in(kvio_has_batched_memcpy=True))
    with pytest.raises(InvalidArgument, match="the path of the kvio_x library"):
        NativeLibrary(runtime="x", name="kvio_x")
    with pytest.raises(BuildError, match="cannot load the kvio_x library"):
        NativeLibrary(tmp_path / "absent.so", runtime="x", name="kvio_x")


def test_bad_arguments_never_reach_the_library() -> None:
    fake = stand_in()
    lib = NativeLibrary(runtime="x", name="kvio_x", lib=fake)
    with pytest.raises(InvalidArgument, match="staging_bytes"):
        lib.write_back_staged(1, None, 2, 3, LAYOUT, 4, 5, 1, 8, 6, 1 << 63, 1, 0)
    with pytest.raises(InvalidArgument, match="stream"):
        lib.transfer_direct(0, 1, None, 0, 2, 3, LAYOUT, 4, 1, 5, 1, 8, -1)
    assert fake.calls == []
    lib.transfer_direct(0, 1, None, 0, 2, 3, LAYOUT, 4, 1, 5, 1, 8, None)
    (args,) = fake.calls
    assert args[2] is None and args[-2] is None
    assert args[-1] is unchecked_bounds()  # no bounds given: every index >= 0 is in range
    with pytest.raises(InvalidArgument, match=r"bounds\.report"):
        lib.transfer_direct(0, 1, None, 0, 2, 3, LAYOUT, 4, 1, 5, 1, 8, None,
                            bounds=KvioBounds(host_tokens=1, device_tokens=1, report=0))
    assert len(fake.calls) == 1


def test_the_bounds_and_report_structs_match_the_c_abi() -> None:
    # struct kvio_bounds { int64 host_tokens, device_tokens; kvio_report* report;
    #                      uint64 epoch; } and struct kvio_report (docs/native-abi.md)
    assert ctypes.sizeof(KvioBounds) == 32
    assert [(n, getattr(KvioBounds, n).offset) for n, _ in KvioBounds._fields_] == [
        ("host_tokens", 0), ("device_tokens", 8), ("report", 16), ("epoch", 24)]
    assert native_abi.REPORT_BYTES == ctypes.sizeof(KvioReport) == 32
    assert (native_abi.REPORT_HOST_EPOCH, native_abi.REPORT_HOST_VALUE,
            native_abi.REPORT_DEVICE_EPOCH, native_abi.REPORT_DEVICE_VALUE) == (0, 8, 16, 24)
    b = unchecked_bounds()
    assert b.host_tokens == b.device_tokens == (1 << 63) - 1 and b.report != 0
    made = make_bounds(5, 6, 0x1000, (1 << 64) - 1)
    assert (made.host_tokens, made.device_tokens, made.report, made.epoch) == (
        5, 6, 0x1000, (1 << 64) - 1)
    assert "report=0x1000" in repr(made)


def test_the_layer_group_comes_back_through_its_out_argument_and_is_clamped() -> None:
    answers = iter([5, 0, 99])
    seen: list[tuple[Any, ...]] = []

    def group(*args: Any) -> int:  # as the C function: write *group, return a status
        seen.append(args)
        ctypes.cast(args[-1], ctypes.POINTER(ctypes.c_int32))[0] = next(answers)
        return 0

    fake = stand_in()
    lib = NativeLibrary(runtime="x", name="kvio_x", lib=fake)
    assert lib.signaled_layer_group(1, None, 8, 3, LAYOUT, 64, None) == 1  # not exported
    fake.kvio_signaled_layer_group = group
    lib = NativeLibrary(runtime="x", name="kvio_x", lib=fake)
    assert [lib.signaled_layer_group(1, 2, 8, 3, LAYOUT, 64, 7) for _ in range(3)] == [5, 1, 8]
    assert seen[0][:4] == (1, 2, 8, 3) and seen[0][5:7] == (64, 7)
    with pytest.raises(InvalidArgument, match="num_layers"):
        lib.signaled_layer_group(1, 2, 2**40, 3, LAYOUT, 64, 7)


def test_a_failing_layer_group_query_is_a_kernel_error() -> None:
    fake = stand_in()
    fake.kvio_signaled_layer_group = lambda *args: 1
    fake.kvio_error_string = lambda code: b"invalid argument"
    lib = NativeLibrary(runtime="x", name="kvio_x", lib=fake)
    with pytest.raises(KernelError, match="kvio_signaled_layer_group: invalid argument"):
        lib.signaled_layer_group(1, 2, 8, 3, LAYOUT, 64, 7)
