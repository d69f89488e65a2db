"""CPU-only tests of the kvio_cuda plumbing: nvcc discovery and flags, the build cache, and
the ctypes marshalling of the native ABI (against a fake library, and against the real one
where nvcc is available: loading it and its argument checks need no GPU)."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from kvio_cuda import _native, build

from kvcore import buildcache
from kvcore.errors import BuildError, DeviceFault, InvalidArgument, KernelError
from kvcore.native_abi import (
    ABI_VERSION,
    INLINE_INDEX_PAGES,
    INLINE_INDEX_TOKENS,
    OPTIONAL_PROTOTYPES,
    PROTOTYPES,
    KvioBounds,
    KvioReport,
    make_bounds,
    unchecked_bounds,
)

# ------------------------------------------------------------------------------- build.py


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
         "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\n"
         "Cuda compilation tools, release 13.0, V13.0.88\n"
         "Build cuda_13.0.r13.0/compiler.36424714_0\n", (13, 0, 88)),
        ("Cuda compilation tools, release 12.8, V12.8.93\n", (12, 8, 93)),
        ("Cuda compilation tools, release 11.8, V11.8.89", (11, 8, 89)),
        ("Cuda compilation tools, release 12.4\n", (12, 4, 0)),
    ],
)
def test_parse_nvcc_version(text: str, expected: tuple[int, int, int]) -> None:
    assert build.parse_nvcc_version(text) == expected


def test_parse_nvcc_version_garbage() -> None:
    with pytest.raises(BuildError, match="cannot read the CUDA version"):
        build.parse_nvcc_version("command not found\n")


@pytest.mark.parametrize(
    ("cc", "sm"),
    [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_103a"), ((12, 0), "sm_120a"),
     ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((7, 5), "sm_75")],
)
def test_arch_flags_real_architecture_only(cc: tuple[int, int], sm: str) -> None:
    flags = build.arch_flags(*cc)
    compute = sm.replace("sm_", "compute_")
    assert flags == ["-gencode", f"arch={compute},code={sm}"]
    # SASS only: no PTX (code=compute_XX) is embedded
    assert "code=compute" not in " ".join(flags)


def test_arch_flags_hopper_exact() -> None:
    assert build.arch_flags(9, 0) == ["-gencode", "arch=compute_90a,code=sm_90a"]
    assert build.arch_flags(10, 0) == ["-gencode", "arch=compute_100a,code=sm_100a"]


def test_arch_flags_refuses_old_gpu_and_old_nvcc_for_new_gpu() -> None:
    with pytest.raises(BuildError, match=r"7\.0 is not supported"):
        build.arch_flags(7, 0)
    with pytest.raises(BuildError, match=r"sm_100a needs nvcc 12\.8 or newer, found nvcc 12\.4"):
        build.arch_flags(10, 0, (12, 4, 131))
    assert build.arch_flags(9, 0, (12, 0, 76))[1] == "arch=compute_90a,code=sm_90a"


def test_compile_command() -> None:
    cmd = build.compile_command("/opt/cuda/bin/nvcc", "k.cu", "out.so", 9, 0, (13, 0, 88),
                                rpath="/opt/cuda/lib64")
    joined = " ".join(cmd)
    assert cmd[0] == "/opt/cuda/bin/nvcc"
    for piece in ("-O3", "-std=c++17", "--shared", "-Xcompiler -fPIC", "-cudart shared",
                  "-gencode arch=compute_90a,code=sm_90a", "-Xptxas -v", "-o out.so k.cu",
                  "-ldl", "-Xlinker -rpath,/opt/cuda/lib64"):
        assert piece in joined, piece
    quiet = build.compile_command("nvcc", "k.cu", "o.so", 8, 0, verbose_ptxas=False)
    assert "-Xptxas" not in quiet
    assert "-Xlinker" not in quiet


def test_tuning_defines_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    assert build.tuning_defines() == []
    monkeypatch.setenv("KVIO_CUDA_TUNE", " unroll=8, BLOCKS_PER_SM=2 ,")
    flags = build.tuning_defines()
    assert flags == ["-DKVIO_UNROLL=8", "-DKVIO_BLOCKS_PER_SM=2"]
    cmd = build.compile_command("nvcc", "k.cu", "o.so", 9, 0, defines=flags)
    assert cmd[cmd.index("-DKVIO_UNROLL=8") + 1] == "-DKVIO_BLOCKS_PER_SM=2"
    assert build.tuning_defines("DMA_BATCH=64") == ["-DKVIO_DMA_BATCH=64"]


@pytest.mark.parametrize("spec", ["UNROLL=0", "UNROLL=17", "BLOCKS_PER_SM=x", "THREADS=128",
                                  "UNROLL", "DMA_BATCH=-1", "DMA_BATCH=4097"])
def test_tuning_defines_refuse_unknown_names_and_ranges(spec: str) -> None:
    with pytest.raises(BuildError, match=r"KVIO_CUDA_TUNE: expected .*UNROLL=\[1, 16\]") as err:
        build.tuning_defines(spec)
    assert repr(spec) in str(err.value)


def test_tuning_makes_its_own_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          ) -> None:
    seen: list[list[str]] = []

    def fake_build(name: str, key: dict[str, str], build_fn: Any, root: Any = None) -> Path:
        seen.append(key["command"].split())
        return tmp_path / name

    monkeypatch.setattr(build, "find_nvcc", lambda: build.Nvcc(Path("/x/nvcc"), (13, 0, 88)))
    monkeypatch.setattr(build, "build_cached", fake_build)
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    build.build_library(9, 0)
    monkeypatch.setenv("KVIO_CUDA_TUNE", "UNROLL=8")
    build.build_library(9, 0)
    assert "-DKVIO_UNROLL=8" not in seen[0] and "-DKVIO_UNROLL=8" in seen[1]


def _fake_nvcc(directory: Path, release: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "nvcc"
    exe.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "nvcc: NVIDIA (R) Cuda compiler driver"
        echo "Cuda compilation tools, release {release}, V{release}.99"
        """))
    exe.chmod(0o755)
    return exe


def test_find_nvcc_missing(no_toolkit: Path) -> None:
    with pytest.raises(BuildError) as info:
        build.find_nvcc()
    msg = str(info.value)
    assert "nvcc not found" in msg
    assert "12.0 or newer" in msg
    assert "PATH" in msg and "$CUDA_HOME/bin (not set)" in msg
    assert str(no_toolkit / "no-cuda" / "bin") in msg


def test_find_nvcc_too_old(no_toolkit: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = _fake_nvcc(no_toolkit / "cuda-11.8" / "bin", "11.8")
    monkeypatch.setenv("CUDA_HOME", str(exe.parent.parent))
    with pytest.raises(BuildError) as info:
        build.find_nvcc()
    msg = str(info.value)
    assert "nvcc 11.8" in msg and str(exe) in msg and "12.0 or newer" in msg


def test_find_nvcc_on_path(no_toolkit: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = _fake_nvcc(no_toolkit / "bin", "12.8")
    monkeypatch.setenv("PATH", str(exe.parent))
    found = build.find_nvcc()
    assert found.path == exe
    assert found.version == (12, 8, 99)
    assert found.release == "12.8"


def test_build_library_missing_nvcc_is_build_error(no_toolkit: Path) -> None:
    with pytest.raises(BuildError, match="nvcc not found"):
        build.build_library(9, 0, cache_dir=no_toolkit / "cache")


# ------------------------------------------------------------------------- buildcache.py


class CountingBuild:
    """A build callback writing fixed bytes and counting its calls."""

    def __init__(self, payload: bytes = b"\x7fELF fake library") -> None:
        self.payload = payload
        self.calls: list[Path] = []

    def __call__(self, out: Path) -> None:
        self.calls.append(out)
        assert out.parent.is_dir()
        out.write_bytes(self.payload)


KEY = {"sources": "abc", "arch": "sm_90a", "nvcc": "13.0.88"}


def test_cache_builds_once_then_hits(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    b = CountingBuild()
    first = buildcache.build_cached("libx.so", KEY, b, cache)
    second = buildcache.build_cached("libx.so", dict(KEY), b, cache)
    assert first == second
    assert len(b.calls) == 1
    assert first.read_bytes() == b.payload
    assert first.parent == cache and first.name.startswith("libx-") and first.suffix == ".so"
    assert b.calls[0].parent == cache and b.calls[0].suffix == ".so"  # temp next to the entry
    sidecar = first.with_name(first.name + ".sha256")
    import hashlib

    assert sidecar.read_text().strip() == hashlib.sha256(b.payload).hexdigest()
    assert stat.S_IMODE(cache.stat().st_mode) & 0o077 == 0
    # no temporary files left behind
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [first.name, sidecar.name, first.name + ".lock"])


def test_cache_key_changes_entry(tmp_path: Path) -> None:
    b = CountingBuild()
    a = buildcache.build_cached("libx.so", KEY, b, tmp_path)
    other = buildcache.build_cached("libx.so", {**KEY, "arch": "sm_100a"}, b, tmp_path)
    assert a != other and len(b.calls) == 2
    assert buildcache.entry_path("libx.so", KEY, tmp_path) == a


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_sidecar", "bad_sidecar", "delete"])
def test_cache_rebuilds_corrupt_entry(tmp_path: Path, damage: str) -> None:
    b = CountingBuild(b"0123456789" * 100)
    entry = buildcache.build_cached("libx.so", KEY, b, tmp_path)
    sidecar = entry.with_name(entry.name + ".sha256")
    if damage == "truncate":
        entry.write_bytes(b.payload[:10])
    elif damage == "flip":
        entry.write_bytes(b"X" + b.payload[1:])
    elif damage == "no_sidecar":
        sidecar.unlink()
    elif damage == "bad_sidecar":
        sidecar.write_text("0" * 64 + "\n")
    else:
        entry.unlink()
    assert not buildcache.verify_entry(entry)
    again = buildcache.build_cached("libx.so", KEY, b, tmp_path)
    assert again == entry and len(b.calls) == 2
    assert entry.read_bytes() == b.payload and buildcache.verify_entry(entry)


def test_cache_creates_private_dir(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "b" / "kvcore"
    old = os.umask(0)
    try:
        buildcache.build_cached("libx.so", KEY, CountingBuild(), cache)
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o722, 0o1777])
def test_cache_refuses_writable_dir(tmp_path: Path, mode: int) -> None:
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(mode)
    b = CountingBuild()
    with pytest.raises(BuildError) as info:
        buildcache.build_cached("libx.so", KEY, b, cache)
    msg = str(info.value)
    assert str(cache) in msg and oct(mode) in msg and "KVCORE_CACHE_DIR" in msg
    assert b.calls == []


def test_cache_refuses_dir_of_another_user(tmp_path: Path) -> None:
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    if os.getuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    os.chown(cache, 4242, -1)
    with pytest.raises(BuildError, match=r"owned by uid 4242"):
        buildcache.build_cached("libx.so", KEY, CountingBuild(), cache)


def test_cache_refuses_file_as_dir(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(BuildError, match=r"cannot create|not a directory"):
        buildcache.build_cached("libx.so", KEY, CountingBuild(), f)


def test_cache_default_dir_from_environment(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert buildcache.cache_root() == tmp_path / "explicit"
    entry = buildcache.build_cached("libx.so", KEY, CountingBuild())
    assert entry.parent == tmp_path / "explicit"
    monkeypatch.delenv("KVCORE_CACHE_DIR")
    assert buildcache.cache_root() == tmp_path / "xdg" / "kvcore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert buildcache.cache_root() == tmp_path / "home" / ".cache" / "kvcore"


def test_cache_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def failing(out: Path) -> None:
        out.write_bytes(b"partial")
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError, match="compiler exploded"):
        buildcache.build_cached("libx.so", KEY, failing, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    with pytest.raises(BuildError, match="produced no output"):
        buildcache.build_cached("libx.so", KEY, lambda out: None, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_cache_rejects_bad_names_and_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        buildcache.build_cached("../evil.so", KEY, CountingBuild(), tmp_path)
    with pytest.raises(TypeError):
        buildcache.build_cached("libx.so", {"arch": 90}, CountingBuild(), tmp_path)  # type: ignore[dict-item]


_WORKER = textwrap.dedent("""\
    import os, sys, time
    from pathlib import Path
    from kvcore.buildcache import build_cached

    cache, log, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.005)

    def build(out):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.3)
        out.write_bytes(b"library" * 1000)

    print(build_cached("libx.so", {"k": "v"}, build, cache))
""")


def test_cache_concurrent_processes_build_once(tmp_path: Path) -> None:
    cache, log, go = tmp_path / "cache", tmp_path / "builds.log", tmp_path / "go"
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(cache), str(log), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    assert len(log.read_text().splitlines()) == 1
    assert buildcache.verify_entry(Path(paths.pop()))


# ---------------------------------------------------------------------------- _native.py

LAYOUT = {
    "kv_stride": 1 << 30, "layer_stride": 1024, "page_stride": 64 * 32 * 1024,
    "token_stride": 32 * 1024, "chunk_stride": 1024, "page_size": 64, "chunk_bytes": 1024,
    "num_chunks": 1,
}


def test_layout_struct_mirrors_c() -> None:
    assert ctypes.sizeof(_native.KvioLayout) == 64
    names = [f[0] for f in _native.KvioLayout._fields_]
    assert names == ["kv_stride", "layer_stride", "page_stride", "token_stride",
                     "chunk_stride", "page_size", "chunk_bytes", "num_chunks"]
    for i, name in enumerate(names):
        assert getattr(_native.KvioLayout, name).offset == 8 * i


def test_layout_from_fields() -> None:
    a = _native.KvioLayout.from_fields(**LAYOUT)
    b = _native.KvioLayout.from_fields(LAYOUT)
    c = _native.KvioLayout.from_fields({k: v for k, v in LAYOUT.items() if k != "page_size"},
                                       page_size=64)
    assert a.as_dict() == b.as_dict() == c.as_dict() == LAYOUT
    assert "page_size=64" in repr(a)
    with pytest.raises(InvalidArgument, match="missing \\['num_chunks'\\]"):
        _native.KvioLayout.from_fields({k: v for k, v in LAYOUT.items() if k != "num_chunks"})
    with pytest.raises(InvalidArgument, match="unknown \\['bogus'\\]"):
        _native.KvioLayout.from_fields(LAYOUT, bogus=1)
    with pytest.raises(InvalidArgument, match=r"layout\.page_size"):
        _native.KvioLayout.from_fields(LAYOUT, page_size=1 << 64)
    with pytest.raises(InvalidArgument, match=r"layout\.page_size"):
        _native.KvioLayout.from_fields(LAYOUT, page_size=64.0)


def _recording(function: str) -> Any:
    """A stand-in for the library function ``function``: records its call, returns status."""

    def call(self: FakeLib, *args: Any) -> int:
        self.calls.append((function, args))
        return self.status

    return call


class FakeLib:
    """Stands in for the ctypes library: records calls, returns a chosen status."""

    def __init__(self, status: int = 0, abi: int = ABI_VERSION, batched: int = 1) -> None:
        self.status = status
        self.abi = abi
        self.batched = batched
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def kvio_abi_version(self) -> int:
        return self.abi

    def kvio_has_batched_memcpy(self) -> int:
        return self.batched

    def kvio_error_string(self, code: ctypes.c_int) -> bytes:
        messages = {1: b"invalid argument", 700: b"an illegal memory access was encountered"}
        return messages.get(code.value, b"unrecognized error code")

    kvio_transfer_direct = _recording("kvio_transfer_direct")
    kvio_write_back_staged = _recording("kvio_write_back_staged")


class FakeDmaLib(FakeLib):
    """A fake library that also exports the optional functions."""

    kvio_load_layer_dma = _recording("kvio_load_layer_dma")
    kvio_transfer_direct_chained = _recording("kvio_transfer_direct_chained")
    kvio_load_all_staged = _recording("kvio_load_all_staged")
    kvio_load_layers_signaled = _recording("kvio_load_layers_signaled")
    kvio_load_layers_signaled_inline = _recording("kvio_load_layers_signaled_inline")
    kvio_transfer_direct_inline = _recording("kvio_transfer_direct_inline")
    kvio_wait_layer_signal = _recording("kvio_wait_layer_signal")
    signals = 1

    def kvio_has_layer_signals(self) -> int:
        return self.signals


def _values(args: tuple[Any, ...]) -> list[Any]:
    """The arguments a stand-in received: checked plain ints, None for NULL, the layout, and
    last the bounds (a KvioBounds, which ctypes passes by pointer to a real library)."""
    assert all(a is None or type(a) is int or isinstance(a, _native.KvioLayout)
               for a in args[:-1])
    assert isinstance(args[-1], KvioBounds)
    return list(args)


BOUNDS_P = ctypes.POINTER(KvioBounds)
#: bounds for calls that pass them explicitly (the report is never written: no kernel runs)
REPORT = KvioReport()
BOUNDS = make_bounds(1 << 20, 1 << 20, ctypes.addressof(REPORT), 7)


def _argtypes(function: str) -> list[Any]:
    return list({**PROTOTYPES, **OPTIONAL_PROTOTYPES}[function][1])


def test_native_queries() -> None:
    lib = _native.NativeLibrary("fake.so", lib=FakeLib(batched=1))
    assert lib.abi_version() == ABI_VERSION
    assert lib.has_batched_memcpy() is True
    assert _native.NativeLibrary(None, lib=FakeLib(batched=0)).has_batched_memcpy() is False
    assert lib.error_string(700) == "an illegal memory access was encountered"


def test_native_abi_mismatch() -> None:
    with pytest.raises(BuildError,
                       match=f"ABI version 1, this binding speaks version {ABI_VERSION}"):
        _native.NativeLibrary("fake.so", lib=FakeLib(abi=1))


def test_native_missing_library(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="cannot load"):
        _native.NativeLibrary(tmp_path / "nope.so")


def test_transfer_direct_marshalling() -> None:
    fake = FakeLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    layout = _native.KvioLayout.from_fields(LAYOUT)
    lib.transfer_direct(1, 0x7F0000001000, 0, 3, 2, 0x7F1000000000, layout, 0x7F2000000000,
                        True, 0x7F3000000000, 0, 4096, 0x55AA)
    name, args = fake.calls[-1]
    assert name == "kvio_transfer_direct"
    # what a real library's ctypes function converts them to
    assert _argtypes(name) == [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                               ctypes.c_int32, ctypes.c_void_p, _native.KvioLayout,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_int64, ctypes.c_void_p, BOUNDS_P]
    assert _values(args) == [1, 0x7F0000001000, None, 3, 2, 0x7F1000000000, layout,
                             0x7F2000000000, 1, 0x7F3000000000, 0, 4096, 0x55AA,
                             unchecked_bounds()]
    # given bounds reach the library as they are (by reference for a real library)
    lib.transfer_direct(1, 1, 0, 3, 2, 1, layout, 1, 1, 1, 0, 4096, 0, bounds=BOUNDS)
    assert fake.calls[-1][1][-1] is BOUNDS
    # a mapping works as the layout too; None and 0 are NULL; the default stream is NULL
    lib.transfer_direct(0, 1 << 40, None, 0, 80, 1 << 41, LAYOUT, 1 << 42, 0, 1 << 43, 1, 64, 0)
    _, args = fake.calls[-1]
    assert args[6].as_dict() == LAYOUT
    assert args[2] is None and args[12] is None
    assert args[10] == 1


def test_a_chained_transfer_calls_the_chained_function_where_the_library_has_it() -> None:
    args = (1, 0x1000, 0, 3, 1, 0x2000, LAYOUT, 0x3000, 1, 0x4000, 0, 4096, 0x55AA)
    full = FakeDmaLib()
    lib = _native.NativeLibrary("fake.so", lib=full)
    assert lib.has_transfer_direct_chained()
    lib.transfer_direct(*args, chained=True)
    lib.transfer_direct(*args)
    assert [name for name, _ in full.calls] == ["kvio_transfer_direct_chained",
                                                "kvio_transfer_direct"]
    assert _values(full.calls[0][1])[:6] == _values(full.calls[1][1])[:6]
    # without the optional function the plain one serves (ignoring the promise is correct)
    plain = FakeLib()
    lib = _native.NativeLibrary("fake.so", lib=plain)
    assert not lib.has_transfer_direct_chained()
    lib.transfer_direct(*args, chained=True)
    assert [name for name, _ in plain.calls] == ["kvio_transfer_direct"]
    with pytest.raises(KernelError, match=r"^kvio_transfer_direct_chained: an illegal memory"):
        _native.NativeLibrary("fake.so", lib=FakeDmaLib(status=700)).transfer_direct(
            *args, chained=True)


def test_write_back_staged_marshalling() -> None:
    fake = FakeLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    lib.write_back_staged(0x1000, 0x2000, 61, 0x3000, LAYOUT, 0x4000, 0x5000, 0, 64 * 64,
                          0x6000, 64 << 20, True, 0x7000)
    name, args = fake.calls[-1]
    assert name == "kvio_write_back_staged"
    assert _argtypes(name) == [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                               ctypes.c_void_p, _native.KvioLayout, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, BOUNDS_P]
    values = _values(args)
    assert values[:4] == [0x1000, 0x2000, 61, 0x3000]
    assert values[4].as_dict() == LAYOUT
    assert values[5:] == [0x4000, 0x5000, 0, 4096, 0x6000, 64 << 20, 1, 0x7000,
                          unchecked_bounds()]


def test_load_all_staged_marshalling_mirrors_the_staged_write_back() -> None:
    fake = FakeDmaLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    assert lib.has_load_all_staged()
    args = (0x1000, None, 61, 0x3000, LAYOUT, 0x4000, 0x5000, 1, 64 * 64, 0x6000, 64 << 20,
            False, 0x7000)
    lib.load_all_staged(*args, BOUNDS)
    lib.write_back_staged(*args, bounds=BOUNDS)
    (load, load_args), (wb, wb_args) = fake.calls
    assert (load, wb) == ("kvio_load_all_staged", "kvio_write_back_staged")
    assert _argtypes(load) == _argtypes(wb)
    values = _values(load_args)
    assert values[:4] == [0x1000, None, 61, 0x3000]
    assert values[4].as_dict() == LAYOUT
    assert values[5:] == [0x4000, 0x5000, 1, 4096, 0x6000, 64 << 20, 0, 0x7000, BOUNDS]
    assert values[5:] == _values(wb_args)[5:]
    with pytest.raises(InvalidArgument, match="staging_bytes"):
        lib.load_all_staged(*args[:10], 1 << 63, *args[11:])
    with pytest.raises(KernelError, match=r"^kvio_load_all_staged: an illegal memory"):
        _native.NativeLibrary("fake.so", lib=FakeDmaLib(status=700)).load_all_staged(*args)
    without = _native.NativeLibrary("fake.so", lib=FakeLib())
    assert not without.has_load_all_staged()
    with pytest.raises(BuildError, match="does not export kvio_load_all_staged"):
        without.load_all_staged(*args)


def test_load_layer_dma_marshalling() -> None:
    fake = FakeDmaLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    assert lib.has_load_layer_dma()
    lib.load_layer_dma(0x1000, None, 7, 0x3000, LAYOUT, 0x4000, 0x5000, 4096, True, 0x7000)
    name, args = fake.calls[-1]
    assert name == "kvio_load_layer_dma"
    assert _argtypes(name) == [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, _native.KvioLayout,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
        BOUNDS_P]
    values = _values(args)
    assert values[:4] == [0x1000, None, 7, 0x3000]
    assert values[4].as_dict() == LAYOUT
    assert values[5:] == [0x4000, 0x5000, 4096, 1, 0x7000, unchecked_bounds()]
    with pytest.raises(InvalidArgument, match="layer"):
        lib.load_layer_dma(1, 2, 1 << 31, 3, LAYOUT, 4, 5, 64, 1, 0)
    with pytest.raises(KernelError, match=r"^kvio_load_layer_dma: an illegal memory"):
        _native.NativeLibrary("fake.so", lib=FakeDmaLib(status=700)).load_layer_dma(
            1, 2, 0, 3, LAYOUT, 4, 5, 64, 1, 0)


def test_signaled_load_and_its_wait_marshalling() -> None:
    fake = FakeDmaLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    assert lib.has_layer_signals()
    lib.load_layers_signaled(0x1000, None, 61, 0x3000, LAYOUT, 0x4000, True, 0x5000, 0, 4096,
                             0x6000, 0x6100, 0xFFFFFFFF, 0x7000, bounds=BOUNDS)
    lib.wait_layer_signal(0x6104, 7, 0x8000)
    (load, load_args), (wait, wait_args) = fake.calls
    assert (load, wait) == ("kvio_load_layers_signaled", "kvio_wait_layer_signal")
    assert _argtypes(load) == [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, _native.KvioLayout,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, BOUNDS_P]
    assert _argtypes(wait) == [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p]
    values = _values(load_args)
    assert values[:4] == [0x1000, None, 61, 0x3000]
    assert values[4].as_dict() == LAYOUT
    assert values[5:] == [0x4000, 1, 0x5000, 0, 4096, 0x6000, 0x6100, 0xFFFFFFFF, 0x7000,
                          BOUNDS]
    assert list(wait_args) == [0x6104, 7, 0x8000]  # the wait reads no index: no bounds
    for bad in (-1, 1 << 32):  # the epoch is a uint32
        with pytest.raises(InvalidArgument, match="epoch"):
            lib.wait_layer_signal(0x6104, bad, 0)
    assert len(fake.calls) == 2
    with pytest.raises(KernelError, match=r"^kvio_wait_layer_signal: an illegal memory"):
        _native.NativeLibrary("fake.so", lib=FakeDmaLib(status=700)).wait_layer_signal(1, 1, 0)


def test_the_inline_direct_transfer_binds_the_direct_transfers_prototype() -> None:
    assert _argtypes("kvio_transfer_direct_inline") == _argtypes("kvio_transfer_direct")
    fake = FakeDmaLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    args = (0, 0x1000, None, 0, 32, 0x3000, LAYOUT, 0x4000, 1, 0x5000, 0, 960, 0x7000)
    lib.transfer_direct(*args, chained=True, inline=True, bounds=BOUNDS)
    lib.transfer_direct(*args, bounds=BOUNDS)
    (inline, inline_args), (plain, plain_args) = fake.calls
    assert (inline, plain) == ("kvio_transfer_direct_inline", "kvio_transfer_direct")
    assert _values(inline_args)[7:] == _values(plain_args)[7:]
    with pytest.raises(BuildError, match="kvio_transfer_direct_inline"):
        _native.NativeLibrary("fake.so", lib=FakeLib()).transfer_direct(*args, inline=True)


def test_the_inline_signaled_load_passes_what_the_signaled_one_passes() -> None:
    fake = FakeDmaLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    args = (0x1000, None, 61, 0x3000, LAYOUT, 0x4000, True, 0x5000, 0, 960, 0x6000, 0x6100,
            0xFFFFFFFF, 0x7000)
    lib.load_layers_signaled(*args, bounds=BOUNDS)
    lib.load_layers_signaled(*args, bounds=BOUNDS, inline=True)
    (plain, plain_args), (inline, inline_args) = fake.calls
    assert (plain, inline) == ("kvio_load_layers_signaled", "kvio_load_layers_signaled_inline")
    assert _argtypes(inline) == _argtypes(plain)
    assert _values(inline_args)[5:] == _values(plain_args)[5:]
    without = _native.NativeLibrary("fake.so", lib=FakeLib())
    with pytest.raises(BuildError, match="kvio_load_layers_signaled"):
        without.load_layers_signaled(*args, bounds=BOUNDS, inline=True)


def test_signals_need_all_three_functions_and_a_runtime_that_can_wait() -> None:
    unable = FakeDmaLib()
    unable.signals = 0
    assert not _native.NativeLibrary("fake.so", lib=unable).has_layer_signals()
    without = _native.NativeLibrary("fake.so", lib=FakeLib())
    assert not without.has_layer_signals()
    with pytest.raises(BuildError, match="does not export kvio_has_layer_signals, "
                                         "kvio_load_layers_signaled, kvio_wait_layer_signal"):
        without.wait_layer_signal(1, 1, 0)


def test_a_library_without_the_optional_dma_load_still_binds_and_says_so() -> None:
    lib = _native.NativeLibrary("fake.so", lib=FakeLib())
    assert not lib.has_load_layer_dma()
    with pytest.raises(BuildError, match="does not export kvio_load_layer_dma"):
        lib.load_layer_dma(1, 2, 0, 3, LAYOUT, 4, 5, 64, 1, 0)


@pytest.mark.parametrize(
    ("code", "message", "error"),
    [(700, "kvio_transfer_direct: an illegal memory access was encountered (cuda error 700); "
      "a sticky fault: every later call on this device fails the same way until the process "
      "restarts", DeviceFault),
     (719, "kvio_transfer_direct: unrecognized error code (cuda error 719); a sticky fault: "
      "every later call on this device fails the same way until the process restarts",
      DeviceFault),
     (1, "kvio_transfer_direct: invalid argument (cuda error 1)", KernelError),
     (12345, "kvio_transfer_direct: unrecognized error code (cuda error 12345)", KernelError)],
)
def test_error_translation(code: int, message: str, error: type[KernelError]) -> None:
    """A sticky fault (the context is lost) is a DeviceFault, which marks a controller
    unusable; any other status a KernelError of that call alone."""
    lib = _native.NativeLibrary("fake.so", lib=FakeLib(status=code))
    with pytest.raises(KernelError) as info:
        lib.transfer_direct(1, 1, 2, 0, 1, 3, LAYOUT, 4, 0, 5, 0, 64, 0)
    assert type(info.value) is error
    assert str(info.value) == message
    assert info.value.code == code


def test_error_translation_staged() -> None:
    lib = _native.NativeLibrary("fake.so", lib=FakeLib(status=700))
    with pytest.raises(KernelError, match=r"^kvio_write_back_staged: an illegal memory") as info:
        lib.write_back_staged(1, 2, 4, 3, LAYOUT, 4, 5, 0, 64, 6, 1 << 20, 1, 0)
    assert info.value.code == 700


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("direction", 2, "direction"), ("k_ptrs", -1, "k_ptrs"), ("k_ptrs", 1 << 64, "k_ptrs"),
     ("layer_count", 1 << 31, "layer_count"), ("n_tokens", 1 << 63, "n_tokens"),
     ("host_idx", 1.5, "host_idx"), ("layout", [1, 2], "layout")],
)
def test_argument_range_checks(field: str, value: Any, match: str) -> None:
    fake = FakeLib()
    lib = _native.NativeLibrary("fake.so", lib=fake)
    args: dict[str, Any] = {
        "direction": 0, "k_ptrs": 1, "v_ptrs": 2, "layer_begin": 0, "layer_count": 1,
        "host_base": 3, "layout": LAYOUT, "host_idx": 4, "host_idx_64": 0, "dev_idx": 5,
        "dev_idx_64": 0, "n_tokens": 64, "stream": 0,
    }
    args[field] = value
    with pytest.raises(InvalidArgument, match=match):
        lib.transfer_direct(**args)
    assert fake.calls == []  # nothing reached the library


# ------------------------------------------------------- the real library, loaded on a CPU


@pytest.fixture(scope="module")
def real_library(tmp_path_factory: pytest.TempPathFactory) -> _native.NativeLibrary:
    try:
        build.find_nvcc()
    except BuildError as exc:
        pytest.skip(f"no usable nvcc to build the library: {exc}")
    path = build.build_library(9, 0, cache_dir=tmp_path_factory.mktemp("kvcore-cache"))
    try:
        return _native.NativeLibrary(path)
    except BuildError as exc:
        pytest.skip(f"the library built but cannot be loaded here (no libcudart?): {exc}")


def test_real_library_abi_and_errors(real_library: _native.NativeLibrary) -> None:
    assert real_library.abi_version() == ABI_VERSION
    assert real_library.error_string(1) == "invalid argument"
    assert real_library.error_string(700) == "an illegal memory access was encountered"
    assert isinstance(real_library.has_batched_memcpy(), bool)


def test_real_library_refuses_bad_arguments_before_any_cuda_call(
        real_library: _native.NativeLibrary) -> None:
    raw = real_library._lib
    layout = _native.KvioLayout.from_fields(LAYOUT)
    # direction 5, NULL k_ptrs, negative n_tokens, zero page_size: cudaErrorInvalidValue (1)
    assert raw.kvio_transfer_direct(5, 1, 0, 0, 1, 1, layout, 1, 0, 1, 0, 64, None, BOUNDS) == 1
    assert raw.kvio_transfer_direct(0, None, 0, 0, 1, 1, layout, 1, 0, 1, 0, 64, None, BOUNDS) == 1
    assert raw.kvio_transfer_direct(0, 1, 0, 0, 1, 1, layout, 1, 0, 1, 0, -1, None, BOUNDS) == 1
    bad = _native.KvioLayout.from_fields(LAYOUT, page_size=0)
    assert raw.kvio_transfer_direct(0, 1, 0, 0, 1, 1, bad, 1, 0, 1, 0, 64, None, BOUNDS) == 1
    # nothing to do is a success without touching the device
    assert raw.kvio_transfer_direct(0, 1, 0, 0, 1, 1, layout, 1, 0, 1, 0, 0, None, BOUNDS) == 0
    assert raw.kvio_transfer_direct(1, 1, 0, 0, 0, 1, layout, 1, 0, 1, 0, 64, None, BOUNDS) == 0
    with pytest.raises(KernelError,
                       match=r"kvio_transfer_direct: invalid argument \(cuda error 1\)"):
        real_library.transfer_direct(0, 0, 0, 0, 1, 1, layout, 1, 0, 1, 0, 64, 0)


@pytest.mark.parametrize("function", ["kvio_write_back_staged", "kvio_load_all_staged"])
def test_real_library_staged_transfers_refuse_bad_arguments_before_any_cuda_call(
        real_library: _native.NativeLibrary, function: str) -> None:
    assert real_library.has_load_all_staged()
    staged = getattr(real_library._lib, function)
    layout = _native.KvioLayout.from_fields(LAYOUT)
    # n_tokens not whole pages; a layout whose page is not one contiguous run (layer_stride
    # 1024 with 32 layers needs token_stride 32 KiB: pass 16 layers instead); NULL staging;
    # a staging buffer smaller than one page. Nothing to do is a success.
    assert staged(1, 0, 32, 1, layout, 1, 1, 0, 63, 1, 1 << 30, 1, None, BOUNDS) == 1
    assert staged(1, 0, 16, 1, layout, 1, 1, 0, 64, 1, 1 << 30, 1, None, BOUNDS) == 1
    assert staged(1, 0, 32, 1, layout, 1, 1, 0, 64, None, 1 << 30, 1, None, BOUNDS) == 1
    host_idx = (ctypes.c_int64 * 64)(*range(64))
    assert staged(1, 0, 32, 1, layout, host_idx, 1, 0, 64, 1, 1024, 1, None, BOUNDS) == 1
    assert staged(1, 0, 32, 1, layout, 1, 1, 0, 0, 1, 1 << 30, 1, None, BOUNDS) == 0


JOB_WRITE_BACKS = ("kvio_write_back_staged_async", "kvio_write_back_staged_after")


@pytest.mark.parametrize("function", JOB_WRITE_BACKS)
def test_real_library_job_write_back_refuses_what_the_staged_one_refuses_and_issues_nothing(
        real_library: _native.NativeLibrary, function: str) -> None:
    """kvio_write_back_staged_async (handed to the thread) and _after (issued by the caller)
    check as kvio_write_back_staged does: an error hands out no job and enqueues nothing."""
    assert real_library.has_async_write_back()
    assert real_library.has_overlapped_write_back()
    raw = real_library._lib
    call = getattr(raw, function)
    layout = _native.KvioLayout.from_fields(LAYOUT)
    job = ctypes.c_void_p(0xDEAD)

    def staged(*args: Any) -> int:
        job.value = 0xDEAD
        return call(*args[:-1], None, args[-1], ctypes.byref(job))  # type: ignore[no-any-return]

    # the cases of the staged write-back (above), each refused with no job handed out
    assert staged(1, 0, 32, 1, layout, 1, 1, 0, 63, 1, 1 << 30, 1, None, BOUNDS) == 1
    assert job.value is None
    assert staged(1, 0, 16, 1, layout, 1, 1, 0, 64, 1, 1 << 30, 1, None, BOUNDS) == 1
    assert staged(1, 0, 32, 1, layout, 1, 1, 0, 64, None, 1 << 30, 1, None, BOUNDS) == 1
    host_idx = (ctypes.c_int64 * 64)(*range(64))
    assert staged(1, 0, 32, 1, layout, host_idx, 1, 0, 64, 1, 1024, 1, None, BOUNDS) == 1
    assert call(1, 0, 32, 1, layout, 1, 1, 0, 64, 1, 1 << 30, 1,
                None, None, BOUNDS, None) == 1  # no job slot
    # nothing to do: a job that finished at once, touching no device
    assert staged(1, 0, 32, 1, layout, 1, 1, 0, 0, 1, 1 << 30, 1, None, BOUNDS) == 0
    assert job.value not in (None, 0xDEAD)
    assert raw.kvio_job_status(job) == 0 and raw.kvio_job_wait(job) == 0
    raw.kvio_job_release(job)
    method = getattr(real_library, function.removeprefix("kvio_"))
    with pytest.raises(KernelError, match=rf"{function}: invalid argument"):
        method(1, 0, 32, 1, LAYOUT, 1, 1, 0, 63, 1, 1 << 30, 1, None, None)


@pytest.mark.parametrize("function", JOB_WRITE_BACKS)
def test_the_job_write_back_is_refused_by_a_library_without_it(function: str) -> None:
    lib = _native.NativeLibrary("fake.so", lib=FakeDmaLib())
    assert not lib.has_async_write_back() and not lib.has_overlapped_write_back()
    with pytest.raises(BuildError, match=f"does not export {function} and the job functions"):
        getattr(lib, function.removeprefix("kvio_"))(1, 0, 32, 1, LAYOUT, 1, 1, 0, 64, 1,
                                                    1 << 30, 1, None, None)


@pytest.mark.parametrize("function", JOB_WRITE_BACKS)
def test_real_library_job_write_back_refuses_an_out_of_range_cpu_host_index(
        real_library: _native.NativeLibrary, no_gpu: None, function: str) -> None:
    layout = _native.KvioLayout.from_fields(LAYOUT)
    host_idx = (ctypes.c_int64 * 128)(*range(64, 192))
    dev_idx = (ctypes.c_int64 * 128)()
    job = ctypes.c_void_p()

    def call(host_tokens: int) -> int:
        return getattr(real_library._lib, function)(  # type: ignore[no-any-return]
            1, 0, 32, 1, layout, ctypes.addressof(host_idx), ctypes.addressof(dev_idx), 1,
            128, 1, 1 << 30, 1, None, None, _bounds(host_tokens, 1 << 20), ctypes.byref(job))

    assert call(191) == 1 and job.value is None
    assert _reaches_the_runtime(call(192))  # in range: on to the device (none here)


def test_real_library_chained_transfer_refuses_bad_arguments_before_any_cuda_call(
        real_library: _native.NativeLibrary) -> None:
    assert real_library.has_transfer_direct_chained()
    raw = real_library._lib
    layout = _native.KvioLayout.from_fields(LAYOUT)
    assert raw.kvio_transfer_direct_chained(1, None, 0, 0, 1, 1, layout, 1, 0, 1, 0, 64,
                                            None, BOUNDS) == 1
    assert raw.kvio_transfer_direct_chained(1, 1, 0, -1, 1, 1, layout, 1, 0, 1, 0, 64,
                                            None, BOUNDS) == 1
    assert raw.kvio_transfer_direct_chained(1, 1, 0, 0, 1, 1, layout, 1, 0, 1, 0, 0,
                                            None, BOUNDS) == 0


def test_real_library_dma_load_refuses_bad_arguments_before_any_cuda_call(
        real_library: _native.NativeLibrary) -> None:
    assert real_library.has_load_layer_dma()
    raw = real_library._lib
    layout = _native.KvioLayout.from_fields(LAYOUT)
    # NULL destination, negative layer, negative n_tokens, NULL indices: invalid value (1)
    assert raw.kvio_load_layer_dma(None, 0, 0, 1, layout, 1, 1, 64, 1, None, BOUNDS) == 1
    assert raw.kvio_load_layer_dma(1, 0, -1, 1, layout, 1, 1, 64, 1, None, BOUNDS) == 1
    assert raw.kvio_load_layer_dma(1, 0, 0, 1, layout, 1, 1, -1, 1, None, BOUNDS) == 1
    assert raw.kvio_load_layer_dma(1, 0, 0, 1, layout, None, 1, 64, 1, None, BOUNDS) == 1
    # an element split into chunks apart on the host (page_head) is no contiguous copy
    split = _native.KvioLayout.from_fields(LAYOUT, chunk_bytes=64, num_chunks=4,
                                           chunk_stride=4096)
    assert raw.kvio_load_layer_dma(1, 0, 0, 1, split, 1, 1, 64, 1, None, BOUNDS) == 1
    # a negative index is refused before any copy is issued
    h = (ctypes.c_int64 * 2)(0, -5)
    d = (ctypes.c_int64 * 2)(0, 1)
    assert raw.kvio_load_layer_dma(1, 0, 0, 1, layout, ctypes.addressof(h),
                                   ctypes.addressof(d), 2, 1, None, BOUNDS) == 1
    # nothing to do is a success without touching the device
    assert raw.kvio_load_layer_dma(1, 0, 0, 1, layout, None, None, 0, 1, None, BOUNDS) == 0


def test_real_library_signaled_load_refuses_bad_arguments_before_any_cuda_call(
        real_library: _native.NativeLibrary) -> None:
    raw = real_library._lib
    layout = _native.KvioLayout.from_fields(LAYOUT)
    assert real_library.has_layer_signals() in (True, False)  # no GPU needed to ask
    # NULL k_ptrs, no layers, negative n_tokens, NULL counters or flags, NULL indices
    signaled = raw.kvio_load_layers_signaled
    assert signaled(None, 0, 4, 1, layout, 1, 0, 1, 0, 64, 1, 1, 1, None, BOUNDS) == 1
    assert signaled(1, 0, 0, 1, layout, 1, 0, 1, 0, 64, 1, 1, 1, None, BOUNDS) == 1
    assert signaled(1, 0, 4, 1, layout, 1, 0, 1, 0, -1, 1, 1, 1, None, BOUNDS) == 1
    assert signaled(1, 0, 4, 1, layout, 1, 0, 1, 0, 64, None, 1, 1, None, BOUNDS) == 1
    assert signaled(1, 0, 4, 1, layout, 1, 0, 1, 0, 64, 1, None, 1, None, BOUNDS) == 1
    assert signaled(1, 0, 4, 1, layout, None, 0, 1, 0, 64, 1, 1, 1, None, BOUNDS) == 1
    bad = _native.KvioLayout.from_fields(LAYOUT, page_size=0)
    assert signaled(1, 0, 4, 1, bad, 1, 0, 1, 0, 64, 1, 1, 1, None, BOUNDS) == 1
    assert raw.kvio_wait_layer_signal(None, 1, None) == 1


# ------------------------------------------------ ABI v2 bounds, the real library on a CPU


def _bounds(host_tokens: int, device_tokens: int) -> KvioBounds:
    return make_bounds(host_tokens, device_tokens, ctypes.addressof(REPORT), 9)


def _reaches_the_runtime(code: int) -> bool:
    """Whether a call got past its argument checks: without a GPU (and maybe without a
    driver) its first runtime call fails with a code other than cudaErrorInvalidValue."""
    return code not in (0, 1)


@pytest.fixture
def no_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the control calls would reach a real GPU with made-up pointers")


def test_real_library_refuses_missing_bounds(real_library: _native.NativeLibrary) -> None:
    raw = real_library._lib
    layout = _native.KvioLayout.from_fields(LAYOUT)
    no_report = KvioBounds(host_tokens=64, device_tokens=64, report=0, epoch=1)
    for bounds in (None, no_report):
        assert raw.kvio_transfer_direct(0, 1, 0, 0, 1, 1, layout, 1, 0, 1, 0, 64, None,
                                        bounds) == 1
        assert raw.kvio_transfer_direct_chained(1, 1, 0, 0, 1, 1, layout, 1, 0, 1, 0, 64,
                                                None, bounds) == 1
        assert raw.kvio_write_back_staged(1, 0, 32, 1, layout, 1, 1, 0, 64, 1, 1 << 30, 1,
                                          None, bounds) == 1
        assert raw.kvio_load_all_staged(1, 0, 32, 1, layout, 1, 1, 0, 64, 1, 1 << 30, 1,
                                        None, bounds) == 1
        assert raw.kvio_load_layer_dma(1, 0, 0, 1, layout, 1, 1, 64, 1, None, bounds) == 1
        assert raw.kvio_load_layers_signaled(1, 0, 4, 1, layout, 1, 0, 1, 0, 64, 1, 1, 1,
                                             None, bounds) == 1


@pytest.mark.parametrize("function", ["kvio_write_back_staged", "kvio_load_all_staged"])
def test_real_library_staged_refuses_an_out_of_range_cpu_host_index_before_any_cuda_call(
        real_library: _native.NativeLibrary, function: str, no_gpu: None) -> None:
    staged = getattr(real_library._lib, function)
    layout = _native.KvioLayout.from_fields(LAYOUT)  # 32 layers of 64-token pages
    host_idx = (ctypes.c_int64 * 128)(*range(64, 192))  # host pages 1 and 2
    dev_idx = (ctypes.c_int64 * 128)()

    def call(host_tokens: int) -> int:
        return staged(1, 0, 32, 1, layout, ctypes.addressof(host_idx),
                      ctypes.addressof(dev_idx), 1, 128, 1, 1 << 30, 1, None,
                      _bounds(host_tokens, 1 << 20))

    assert call(191) == 1  # the last token of page 2 is out of range
    assert call(128) == 1  # all of page 2 is
    assert _reaches_the_runtime(call(192))  # in range: on to the device (none here)


def test_real_library_dma_load_refuses_an_out_of_range_cpu_index_before_any_cuda_call(
        real_library: _native.NativeLibrary, no_gpu: None) -> None:
    raw = real_library._lib
    layout = _native.KvioLayout.from_fields(LAYOUT)
    h = (ctypes.c_int64 * 4)(0, 1, 2, 40)  # runs [0, 3) and [40, 41)
    d = (ctypes.c_int64 * 4)(10, 11, 12, 7)

    def call(host_tokens: int, device_tokens: int) -> int:
        return raw.kvio_load_layer_dma(1, 0, 0, 1, layout, ctypes.addressof(h),
                                       ctypes.addressof(d), 4, 1, None,
                                       _bounds(host_tokens, device_tokens))

    assert call(40, 13) == 1  # host 40 is out of range
    assert call(41, 12) == 1  # device 12, the end of the first run, is
    assert call(41, 11) == 1
    assert _reaches_the_runtime(call(41, 13))


@pytest.mark.parametrize("function", ["kvio_load_layers_signaled_inline",
                                      "kvio_transfer_direct_inline"])
@pytest.mark.parametrize("width", [64, 32])
def test_real_library_inline_transfers_refuse_what_they_cannot_carry_before_any_cuda_call(
        real_library: _native.NativeLibrary, no_gpu: None, width: int, function: str) -> None:
    """Their host indices are read on the CPU during the call: one out of range, more than
    KVIO_INLINE_INDEX_TOKENS that are not whole pages, or more than KVIO_INLINE_INDEX_PAGES
    pages, is refused before the runtime is asked anything."""
    inline = getattr(real_library._lib, function)
    layout = _native.KvioLayout.from_fields(LAYOUT)
    page = LAYOUT["page_size"]
    c_int = ctypes.c_int64 if width == 64 else ctypes.c_int32
    n = (INLINE_INDEX_PAGES + 1) * page
    h = (c_int * n)(*range(100, 100 + n))
    d = (ctypes.c_int64 * n)()

    def call(tokens: int, host_tokens: int) -> int:
        indexed = (1, layout, ctypes.addressof(h), int(width == 64), ctypes.addressof(d), 1,
                   tokens)
        bounds = _bounds(host_tokens, 1 << 20)
        if function == "kvio_transfer_direct_inline":
            return inline(1, 1, 0, 0, 4, *indexed, None, bounds)
        return inline(1, 0, 4, *indexed, 1, 1, 1, None, bounds)

    # one index per token
    assert call(INLINE_INDEX_TOKENS + 1, 1 << 20) == 1  # one more than the launch carries
    assert call(64, 163) == 1  # host index 163 is out of range
    h[0] = -1
    assert call(64, 1 << 20) == 1  # so is -1
    h[0] = 100
    assert _reaches_the_runtime(call(64, 164))
    assert _reaches_the_runtime(call(INLINE_INDEX_TOKENS, 1 << 20))
    # one index per whole page (pages 7, 8, ... from token 448 on), beyond 960 tokens
    for i in range(n):
        h[i] = 7 * page + i
    pages = INLINE_INDEX_TOKENS // page + 1
    assert _reaches_the_runtime(call(pages * page, (7 + pages) * page))
    assert call(pages * page, (7 + pages) * page - 1) == 1  # the last page's last token
    assert _reaches_the_runtime(call(INLINE_INDEX_PAGES * page, 1 << 20))
    assert call(n, 1 << 20) == 1  # a page more than the launch carries
    assert call(pages * page + 1, 1 << 20) == 1  # not whole pages
    h[3 * page + 5] += 1
    assert call(pages * page, 1 << 20) == 1  # a page whose tokens do not count up by one
    h[3 * page + 5] -= 1
    for i in range(n):
        h[i] = 7 * page + 1 + i
    assert call(pages * page, 1 << 20) == 1  # pages that do not start at a multiple of 64


def test_real_library_direct_after_refuses_what_the_direct_forms_refuse_and_hands_out_no_job(
        real_library: _native.NativeLibrary, no_gpu: None) -> None:
    """kvio_transfer_direct_after checks as kvio_transfer_direct (host_inline 0) and
    kvio_transfer_direct_inline (1) do, before recording anything: a refused call leaves no
    job; one that moves nothing hands out a job already finished, touching no device."""
    assert real_library.has_direct_after()
    raw = real_library._lib
    layout = _native.KvioLayout.from_fields(LAYOUT)
    job = ctypes.c_void_p()
    host = (ctypes.c_int64 * 64)(*range(64, 128))
    dev = (ctypes.c_int64 * 64)(*range(64))

    def call(direction: int, k: int | None, first: int, n: int, inline: int,
             host_tokens: int = 1 << 20) -> int:
        job.value = 0xDEAD
        return raw.kvio_transfer_direct_after(  # type: ignore[no-any-return]
            direction, k, 0, first, 1, 1, layout, ctypes.addressof(host), 1,
            ctypes.addressof(dev), 1, n, inline, None, None, _bounds(host_tokens, 1 << 20),
            ctypes.byref(job))

    assert call(2, 1, 0, 64, 0) == 1 and job.value is None  # no such direction
    assert call(0, None, 0, 64, 0) == 1 and job.value is None  # no K pointers
    assert call(0, 1, -1, 64, 0) == 1 and job.value is None  # a negative layer
    assert call(0, 1, 0, 64, 1, host_tokens=127) == 1 and job.value is None  # index 127
    assert raw.kvio_transfer_direct_after(0, 1, 0, 0, 1, 1, layout, 1, 1, 1, 1, 64, 0, None,
                                          None, BOUNDS, None) == 1  # no job slot
    # in range, inline or not: past the checks to the runtime (no GPU here), no job
    assert _reaches_the_runtime(call(0, 1, 0, 64, 1, host_tokens=128)) and job.value is None
    assert _reaches_the_runtime(call(0, 1, 0, 64, 0)) and job.value is None
    # nothing to do: a finished job
    assert call(0, 1, 0, 0, 1) == 0 and job.value not in (None, 0xDEAD)
    assert raw.kvio_job_status(job) == 0 and raw.kvio_job_wait(job) == 0
    raw.kvio_job_release(job)
    with pytest.raises(KernelError, match="kvio_transfer_direct_after: invalid argument"):
        real_library.transfer_direct_after(0, 1, 0, -1, 1, 1, LAYOUT, 1, 1, 1, 1, 64, 0, None,
                                           None, BOUNDS)


def test_the_direct_transfer_after_binds_the_direct_arguments_then_its_own() -> None:
    direct, after = _argtypes("kvio_transfer_direct"), _argtypes("kvio_transfer_direct_after")
    assert after[:12] == direct[:12]  # up to n_tokens
    assert after[12:15] == [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    assert after[15] == direct[13]  # bounds
    assert after[16] == ctypes.POINTER(ctypes.c_void_p)
    lib = _native.NativeLibrary("fake.so", lib=FakeLib())
    assert not lib.has_direct_after()
    with pytest.raises(BuildError, match="does not export kvio_transfer_direct_after"):
        lib.transfer_direct_after(0, 1, 0, 0, 1, 1, LAYOUT, 1, 1, 1, 1, 64, 1, None, None)
    with pytest.raises(InvalidArgument, match="direction"):
        lib.transfer_direct_after(2, 1, 0, 0, 1, 1, LAYOUT, 1, 1, 1, 1, 64, 1, None, None)
