"""What the compiler makes of kvio_rocm's kernels, checked in the AMDGPU assembly.

No ROCm and no AMD GPU needed: the device code (csrc/kvio_device.h) compiles with plain clang.
gfx942 (MI300) with Debian's clang-19 and with the ziglang wheel's clang (clang 22); gfx950
(MI355) with the ziglang clang (clang-19 does not know gfx950). Install:

    apt-get install -y clang-19 lld-19
    pip install ziglang

A missing compiler skips its cases with the install command, unless KVIO_REQUIRE_CODEGEN is
set (CI sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest
from kvio_rocm import codegen
from kvio_rocm.codegen import Compiler, KernelAsm, check_assembly, check_kernel, parse_kernels

from kvcore.native_abi import INCLUDE_DIR

INSTALL = {"clang-19": "apt-get install -y clang-19 lld-19", "zig": "pip install ziglang"}
CASES = [("gfx942", "clang-19"), ("gfx942", "zig"), ("gfx950", "zig")]
CASE_IDS = [f"{t}-{c}" for t, c in CASES]
FAKE_HIP = Path(__file__).resolve().parent / "fake_hip"


def _missing(why: str) -> None:
    if os.environ.get("KVIO_REQUIRE_CODEGEN"):
        pytest.fail(why)
    pytest.skip(why)


@functools.cache
def _compilers() -> tuple[Compiler, ...]:
    return tuple(codegen.find_compilers())


def compiler_for(target: str, which: str) -> Compiler:
    for c in _compilers():
        if target in c.targets and which in c.label:
            return c
    _missing(f"no {which} clang that targets {target} (install: {INSTALL[which]})")
    raise AssertionError("unreachable")


@functools.cache
def _asm(source: str, target: str, which: str) -> str:
    return codegen.compile_to_asm(source, target, compiler_for(target, which))


def device_asm(target: str, which: str) -> str:
    return _asm(str(codegen.DEVICE_SOURCE), target, which)


def broken_asm(target: str, which: str) -> str:
    return _asm(str(codegen.BROKEN_SOURCE), target, which)


def payload(asm: str, name: str) -> list[str]:
    return codegen.payload_instructions(parse_kernels(asm, [name])[name])


@pytest.mark.parametrize("target,which", CASES, ids=CASE_IDS)
def test_copy_kernels_have_no_violations(target: str, which: str) -> None:
    violations = check_assembly(device_asm(target, which), target)
    assert violations == [], "\n".join(map(str, violations))


X4 = r"v\[\d+:\d+\], v\[\d+:\d+\], off nt$"  # vdata/vaddr pair, no offset, nt


@pytest.mark.parametrize("target,which", CASES, ids=CASE_IDS)
def test_expected_instructions(target: str, which: str) -> None:
    asm = device_asm(target, which)
    patterns = {
        16: (r"global_load_dwordx4 " + X4, r"global_store_dwordx4 " + X4),
        8: (r"global_load_dwordx2 " + X4, r"global_store_dwordx2 " + X4),
        1: (r"global_load_ubyte v\d+, v\[\d+:\d+\], off nt$",
            r"global_store_byte(?:_d16_hi)? v\[\d+:\d+\], v\d+, off nt$"),
    }
    report_re = (r"global_store_dwordx2 v\d+, v\[\d+:\d+\], s\[\d+:\d+\]"
                 r"( offset:(8|16|24))? sc0 sc1$")
    kernels = parse_kernels(asm, codegen.COPY_KERNELS)
    assert set(kernels) == set(codegen.COPY_KERNELS)
    for name, vec in codegen.COPY_KERNELS.items():
        load_re, store_re = patterns[vec]
        nt = payload(asm, name)
        loads = [i for i in nt if re.match(load_re, i)]
        stores = [i for i in nt if re.match(store_re, i)]
        # every payload access is one of these; UNROLL of each per loop iteration on the hot
        # path, and again on the path of a lane that saw an out-of-range index (ABI v2: its
        # accesses are predicated per item, so the hot path has no compare between them)
        assert len(loads) + len(stores) == len(nt), nt
        assert len(loads) == len(stores) == 2 * codegen.UNROLL, (name, nt)
        # the hot path comes first: all its loads issued before its first store
        u = codegen.UNROLL
        assert nt[:u] == loads[:u] and nt[u:2 * u] == stores[:u], (name, nt)
        # the bounds report: value and epoch per side, system-scope 64-bit stores, not nt
        report = [i for i in kernels[name].instructions
                  if i.startswith("global_store") and i not in nt]
        assert len(report) == 4 and all(re.match(report_re, i) for i in report), report
        md = kernels[name].metadata
        assert md[".wavefront_size"] == "64", name  # wave64 on gfx9
        assert md[".max_flat_workgroup_size"] == "256", name
        assert kernels[name].scratch_size == 0


def test_device_code_includes_no_rocm_header() -> None:
    text = codegen.DEVICE_SOURCE.read_text() + (codegen.CSRC / "kvio_index.h").read_text()
    assert not re.search(r"#\s*include\s*<hip/", text)
    assert "__builtin_nontemporal_load" in text and "ext_vector_type(4)" in text


EXPECTED_BROKEN = {
    "kvio_broken_v16_scalar_store": {"store-width"},
    "kvio_broken_v16_scalar_load": {"nt-load-width"},
    "kvio_broken_v16_plain": {"load-nt", "store-nt"},
    "kvio_broken_v16_scratch": {"scratch", "scratch-access"},
}


@pytest.mark.parametrize("target,which", CASES, ids=CASE_IDS)
def test_broken_variants_are_caught(target: str, which: str) -> None:
    asm = broken_asm(target, which)
    for name, rules in EXPECTED_BROKEN.items():
        found = check_assembly(asm, target, kernels=[name])
        assert found, f"{name}: the checker found nothing"
        got = {v.rule for v in found}
        assert rules <= got, (name, got)
    # the four-scalar form: each 16-B store became four 4-byte nt stores (on the hot path and
    # on the path of a lane with an out-of-range index)
    four = [v.detail for v in check_assembly(asm, target, kernels=["kvio_broken_v16_scalar_store"])]
    assert len(four) == 2 * 4 * codegen.UNROLL
    assert all(d.startswith("global_store_dword ") and " nt" in d for d in four)
    # the real kernels, compiled in the same file, still pass
    assert check_assembly(asm, target) == []


def test_host_side_compiles_in_hip_mode(tmp_path: Path) -> None:
    """kvio_rocm.hip (host + device passes, real HIP mode) against a stand-in
    <hip/hip_runtime.h> with ROCm 7.1's declarations: catches host-side compile errors and
    checks the hipMemcpyBatchAsync signature static_assert."""
    c = compiler_for("gfx942", "clang-19")
    out = tmp_path / "kvio_rocm.o"
    cmd = [*c.argv, "-x", "hip", "--offload-arch=gfx942", "-nogpuinc", "-nogpulib",
           f"-I{FAKE_HIP}", f"-I{INCLUDE_DIR}", "-std=c++17", "-O3", "-fPIC",
           "-fvisibility=hidden", "-Wall", "-Wextra", "-c", str(codegen.CSRC / "kvio_rocm.hip"),
           "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    assert out.stat().st_size > 0


# ---------------------------------------------------------------------------- the checker itself


def kernel(lines: list[str], **meta: str) -> KernelAsm:
    md = {".private_segment_fixed_size": "0", ".sgpr_spill_count": "0",
          ".vgpr_spill_count": "0", ".wavefront_size": "64", **meta}
    return KernelAsm("k_v16_test", [ln.strip() for ln in lines], scratch_size=0,
                     amdhsa_private_segment=0, metadata=md)


GOOD_BODY = [
    "global_load_dword v1, v[2:3], off",  # an index load: allowed
    "global_load_dwordx2 v[4:5], v[4:5], off",  # the layer table: allowed
    *[f"global_load_dwordx4 v[{8 + 4 * k}:{11 + 4 * k}], v[2:3], off nt" for k in range(4)],
    "s_waitcnt vmcnt(0)",
    *[f"global_store_dwordx4 v[2:3], v[{8 + 4 * k}:{11 + 4 * k}], off nt" for k in range(4)],
]


def rules(k: KernelAsm, vec: int = 16, target: str | None = "gfx942") -> set[str]:
    return {v.rule for v in check_kernel(k, vec, target)}


def test_checker_accepts_the_good_form() -> None:
    assert check_kernel(kernel(GOOD_BODY), 16, "gfx942") == []


@pytest.mark.parametrize("swap,rule", [
    ("global_store_dwordx4 v[2:3], v[8:11], off", "store-nt"),
    ("global_store_dwordx2 v[2:3], v[8:9], off nt", "store-width"),
    ("global_load_dword v8, v[2:3], off nt", "nt-load-width"),
    ("global_load_dwordx4 v[8:11], v[2:3], off", "load-nt"),
    ("global_load_ubyte v8, v[2:3], off", "narrow-load"),
    ("flat_load_dwordx4 v[8:11], v[2:3] nt", "flat-access"),
    ("scratch_store_dword off, v1, s33", "scratch-access"),
    ("buffer_load_dword v1, off, s[0:3], 0", "scratch-access"),
])
def test_checker_flags(swap: str, rule: str) -> None:
    body = list(GOOD_BODY)
    body.insert(3, swap)
    assert rule in rules(kernel(body))


REPORT_STORES = [f"global_store_dwordx2 v1, v[2:3], s[4:5] offset:{o} sc0 sc1"
                 for o in (8, 0, 24, 16)]


def test_checker_accepts_the_bounds_report_stores_and_no_more() -> None:
    assert check_kernel(kernel([*GOOD_BODY, *REPORT_STORES]), 16, "gfx942") == []
    too_many = [*GOOD_BODY, *REPORT_STORES, REPORT_STORES[0]]
    assert rules(kernel(too_many)) == {"report-stores"}
    # a 64-bit store without system scope, or with nt, is not a report store
    unscoped = "global_store_dwordx2 v1, v[2:3], s[4:5]"
    assert "store-nt" in rules(kernel([*GOOD_BODY, unscoped]), 8)
    narrow = "global_store_dword v1, v2, s[4:5] sc0 sc1"
    assert "store-width" in rules(kernel([*GOOD_BODY, narrow]))


def test_checker_counts_loads_in_flight() -> None:
    body = ["global_load_dwordx4 v[8:11], v[2:3], off nt", "s_waitcnt vmcnt(0)",
            "global_store_dwordx4 v[2:3], v[8:11], off nt"] * 4
    found = check_kernel(kernel(body), 16, "gfx942")
    assert [v.rule for v in found] == ["in-flight"]
    assert "at most 1 payload loads" in found[0].detail


@pytest.mark.parametrize("field,value,rule", [
    (".sgpr_spill_count", "3", "spill"),
    (".vgpr_spill_count", "1", "spill"),
    (".private_segment_fixed_size", "16", "scratch"),
    (".wavefront_size", "32", "wavefront"),
])
def test_checker_reads_the_metadata(field: str, value: str, rule: str) -> None:
    assert rule in rules(kernel(GOOD_BODY, **{field: value}))


def test_checker_wants_the_metadata() -> None:
    k = kernel(GOOD_BODY)
    k.scratch_size = None
    k.metadata = {}
    found = check_kernel(k, 16, "gfx942")
    assert {v.rule for v in found} == {"scratch", "spill", "wavefront"}
    assert any("; ScratchSize not found" in v.detail for v in found)


def test_checker_reports_missing_kernels() -> None:
    found = check_assembly("\t.text\n", "gfx942")
    assert {v.kernel for v in found} == set(codegen.COPY_KERNELS)
    assert {v.rule for v in found} == {"missing"}


def test_parse_kernels_on_a_minimal_listing() -> None:
    asm = """
\t.amdgcn_target "amdgcn-amd-amdhsa--gfx942"
\t.globl k_v16_test
k_v16_test:                 ; @k_v16_test
; %bb.0:
\tglobal_load_dwordx4 v[0:3], v[4:5], off nt
.LBB0_1:
\tglobal_store_dwordx4 v[4:5], v[0:3], off nt   ; a comment
\ts_endpgm
\t.section .rodata,"a",@progbits
\t.amdhsa_kernel k_v16_test
\t\t.amdhsa_private_segment_fixed_size 0
\t.end_amdhsa_kernel
.Lfunc_end0:
\t.size k_v16_test, .Lfunc_end0-k_v16_test
; Kernel info:
; ScratchSize: 0
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .args:
      - .offset:         0
        .size:           8
        .value_kind:     by_value
    .name:           k_v16_test
    .private_segment_fixed_size: 0
    .sgpr_spill_count: 0
    .vgpr_spill_count: 0
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa--gfx942
\t.end_amdgpu_metadata
"""
    k = parse_kernels(asm)["k_v16_test"]
    assert k.instructions == ["global_load_dwordx4 v[0:3], v[4:5], off nt",
                              "global_store_dwordx4 v[4:5], v[0:3], off nt", "s_endpgm"]
    assert (k.scratch_size, k.amdhsa_private_segment) == (0, 0)
    assert k.metadata[".name"] == "k_v16_test" and ".offset" not in k.metadata
    assert check_assembly(asm, "gfx942", kernels=["k_v16_test"], min_in_flight=1) == []
