"""The kvio_cuda kernels compile to what their performance depends on (no GPU needed).

Built for sm_90a (H200) exactly as the library is shipped, the SASS of every 16-byte copy
kernel must move data with 128-bit global loads and stores carrying the cache hints of
csrc/kvio_cuda.cu, and ptxas must report no spills:

=====================================  ===============================  ====================
PTX in the source                      SASS                             used for
=====================================  ===============================  ====================
ld.global.nc.L1::no_allocate.v4.u32    LDG.E.NA.128.CONSTANT            every source read
st.global.cs.v4.u32                    STG.E.EF.128                     host-side stores
st.global.v4.u32                       STG.E.128                        device-side stores
=====================================  ===============================  ====================

Every copy kernel also starts with ``griddepcontrol.wait`` (SASS ``ACQBULK``) before its first
memory access: the kernels are launched with programmatic dependent launch on Hopper, and
that wait is what keeps stream order intact.

A deliberately broken kernel (scalar byte copy) and an unhinted 128-bit copy are run
through the same checker to prove it rejects them.

With ``KVIO_CUDA_WHEEL`` naming a built kvio-cuda wheel (scripts/build_wheels.sh; .ci/run sets
it), every check of the shipped library also runs on the sm_90a code of each library inside
the wheel, and the wheel's libraries must hold SASS for every architecture of
``build.PREBUILT_SASS`` and PTX of ``build.PREBUILT_PTX`` (cuobjdump --list-elf/--list-ptx),
match the sha256 of their manifest, and keep the hinted 128-bit copies without spills on every
architecture.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvio_cuda import build

from kvcore.errors import BuildError

ARCH = (9, 0)  # H200

_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\b[^;]*;",
                    re.M)


# --------------------------------------------------------------------------- the checker


def split_functions(sass: str) -> dict[str, str]:
    """``cuobjdump --dump-sass`` output split into {function name: its SASS}."""
    parts = re.split(r"^\s*Function\s*:\s*(\S+)\s*$", sass, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def opcodes(function_sass: str) -> list[str]:
    """The opcodes (with modifiers, e.g. ``LDG.E.NA.128.CONSTANT``) of one function."""
    return _INSTR.findall(function_sass)


def check_vector_copy(function_sass: str, *, host_side_stores: bool) -> list[str]:
    """Problems that keep a copy kernel from moving 16-byte vectors with the streaming hints
    (empty when it is fine).

    Required: 128-bit global loads, all of them without L1 allocation (``.NA``), and 128-bit
    global stores, all of them evict-first (``.EF``) when ``host_side_stores`` (device ->
    host), all of them plain otherwise; no local-memory traffic (spills).
    """
    ops = opcodes(function_sass)
    problems: list[str] = []
    loads128 = [o for o in ops if o.startswith("LDG.") and ".128" in o]
    stores128 = [o for o in ops if o.startswith("STG.") and ".128" in o]
    if not loads128:
        problems.append("no 128-bit global loads (LDG.E...128)")
    elif bad := sorted({o for o in loads128 if ".NA." not in o + "."}):
        problems.append(f"128-bit loads without the no-allocate hint (.NA): {bad}")
    if not stores128:
        problems.append("no 128-bit global stores (STG.E...128)")
    elif host_side_stores:
        if bad := sorted({o for o in stores128 if ".EF." not in o + "."}):
            problems.append(f"128-bit host-side stores without the streaming hint (.EF): {bad}")
    elif bad := sorted({o for o in stores128 if ".EF." in o + "."}):
        problems.append(f"device-side stores are evict-first (.EF): {bad}")
    if local := sorted({o for o in ops if o.startswith(("LDL", "STL"))}):
        problems.append(f"local memory traffic (spills): {local}")
    return problems


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """{function: {registers, stack, spill_stores, spill_loads}} from ``-Xptxas -v``."""
    out: dict[str, dict[str, int]] = {}
    for m in re.finditer(
            r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill "
            r"stores, (\d+) bytes spill loads(?:.*?\n)*?.*?Used (\d+) registers", log):
        out[m.group(1)] = {"stack": int(m.group(2)), "spill_stores": int(m.group(3)),
                           "spill_loads": int(m.group(4)), "registers": int(m.group(5))}
    return out


# --------------------------------------------------------------------------- fixtures


def find_cuobjdump(nvcc: Path) -> Path | None:
    """cuobjdump from PATH, next to nvcc, or from the triton wheel."""
    on_path = shutil.which("cuobjdump")
    if on_path:
        return Path(on_path)
    for d in {nvcc.parent, nvcc.resolve().parent}:
        if (d / "cuobjdump").is_file():
            return d / "cuobjdump"
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        cand = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if cand.is_file():
            return cand
    return None


@pytest.fixture(scope="module")
def tools() -> tuple[build.Nvcc, Path]:
    try:
        nvcc = build.find_nvcc()
    except BuildError as exc:
        pytest.skip(f"SASS checks need nvcc: {exc}")
    cuobjdump = find_cuobjdump(nvcc.path)
    if cuobjdump is None:
        pytest.skip("SASS checks need cuobjdump (CUDA toolkit, or `pip install triton`, whose "
                    "wheel ships it under triton/backends/nvidia/bin)")
    return nvcc, cuobjdump


def _compile(nvcc: build.Nvcc, source: Path, out: Path, defines: tuple[str, ...] = ()) -> str:
    cmd = build.compile_command(nvcc.path, source, out, *ARCH, nvcc.version, defines=defines)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _dump(cuobjdump: Path, binary: Path) -> dict[str, str]:
    proc = subprocess.run([str(cuobjdump), "--dump-sass", str(binary)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return split_functions(proc.stdout)


def _dump_arch(cuobjdump: Path, binary: Path, arch: str) -> dict[str, str]:
    """SASS by function of the ``arch`` cubin in a library holding several."""
    proc = subprocess.run([str(cuobjdump), "--dump-sass", "-arch", arch, str(binary)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return split_functions(proc.stdout)


def ptxas_for_arch(log: str, arch: str) -> str:
    """The part of a ``-Xptxas -v`` report of several architectures about ``arch``."""
    parts = re.split(r"^(ptxas info\s*: Compiling entry function '\S+' for '(\S+)')\n", log,
                     flags=re.M)
    return "".join(parts[i] + "\n" + parts[i + 2] for i in range(1, len(parts) - 2, 3)
                   if parts[i + 1] == arch)


#: a built kvio-cuda wheel whose libraries the checks also run on
WHEEL_ENV = "KVIO_CUDA_WHEEL"
_LIB_IN_WHEEL = re.compile(r"kvio_cuda/prebuilt/(libkvio_cuda-cu\d+\.so)")


def _wheel_libraries() -> list[str]:
    """The library names inside $KVIO_CUDA_WHEEL (at collection: they parametrize tests)."""
    wheel = os.environ.get(WHEEL_ENV)
    if not wheel or not Path(wheel).is_file():
        return ["(no wheel)"]
    with zipfile.ZipFile(wheel) as zf:
        return sorted(m.group(1) for n in zf.namelist() if (m := _LIB_IN_WHEEL.fullmatch(n)))


@pytest.fixture(scope="module")
def wheel_prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kvio_cuda/prebuilt/`` extracted from $KVIO_CUDA_WHEEL (skipped when it is unset)."""
    wheel = os.environ.get(WHEEL_ENV)
    if not wheel:
        pytest.skip(f"{WHEEL_ENV} is unset: no built wheel to check (scripts/build_wheels.sh)")
    assert Path(wheel).is_file(), f"{WHEEL_ENV}={wheel}: no such file"
    out = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(out, [n for n in zf.namelist() if n.startswith("kvio_cuda/")])
    return out / "kvio_cuda" / "prebuilt"


def _manifest(prebuilt: Path) -> dict[str, dict]:
    data = json.loads((prebuilt / build.MANIFEST_NAME).read_text())
    return {e["file"]: e for e in data["libraries"]}


@pytest.fixture(scope="module", params=["fresh build", *_wheel_libraries()])
def shipped(request: pytest.FixtureRequest, tools: tuple[build.Nvcc, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], str]]:
    """(SASS by function, ptxas log) for sm_90a of the library built from csrc/kvio_cuda.cu,
    and of each library inside $KVIO_CUDA_WHEEL."""
    nvcc, cuobjdump = tools
    if request.param == "fresh build":
        out = tmp_path_factory.mktemp("sass") / "libkvio_cuda.so"
        log = _compile(nvcc, build.SOURCE, out)
        yield _dump(cuobjdump, out), log
        return
    prebuilt = request.getfixturevalue("wheel_prebuilt")
    library = prebuilt / request.param
    sm = build.arch_name(*ARCH)
    assert sm in _manifest(prebuilt)[request.param]["sass"], f"{request.param} has no {sm}"
    log = (prebuilt / f"{library.stem}.ptxas.txt").read_text()
    yield _dump_arch(cuobjdump, library, sm), ptxas_for_arch(log, sm)


#: the chained per-layer load's kernels: host reads issued before the dependency wait
EARLY_KERNELS = ["kvio_copy_h2d_v16_i32_early", "kvio_copy_h2d_v16_i64_early"]
#: the direct copies with the host indices in the launch's arguments (kvio_transfer_direct_inline)
COPY_INLINE_KERNELS = [f"kvio_copy_inline_{d}_v{v}_i32" for d in ("d2h", "h2d")
                       for v in (16, 8, 4, 2, 1)]
COPY_KERNELS = [f"kvio_copy_{d}_v{v}_{i}" for d in ("d2h", "h2d") for v in (16, 8, 4, 2, 1)
                for i in ("i32", "i64")] + EARLY_KERNELS + COPY_INLINE_KERNELS
#: the signaled per-layer load (every layer in one grid, a ready flag per layer)
SIGNALED_KERNELS = [f"kvio_signaled_h2d_v{v}_{i}" for v in (16, 8, 4, 2, 1) for i in ("i32", "i64")]
#: the same with the host indices in the launch's arguments (kvio_load_layers_signaled_inline)
SIGNALED_INLINE_KERNELS = [f"kvio_signaled_inline_h2d_v{v}_i32" for v in (16, 8, 4, 2, 1)]
SIGNALED_KERNELS += SIGNALED_INLINE_KERNELS
INLINE_KERNELS = COPY_INLINE_KERNELS + SIGNALED_INLINE_KERNELS
#: every kernel of the library
ALL_KERNELS = COPY_KERNELS + SIGNALED_KERNELS + ["kvio_set_flags"]


# --------------------------------------------------------------------------- the tests


def test_all_copy_kernels_present(shipped: tuple[dict[str, str], str]) -> None:
    sass, _ = shipped
    assert sorted(k for k in sass if k.startswith("kvio_copy_")) == sorted(COPY_KERNELS)


@pytest.mark.parametrize("kernel", [k for k in COPY_KERNELS if "_v16_" in k])
def test_16_byte_kernels_use_hinted_128_bit_accesses(shipped: tuple[dict[str, str], str],
                                                      kernel: str) -> None:
    sass, _ = shipped
    problems = check_vector_copy(sass[kernel], host_side_stores="_d2h_" in kernel)
    assert problems == [], f"{kernel}: {problems}"
    ops = opcodes(sass[kernel])
    assert "LDG.E.NA.128.CONSTANT" in ops
    assert ("STG.E.EF.128" if "_d2h_" in kernel else "STG.E.128") in ops


@pytest.mark.parametrize("kernel", [k for k in COPY_KERNELS if "_v8_" in k])
def test_8_byte_kernels_use_hinted_64_bit_accesses(shipped: tuple[dict[str, str], str],
                                                    kernel: str) -> None:
    ops = opcodes(shipped[0][kernel])
    assert "LDG.E.NA.64.CONSTANT" in ops
    assert ("STG.E.EF.64" if "_d2h_" in kernel else "STG.E.64") in ops


@pytest.mark.parametrize("kernel", COPY_KERNELS)
def test_every_kernel_streams_its_host_side(shipped: tuple[dict[str, str], str],
                                            kernel: str) -> None:
    ops = opcodes(shipped[0][kernel])
    assert any(o.startswith("LDG.E.NA") for o in ops), "no no-allocate loads"
    if "_d2h_" in kernel:
        assert any(o.startswith("STG.E.EF") for o in ops), "no evict-first host stores"
    assert not [o for o in ops if o.startswith(("LDL", "STL"))]


@pytest.mark.parametrize("kernel", [k for k in COPY_KERNELS if k not in EARLY_KERNELS])
def test_dependent_launch_waits_before_any_memory_access(shipped: tuple[dict[str, str], str],
                                                         kernel: str) -> None:
    ops = opcodes(shipped[0][kernel])
    assert "ACQBULK" in ops, "griddepcontrol.wait is missing"
    first_memory = next(i for i, o in enumerate(ops) if o.startswith(("LDG", "STG", "LD.", "ST.")))
    assert ops.index("ACQBULK") < first_memory
    assert ops.index("ACQBULK") < ops.index("PREEXIT"), "dependents released before the wait"


@pytest.mark.parametrize("kernel", EARLY_KERNELS)
def test_early_kernels_read_before_the_wait_but_store_and_release_only_after_it(
        shipped: tuple[dict[str, str], str], kernel: str) -> None:
    ops = opcodes(shipped[0][kernel])
    wait = ops.index("ACQBULK")
    assert any(o.startswith("LDG.E.NA.128") for o in ops[:wait]), "no host read before the wait"
    assert not any(o.startswith(("STG", "ST.")) for o in ops[:wait]), "a store before the wait"
    # griddepcontrol.launch_dependents (PREEXIT) never comes before a wait: a kernel behind
    # this one may read early only once everything before this one has completed
    waits = [i for i, o in enumerate(ops) if o == "ACQBULK"]
    releases = [i for i, o in enumerate(ops) if o == "PREEXIT"]
    assert releases and all(any(w < r for w in waits) for r in releases)
    assert "STG.E.128" in ops


def test_ptxas_reports_no_spills(shipped: tuple[dict[str, str], str]) -> None:
    _, log = shipped
    report = parse_ptxas(log)
    assert sorted(report) == sorted(ALL_KERNELS), log
    for name, r in report.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["stack"] == 0, (name, r)
        # __launch_bounds__(256, 4): 4 blocks of 256 threads per SM fit in 64K registers; the
        # kernels with a 64-bit flat index are bounded for 2 blocks (with the v2 bounds checks
        # they spill in 64 on sm_80; the signaled ones everywhere)
        wide = "_i64" in name
        assert r["registers"] <= (128 if wide else 64), (name, r)


@pytest.mark.parametrize("kernel", [k for k in SIGNALED_KERNELS if "_v16_" in k])
def test_signaled_kernels_copy_with_hinted_128_bit_accesses_and_publish_each_group(
        shipped: tuple[dict[str, str], str], kernel: str) -> None:
    ops = opcodes(shipped[0][kernel])
    assert check_vector_copy(shipped[0][kernel], host_side_stores=False) == [], kernel
    # every thread fences its stores before its warp's count (fence.acq_rel.gpu), one lane
    # counts (atomic add), the warp whose count completes a group stores its layers' flags with
    # system-scope release (a MEMBAR.ALL.SYS, then a strong system store); no block barrier
    # holds the warps back
    assert not [o for o in ops if o.startswith("BAR.SYNC")]
    count = next(i for i, o in enumerate(ops) if o.startswith("ATOMG.E.ADD"))
    assert any(o == "MEMBAR.ALL.GPU" for o in ops[:count]), "no fence before the count"
    flag = next(i for i, o in enumerate(ops) if o.startswith("STG.E.STRONG.SYS"))
    assert count < flag and "MEMBAR.ALL.SYS" in ops[count:flag], "the flag is not a release"


@pytest.mark.parametrize("kernel", COPY_KERNELS + SIGNALED_KERNELS)
def test_out_of_range_indices_are_reported_with_plain_system_stores_after_the_payload(
        shipped: tuple[dict[str, str], str], kernel: str) -> None:
    """ABI v2: a thread that skipped a vector for an out-of-range index stores the value and
    the epoch into the kvio_report (pinned host memory) with st.relaxed.sys (SASS
    ``STG.E.64.STRONG.SYS``): no atomic on host memory, and only after the thread's payload
    stores (so the early kernels still store nothing before their dependency wait)."""
    ops = opcodes(shipped[0][kernel])
    report = [i for i, o in enumerate(ops) if o == "STG.E.64.STRONG.SYS"]
    assert len(report) == 4, "value and epoch for the host and the device side"
    assert not [o for o in ops if o.startswith(("RED.", "ATOM.")) or (".SYS" in o and "ATOM" in o)]
    if "_v16_" in kernel:  # after the 128-bit stores of the tile (the byte loops of
        # misaligned vectors are laid out elsewhere, so only the wide stores show the order)
        payload = [i for i, o in enumerate(ops) if o.startswith("STG.") and ".128" in o]
        assert payload and max(payload) < min(report)
    if kernel in EARLY_KERNELS:
        assert ops.index("ACQBULK") < min(report)
    if kernel in SIGNALED_KERNELS:  # the report comes before the warp's count and flag
        assert max(report) < next(i for i, o in enumerate(ops) if o.startswith("ATOMG.E.ADD"))


def test_a_tuned_build_keeps_the_hinted_128_bit_copies(tools: tuple[build.Nvcc, Path],
                                                       tmp_path: Path) -> None:
    """KVIO_CUDA_TUNE's knobs (more vectors in flight, fewer blocks) change the schedule,
    not the instructions: the 16-B kernels stay 128-bit, hinted and spill-free."""
    nvcc, cuobjdump = tools
    defines = tuple(build.tuning_defines("UNROLL=8,BLOCKS_PER_SM=2"))
    log = _compile(nvcc, build.SOURCE, tmp_path / "libtuned.so", defines)
    sass = _dump(cuobjdump, tmp_path / "libtuned.so")
    for kernel in (k for k in COPY_KERNELS if "_v16_" in k):
        assert check_vector_copy(sass[kernel], host_side_stores="_d2h_" in kernel) == []
    for name, r in parse_ptxas(log).items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)


BROKEN_SCALAR = r"""
extern "C" __global__ void kvio_copy_d2h_v16_broken(const char* __restrict__ src,
                                                    char* __restrict__ dst, unsigned long n) {
    for (unsigned long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
"""

BROKEN_UNHINTED = r"""
extern "C" __global__ void kvio_copy_d2h_v16_unhinted(const uint4* src, uint4* dst,
                                                      unsigned long n) {
    for (unsigned long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
"""


@pytest.mark.parametrize(
    ("source", "kernel", "expected"),
    [(BROKEN_SCALAR, "kvio_copy_d2h_v16_broken", "no 128-bit global loads"),
     (BROKEN_UNHINTED, "kvio_copy_d2h_v16_unhinted", "without the no-allocate hint")],
)
def test_checker_rejects_broken_kernels(tools: tuple[build.Nvcc, Path], tmp_path: Path,
                                        source: str, kernel: str, expected: str) -> None:
    nvcc, cuobjdump = tools
    cu = tmp_path / "broken.cu"
    cu.write_text(source)
    _compile(nvcc, cu, tmp_path / "libbroken.so")
    sass = _dump(cuobjdump, tmp_path / "libbroken.so")
    problems = check_vector_copy(sass[kernel], host_side_stores=True)
    assert problems, f"the checker accepted {kernel}"
    assert any(expected in p for p in problems), problems
    if kernel.endswith("unhinted"):
        assert any("streaming hint (.EF)" in p for p in problems), problems


# --------------------------------------------------------------- the wheel's libraries


def _listed(cuobjdump: Path, flag: str, library: Path) -> list[str]:
    """``sm_90a`` and the like from ``cuobjdump --list-elf`` / ``--list-ptx`` (each once)."""
    proc = subprocess.run([str(cuobjdump), flag, str(library)], capture_output=True, text=True,
                          check=True)
    return sorted(set(re.findall(r"\.(sm_\w+)\.(?:cubin|ptx)\s*$", proc.stdout, re.M)),
                  key=lambda a: (len(a), a))


def test_the_wheel_is_for_any_python_on_linux_x86_64(wheel_prebuilt: Path) -> None:
    name = Path(os.environ[WHEEL_ENV]).name
    assert name.endswith("-py3-none-linux_x86_64.whl"), name
    assert _manifest(wheel_prebuilt), "the wheel holds no prebuilt library"


def test_wheel_libraries_match_their_manifest(wheel_prebuilt: Path) -> None:
    sources = wheel_prebuilt.parent / "csrc"
    data = json.loads((wheel_prebuilt / build.MANIFEST_NAME).read_text())
    from kvcore.buildcache import files_digest

    assert data["sources"] == files_digest(sorted(
        p for p in sources.iterdir() if p.suffix in (".cu", ".cuh", ".h")))
    for name, entry in _manifest(wheel_prebuilt).items():
        lib = wheel_prebuilt / name
        assert hashlib.sha256(lib.read_bytes()).hexdigest() == entry["sha256"], name
        assert name == f"libkvio_cuda-cu{entry['cuda_major']}.so"
        # the plugin picks it for an sm_90 GPU under its CUDA major, unless csrc/ changed since
        choice = build.choose_library(9, 0, f"{entry['cuda_major']}.0", wheel_prebuilt)
        if data["sources"] == files_digest(build.source_files()):
            assert choice.prebuilt is not None and choice.prebuilt.path == lib, choice.reason
            assert choice.code == "sm_90a SASS"
        else:
            assert "other sources" in choice.reason


def test_wheel_libraries_hold_every_architecture(wheel_prebuilt: Path,
                                                 tools: tuple[build.Nvcc, Path]) -> None:
    _, cuobjdump = tools
    for name, entry in _manifest(wheel_prebuilt).items():
        lib = wheel_prebuilt / name
        assert entry["sass"] + entry["skipped"] + entry["ptx"] != []
        assert _listed(cuobjdump, "--list-elf", lib) == entry["sass"], name
        assert _listed(cuobjdump, "--list-ptx", lib) == [
            a.replace("compute_", "sm_") for a in entry["ptx"]], name
        if entry["cuda_major"] >= 13:  # nvcc 13 knows every architecture asked for
            assert entry["sass"] == list(build.PREBUILT_SASS), name
            assert entry["ptx"] == list(build.PREBUILT_PTX), name


def test_wheel_libraries_keep_hinted_copies_without_spills_on_every_architecture(
        wheel_prebuilt: Path, tools: tuple[build.Nvcc, Path]) -> None:
    _, cuobjdump = tools
    for name, entry in _manifest(wheel_prebuilt).items():
        lib = wheel_prebuilt / name
        log = (wheel_prebuilt / f"{lib.stem}.ptxas.txt").read_text()
        for arch in entry["sass"]:
            sass = _dump_arch(cuobjdump, lib, arch)
            assert sorted(sass) == sorted(ALL_KERNELS), (name, arch)
            for kernel in (k for k in COPY_KERNELS + SIGNALED_KERNELS if "_v16_" in k):
                problems = check_vector_copy(sass[kernel], host_side_stores="_d2h_" in kernel)
                assert problems == [], (name, arch, kernel, problems)
            if build._arch_number(arch) >= 90:  # programmatic dependent launch from Hopper on
                for kernel in COPY_KERNELS:
                    assert "ACQBULK" in opcodes(sass[kernel]), (name, arch, kernel)
            report = parse_ptxas(ptxas_for_arch(log, arch))
            assert sorted(report) == sorted(ALL_KERNELS), (name, arch)
            for fn, r in report.items():
                assert r["spill_stores"] == r["spill_loads"] == r["stack"] == 0, (arch, fn, r)


#: a 32-bit load from the kernel's parameter bank at an address computed per thread (the
#: 64-bit ones also pick a K or V layer table)
INDEXED_PARAMETER_LOAD = re.compile(r"\bLDC R\d+, c\[0x0\]\[R\d+")


@pytest.mark.parametrize("kernel", INLINE_KERNELS)
def test_inline_kernels_read_host_indices_from_their_arguments_without_a_local_copy(
        shipped: tuple[dict[str, str], str], kernel: str) -> None:
    """The host indices are a __grid_constant__ argument: each thread reads its token's index
    from the parameter bank (an indexed LDC), never from a per-thread copy in local memory;
    the kernel without them never reads the bank at a computed address."""
    sass = shipped[0]
    assert INDEXED_PARAMETER_LOAD.search(sass[kernel]), kernel
    assert not [o for o in opcodes(sass[kernel]) if o.startswith(("LDL", "STL"))]
    plain = kernel.replace("_inline", "")  # (its 32-bit flat index twin)
    assert not INDEXED_PARAMETER_LOAD.search(sass[plain]), plain
