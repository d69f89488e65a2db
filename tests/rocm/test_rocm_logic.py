"""kvio_rocm's pure logic: availability probe, gfx parsing, toolchain search, build commands,
and the ctypes binding's marshalling and error translation (with fake libraries).

(The probe module is imported as ``kvio_rocm.probe``'s members: the package also defines a
function named ``probe``, which ``from kvio_rocm import probe`` would return.)"""

from __future__ import annotations

import ctypes
import dataclasses
import stat
import types
from pathlib import Path

import pytest
import torch
from kvio_rocm import build
from kvio_rocm._native import PROTOTYPES, KvioLayout, NativeLibrary, make_layout
from kvio_rocm.probe import RocmFacts, gather_facts
from kvio_rocm.probe import probe as rocm_probe

from kvcore import native_abi
from kvcore.buildcache import files_digest
from kvcore.errors import BuildError, DeviceFault, InvalidArgument, KernelError
from kvcore.layout import Geometry, Kind, Layout, byte_strides
from kvcore.native import layout_fields
from kvcore.native_abi import ABI_HEADER, ABI_VERSION, INCLUDE_DIR

# ---------------------------------------------------------------------------- probe

GOOD = RocmFacts(torch_hip_version="6.4.43483", device_count=2, gcn_arch="gfx942",
                 compiler=Path("/opt/rocm/bin/hipcc"),
                 compiler_targets=frozenset({"gfx90a", "gfx942"}), torch_version="2.13.0+rocm6.4",
                 searched=("PATH", "/opt/rocm/bin"), rocm_version="6.4.43483")


def test_probe_available() -> None:
    ok, reason = rocm_probe(GOOD)
    assert ok
    assert reason == ("gfx942, 2 GPUs, HIP 6.4.43483, ROCm 6.4.43483, compiler "
                      "/opt/rocm/bin/hipcc")


def test_probe_not_a_rocm_torch() -> None:
    facts = dataclasses.replace(GOOD, torch_hip_version=None, torch_version="2.13.0+cpu",
                                device_count=0)
    assert rocm_probe(facts) == (
        False, "torch 2.13.0+cpu is not a ROCm build (torch.version.hip is None)")


def test_probe_no_gpu() -> None:
    ok, reason = rocm_probe(dataclasses.replace(GOOD, device_count=0))
    assert not ok
    assert reason.startswith("no AMD GPU visible (torch 2.13.0+rocm6.4 with HIP 6.4.43483 "
                             "reports 0 devices")


def test_probe_unknown_arch() -> None:
    ok, reason = rocm_probe(dataclasses.replace(GOOD, gcn_arch=None))
    assert not ok
    assert "gcnArchName is empty" in reason


def test_probe_no_compiler() -> None:
    facts = dataclasses.replace(GOOD, compiler=None, compiler_targets=frozenset(),
                                searched=("$ROCM_PATH/bin (/x/bin)", "PATH", "/opt/rocm/bin"))
    assert rocm_probe(facts) == (
        False, "no compiler found that targets gfx942: looked for hipcc, amdclang++, clang in "
               "$ROCM_PATH/bin (/x/bin), PATH, /opt/rocm/bin")


def test_probe_compiler_too_old_for_target() -> None:
    facts = dataclasses.replace(GOOD, gcn_arch="gfx950",
                                compiler_targets=frozenset({"gfx90a", "gfx940", "gfx942"}))
    ok, reason = rocm_probe(facts)
    assert not ok
    assert reason == ("no compiler found that targets gfx950: /opt/rocm/bin/hipcc knows "
                      "gfx90a, gfx940, gfx942 (a newer ROCm is needed for gfx950)")


def test_probe_compiler_without_target_list_is_accepted() -> None:
    ok, reason = rocm_probe(dataclasses.replace(GOOD, compiler_targets=frozenset()))
    assert ok and reason.endswith("(it did not list its targets)")


def test_gather_facts_on_this_torch() -> None:
    facts = gather_facts()
    assert facts.torch_version == torch.__version__
    assert facts.torch_hip_version == getattr(torch.version, "hip", None)
    if facts.torch_hip_version is None:
        ok, reason = rocm_probe(facts)
        assert not ok
        assert reason == (f"torch {torch.__version__} is not a ROCm build "
                          "(torch.version.hip is None)")


def test_gather_facts_from_a_rocm_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43483", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    monkeypatch.setattr(build, "find_toolchain", _raise(BuildError("nothing here")))
    facts = gather_facts()
    assert (facts.torch_hip_version, facts.device_count, facts.gcn_arch) == (
        "6.4.43483", 8, "gfx942")
    assert facts.compiler is None
    ok, reason = rocm_probe(facts)
    assert not ok and reason.startswith("no compiler found that targets gfx942: looked for "
                                        "hipcc, amdclang++, clang in ")


def _raise(exc: BaseException):
    def f(*a: object, **k: object) -> None:
        raise exc
    return f


def test_gather_facts_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", _raise(RuntimeError("driver exploded")))
    monkeypatch.setattr(build, "find_toolchain", _raise(OSError("disk gone")))
    facts = gather_facts()
    assert facts.device_count == 0 and facts.compiler is None
    assert rocm_probe(facts)[0] is False


# ---------------------------------------------------------------------------- gfx, versions


@pytest.mark.parametrize("raw,arch", [
    ("gfx942:sramecc+:xnack-", "gfx942"),
    ("gfx90a:xnack-", "gfx90a"),
    ("gfx950", "gfx950"),
    ("GFX1100", "gfx1100"),
    (" gfx908:sramecc- ", "gfx908"),
])
def test_parse_gcn_arch(raw: str, arch: str) -> None:
    assert build.parse_gcn_arch(raw) == arch


@pytest.mark.parametrize("raw", ["", "gfx", "sm_90", "gfx94z", "942", "gfx94200"])
def test_parse_gcn_arch_refuses(raw: str) -> None:
    with pytest.raises(BuildError, match="cannot read a gfx target"):
        build.parse_gcn_arch(raw)


def test_detect_gfx_arch_on_a_cpu_torch() -> None:
    if getattr(torch.version, "hip", None) is not None:
        pytest.skip("this torch is a ROCm build")
    with pytest.raises(BuildError, match="is not a ROCm build"):
        build.detect_gfx_arch()


def test_detect_gfx_arch_strips_features(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-"))
    assert build.detect_gfx_arch() == "gfx950"


HIP_VERSION_H = """
#define HIP_VERSION_MAJOR 6
#define HIP_VERSION_MINOR 4
#define HIP_VERSION_PATCH 43483
#define HIP_VERSION (HIP_VERSION_MAJOR * 10000000 + HIP_VERSION_MINOR * 100000 + HIP_VERSION_PATCH)
"""


def test_parse_hip_version() -> None:
    assert build.parse_hip_version(HIP_VERSION_H) == "6.4.43483"
    with pytest.raises(BuildError):
        build.parse_hip_version("#define NOTHING 1")


# ---------------------------------------------------------------------------- toolchain


def fake_rocm(root: Path, hipcc: bool = True, clang: bool = False) -> Path:
    (root / "include" / "hip").mkdir(parents=True)
    (root / "include" / "hip" / "hip_runtime.h").write_text("// fake\n")
    (root / "include" / "hip" / "hip_version.h").write_text(HIP_VERSION_H)
    (root / "lib").mkdir()
    tools = []
    if hipcc:
        tools.append(root / "bin" / "hipcc")
    if clang:
        tools.append(root / "llvm" / "bin" / "amdclang++")
    for tool in tools:
        tool.parent.mkdir(parents=True, exist_ok=True)
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return root


@pytest.fixture
def no_default_rocm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    missing = tmp_path / "no-rocm-here"
    monkeypatch.setattr(build, "DEFAULT_ROCM_ROOT", missing)
    return missing


def test_find_toolchain_hipcc_from_rocm_path(tmp_path: Path, no_default_rocm: Path) -> None:
    root = fake_rocm(tmp_path / "rocm")
    tc = build.find_toolchain({"ROCM_PATH": str(root), "PATH": ""})
    assert (tc.compiler, tc.kind, tc.rocm_root, tc.version) == (
        root / "bin" / "hipcc", "hipcc", root, "6.4.43483")


def test_find_toolchain_rocm_clang(tmp_path: Path, no_default_rocm: Path) -> None:
    root = fake_rocm(tmp_path / "rocm", hipcc=False, clang=True)
    tc = build.find_toolchain({"ROCM_PATH": str(root), "PATH": ""})
    assert (tc.compiler, tc.kind) == (root / "llvm" / "bin" / "amdclang++", "clang")


def test_find_toolchain_explicit_compiler(tmp_path: Path, no_default_rocm: Path) -> None:
    root = fake_rocm(tmp_path / "rocm", hipcc=False, clang=True)
    cxx = root / "llvm" / "bin" / "amdclang++"
    tc = build.find_toolchain({"KVIO_ROCM_CXX": str(cxx), "PATH": ""})
    assert (tc.compiler, tc.kind, tc.rocm_root) == (cxx, "clang", root)


def test_find_toolchain_none(tmp_path: Path, no_default_rocm: Path) -> None:
    with pytest.raises(BuildError) as err:
        build.find_toolchain({"ROCM_PATH": str(tmp_path / "nope"), "PATH": ""})
    msg = str(err.value)
    assert msg.startswith("no HIP compiler found: kvio_rocm builds its kernels with ROCm's "
                          "hipcc or clang; looked in $KVIO_ROCM_CXX (not set), $ROCM_PATH/bin (")
    assert f"{no_default_rocm}/bin ({no_default_rocm}/bin/hipcc: not found)" in msg


def test_compiler_without_rocm_next_to_it_is_refused(tmp_path: Path,
                                                     no_default_rocm: Path) -> None:
    lonely = tmp_path / "bin" / "hipcc"
    lonely.parent.mkdir()
    lonely.write_text("#!/bin/sh\n")
    lonely.chmod(0o755)
    with pytest.raises(BuildError, match="no ROCm installation with include/hip"):
        build.find_toolchain({"PATH": str(lonely.parent)})


def test_compile_command_hipcc() -> None:
    tc = build.RocmToolchain(Path("/opt/rocm/bin/hipcc"), "hipcc", Path("/opt/rocm"), "6.4.0")
    cmd = build.compile_command(tc, "kvio_rocm.hip", "out.so", "gfx942:sramecc+:xnack-")
    assert cmd == ["/opt/rocm/bin/hipcc", "-O3", "-std=c++17", "-fPIC", "-shared",
                   "-fvisibility=hidden", f"-I{INCLUDE_DIR}", "--offload-arch=gfx942", "-o",
                   "out.so", "kvio_rocm.hip", "-ldl"]


def test_compile_command_clang() -> None:
    tc = build.RocmToolchain(Path("/opt/rocm/llvm/bin/clang++"), "clang", Path("/opt/rocm"),
                             "7.1.0")
    cmd = build.compile_command(tc, "kvio_rocm.hip", "out.so", "gfx950")
    assert cmd == ["/opt/rocm/llvm/bin/clang++", "-x", "hip", "-O3", "-std=c++17", "-fPIC",
                   "-shared", "-fvisibility=hidden", f"-I{INCLUDE_DIR}", "--offload-arch=gfx950",
                   "--rocm-path=/opt/rocm", "-o", "out.so", "kvio_rocm.hip", "-x", "none",
                   "-L/opt/rocm/lib", "-Wl,-rpath,/opt/rocm/lib", "-lamdhip64", "-ldl"]


def test_compile_command_refuses_bad_arch() -> None:
    tc = build.RocmToolchain(Path("hipcc"), "hipcc", None, "unknown")
    with pytest.raises(BuildError):
        build.compile_command(tc, "a.hip", "a.so", "sm_90")


def test_library_sources_exclude_fixtures() -> None:
    digest = build.source_digest()
    assert digest == build.source_digest(("kvio_rocm.hip", "kvio_device.h", "kvio_index.h"))
    # kvcore's ABI header counts: the library is rebuilt when the ABI changes
    assert digest == files_digest([build.CSRC / n for n in ("kvio_device.h", "kvio_index.h",
                                                            "kvio_rocm.hip")] + [ABI_HEADER])
    assert (build.CSRC / "broken_scalar.hip").is_file()
    assert build.source_digest(("broken_scalar.hip",)) != digest


def test_build_library_uses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    tc = build.RocmToolchain(Path("/opt/rocm/bin/hipcc"), "hipcc", Path("/opt/rocm"), "6.4.0")
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], what: str) -> str:
        calls.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"\x7fELF fake library " + cmd[6].encode())
        return ""

    monkeypatch.setattr(build, "run_compiler", fake_run)
    first = build.build_library("gfx942:xnack-", cache_dir=cache, toolchain=tc)
    again = build.build_library("gfx942", cache_dir=cache, toolchain=tc)
    assert first == again and first.parent == cache and first.name.startswith("libkvio_rocm-")
    assert len(calls) == 1
    assert "--offload-arch=gfx942" in calls[0] and calls[0][-2] == str(build.HOST_SOURCE)
    other_arch = build.build_library("gfx950", cache_dir=cache, toolchain=tc)
    newer = build.build_library("gfx942", cache_dir=cache,
                                toolchain=dataclasses.replace(tc, version="7.1.0"))
    assert len({first, other_arch, newer}) == 3 and len(calls) == 3


def test_build_library_without_rocm_is_a_build_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     no_default_rocm: Path) -> None:
    monkeypatch.setenv("PATH", "")
    for var in ("ROCM_PATH", "HIP_PATH", "KVIO_ROCM_CXX"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(BuildError, match="no HIP compiler found"):
        build.build_library("gfx942", cache_dir=tmp_path)


# ---------------------------------------------------------------------------- _native


class FakeLib:
    """An object with the library's functions, each a real ctypes function pointer (so the
    binding's argtypes marshal exactly as for the .so) that records its arguments."""

    def __init__(self, status: int = 0, abi: int = ABI_VERSION, drop: str | None = None) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.status = status
        self._keep = []
        impl = {
            "kvio_abi_version": lambda: abi,
            "kvio_error_string": lambda code: {1: b"invalid argument",
                                               700: b"an illegal memory access was "
                                                    b"encountered"}.get(code, b"unknown"),
            "kvio_has_batched_memcpy": lambda: 1,
            "kvio_transfer_direct": self._record("kvio_transfer_direct"),
            "kvio_write_back_staged": self._record("kvio_write_back_staged"),
        }
        for name, (restype, argtypes) in PROTOTYPES.items():
            if name == drop:
                continue
            if name == "kvio_error_string":
                # a c_char_p result from a Python callback must outlive the call
                fn = self._error_string(impl[name])
            else:
                fn = ctypes.CFUNCTYPE(restype, *argtypes)(impl[name])
            self._keep.append(fn)
            setattr(self, name, fn)

    def _record(self, name: str):
        def f(*args: object) -> int:
            self.calls.append((name, args))
            return self.status
        return f

    def _error_string(self, impl):
        buffers: dict[int, ctypes.Array] = {}

        def f(code: int) -> int:
            buffers[code] = ctypes.create_string_buffer(impl(code))
            return ctypes.addressof(buffers[code])
        proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int)(f)
        self._keep.append(proto)
        return ctypes.cast(proto, ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_int))


def layout_of(g: Geometry, itemsize: int) -> dict[str, int]:
    return layout_fields(byte_strides(g, itemsize))


G = Geometry(kind=Kind.MHA, layout=Layout.PAGE_HEAD, num_layers=3, size=32, head_num=4,
             head_dim=16, page_size=8)


def test_transfer_direct_marshalling() -> None:
    fake = FakeLib()
    lib = NativeLibrary(lib=fake)
    lib.transfer_direct(1, 0x1000, 0x2000, 1, 2, 0x7F0000000000, layout_of(G, 2), 0x3000,
                        True, 0x4000, 0, 24, 0xABC)
    (name, args), = fake.calls
    assert name == "kvio_transfer_direct"
    assert args[:6] == (1, 0x1000, 0x2000, 1, 2, 0x7F0000000000)
    assert args[6].as_dict() == layout_of(G, 2)
    assert args[6].as_dict()["num_chunks"] == 4  # page_head: one chunk per head
    assert args[7:13] == (0x3000, 1, 0x4000, 0, 24, 0xABC)
    # no bounds given: a pointer to the binding's unchecked bounds (every index >= 0 in range,
    # a report buffer the binding owns)
    b = args[13].contents
    assert (b.host_tokens, b.device_tokens) == ((1 << 63) - 1, (1 << 63) - 1)
    assert b.report == ctypes.addressof(native_abi._UNCHECKED_REPORT) and b.epoch == 0


def test_bounds_reach_the_library_by_pointer() -> None:
    fake = FakeLib()
    lib = NativeLibrary(lib=fake)
    report = native_abi.KvioReport()
    bounds = native_abi.make_bounds(96, 40, ctypes.addressof(report), (1 << 64) - 1)
    lib.transfer_direct(0, 1, 2, 0, 3, 4, layout_of(G, 2), 5, 1, 6, 1, 8, 0, bounds=bounds)
    lib.write_back_staged(1, 2, 3, 4, layout_of(G, 2), 5, 6, 1, 8, 7, 8, 0, 0, bounds)
    for _, args in fake.calls:
        got = args[-1].contents
        assert ctypes.addressof(got) == ctypes.addressof(bounds)  # by reference, not a copy
        assert (got.host_tokens, got.device_tokens, got.epoch) == (96, 40, (1 << 64) - 1)
        assert got.report == ctypes.addressof(report)
    for bad, match in (({"report": 0}, r"bounds\.report"), ({"host_tokens": -1}, "host_tokens"),
                       ({"epoch": 1 << 64}, "epoch")):
        with pytest.raises(InvalidArgument, match=match):
            native_abi.make_bounds(**{"host_tokens": 1, "device_tokens": 1, "report": 8,
                                      "epoch": 0, **bad})
    with pytest.raises(InvalidArgument, match="a KvioBounds or None"):
        lib.transfer_direct(0, 1, 2, 0, 3, 4, layout_of(G, 2), 5, 1, 6, 1, 8, 0, bounds=(1, 2))
    assert len(fake.calls) == 2
    assert ctypes.sizeof(native_abi.KvioBounds) == ctypes.sizeof(native_abi.KvioReport) == 32


def test_write_back_staged_marshalling_and_null_pointers() -> None:
    fake = FakeLib()
    lib = NativeLibrary(lib=fake)
    lib.write_back_staged(0x1000, 0, 3, 0x9000, layout_of(G, 2), 0x5000, 0x6000, 1, 16,
                          0x7000, 1 << 20, 1, 0)
    (name, args), = fake.calls
    assert name == "kvio_write_back_staged"
    assert args[1] is None and args[-2] is None  # MLA v_ptrs and the default stream: NULL
    assert (args[0], args[2], args[3]) == (0x1000, 3, 0x9000)
    assert args[4].as_dict() == layout_of(G, 2)
    assert args[5:12] == (0x5000, 0x6000, 1, 16, 0x7000, 1 << 20, 1)


def test_nonzero_status_becomes_kernel_error_and_a_sticky_one_a_device_fault() -> None:
    lib = NativeLibrary(lib=FakeLib(status=700))
    with pytest.raises(DeviceFault) as err:
        lib.transfer_direct(0, 1, 2, 0, 3, 4, layout_of(G, 2), 5, 1, 6, 1, 8, 0)
    assert err.value.code == 700
    assert str(err.value) == ("kvio_transfer_direct: an illegal memory access was encountered "
                              "(hip error 700); a sticky fault: every later call on this "
                              "device fails the same way until the process restarts")
    for sticky in (702, 710, 719):
        with pytest.raises(DeviceFault, match=f"hip error {sticky}"):
            NativeLibrary(lib=FakeLib(status=sticky)).transfer_direct(
                0, 1, 2, 0, 3, 4, layout_of(G, 2), 5, 1, 6, 1, 8, 0)
    lib = NativeLibrary(lib=FakeLib(status=1))
    with pytest.raises(KernelError, match=r"^kvio_write_back_staged: invalid argument "
                                          r"\(hip error 1\)$") as plain:
        lib.write_back_staged(1, 2, 3, 4, layout_of(G, 2), 5, 6, 1, 8, 7, 8, 0, 0)
    assert not isinstance(plain.value, DeviceFault)


def test_library_facts_through_the_binding() -> None:
    lib = NativeLibrary(lib=FakeLib())
    assert lib.abi_version() == ABI_VERSION and lib.has_batched_memcpy() is True
    assert lib.error_string(1) == "invalid argument"


def test_abi_mismatch_and_missing_symbol_are_build_errors(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="implements native ABI version 1, this binding "
                                         f"speaks version {ABI_VERSION}"):
        NativeLibrary(lib=FakeLib(abi=1))
    with pytest.raises(BuildError, match="does not export kvio_write_back_staged"):
        NativeLibrary(lib=FakeLib(drop="kvio_write_back_staged"))
    with pytest.raises(BuildError, match="cannot load the kvio_rocm library"):
        NativeLibrary(tmp_path / "missing.so")


def test_make_layout_accepts_struct_and_mapping_only() -> None:
    fields = layout_of(G, 2)
    from_map = make_layout(fields)
    assert make_layout(from_map) is from_map
    assert from_map.as_dict() == fields
    with pytest.raises(InvalidArgument, match="missing"):
        make_layout({"kv_stride": 1})
    with pytest.raises(InvalidArgument, match=r"layout\.page_size"):
        make_layout({**fields, "page_size": 1 << 63})
    for other in (object(), byte_strides(G, 2)):  # fields as attributes: not a layout
        with pytest.raises(InvalidArgument, match="a KvioLayout or a mapping"):
            make_layout(other)
    assert ctypes.sizeof(KvioLayout) == 64


def test_binding_module_is_torch_free() -> None:
    import kvio_rocm._native as native

    from kvcore import native_abi

    for module in (native, native_abi):
        assert "import torch" not in Path(module.__file__).read_text()
