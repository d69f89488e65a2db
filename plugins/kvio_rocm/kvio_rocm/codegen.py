"""Compile kvio_rocm's device code to AMDGPU assembly and check what the compiler emitted.

Works without ROCm: ``csrc/kvio_device.h`` needs no ROCm header, so any clang with the AMDGPU
backend compiles it as HIP device code (``-x hip --cuda-device-only -nogpulib -nogpuinc``).
Debian's clang-19 knows gfx942 (MI300); gfx950 (MI355) needs clang >= 20, e.g. the clang
inside the ``ziglang`` wheel (``zig clang``).

:func:`check_assembly` splits the assembly per kernel (from the kernel's label to its
``.Lfunc_endN``, plus the kernel's ``.amdgpu_metadata`` entry and ``; ScratchSize`` comment)
and reports, for every copy kernel (``kvio_copy_v{16,8,1}_*``; fixtures may use other prefixes):

* payload stores: every ``global_store_*`` must be ONE access of the kernel's vector width
  (``dwordx4`` for v16, ``dwordx2`` for v8, ``byte`` or ``byte_d16_hi`` for v1) carrying
  ``nt``. A narrower store (e.g. four ``global_store_dword ... nt``, the "four-scalar" form)
  or a store without ``nt`` is a violation. The kernels store nothing but payload, except
  the ABI v2 bounds report.
* report stores: the only other stores allowed are those of the out-of-range report
  (kvio_report, 64-bit fields in pinned host memory): ``global_store_dwordx2`` with
  system scope (``sc0 sc1``) and without ``nt``, at most :data:`MAX_REPORT_STORES` of them
  (one value and one epoch per side). They sit on the slow path of a lane that saw a bad
  index, not between the payload loads and stores of the hot path.
* payload loads: the kernels' only non-temporal loads are payload loads, so every load with
  ``nt`` must be of the vector width (``global_load_dword ... nt`` in a v16 kernel is the
  payload split into scalars), every ``global_load_dwordx4`` in a v16 kernel must carry
  ``nt``, and the payload load and store counts must match.
* other loads: ordinary cached ``global_load_dword`` / ``global_load_dwordx2`` are the reads of
  the index arrays and of the layer-pointer table and are allowed; byte and short loads are
  not (in v16/v8 kernels), nor is any other width.
* address spaces: no ``flat_*`` (the global address space was lost), no ``scratch_*`` /
  ``buffer_*`` memory instructions.
* loads in flight: at least ``min_in_flight`` (the kernels' unroll, 4) payload loads issued
  with no ``s_waitcnt vmcnt`` between them.
* no spills: ``; ScratchSize: 0``, ``.amdhsa_private_segment_fixed_size 0``, and in the
  metadata ``.private_segment_fixed_size: 0``, ``.sgpr_spill_count: 0``,
  ``.vgpr_spill_count: 0``; and ``.wavefront_size`` equal to the target's (64 on gfx9).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcore.errors import BuildError

__all__ = [
    "DEVICE_SOURCE",
    "BROKEN_SOURCE",
    "COPY_KERNELS",
    "Compiler",
    "KernelAsm",
    "Violation",
    "check_assembly",
    "check_kernel",
    "compile_to_asm",
    "compile_command",
    "find_compiler",
    "find_compilers",
    "parse_kernels",
    "payload_instructions",
    "supported_gfx_targets",
]

CSRC = Path(__file__).resolve().parent / "csrc"
DEVICE_SOURCE = CSRC / "kvio_device.h"
BROKEN_SOURCE = CSRC / "broken_scalar.hip"

#: the copy kernels of kvio_device.h and their payload width in bytes
COPY_KERNELS: dict[str, int] = {
    f"kvio_copy_v{vec}_{order}": vec
    for vec in (16, 8, 1)
    for order in ("token_inner", "layer_inner")
}

#: payload loads each lane issues before its stores (KVIO_UNROLL in kvio_device.h)
UNROLL = 4

#: stores of the ABI v2 report in one kernel: value and epoch for the host and device side
MAX_REPORT_STORES = 4

#: wavefront size of each gfx family the kernels are checked for
_WAVE64_PREFIXES = ("gfx9",)


@dataclass(frozen=True)
class Compiler:
    """A clang driver able to emit AMDGPU code: its argv prefix, a label and its gfx targets."""

    argv: tuple[str, ...]
    label: str
    targets: frozenset[str]

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class Violation:
    """One thing wrong in one kernel's assembly."""

    kernel: str
    rule: str  # short identifier: "store-width", "store-nt", "nt-load-width", ...
    detail: str  # the offending instruction or value

    def __str__(self) -> str:
        return f"{self.kernel}: [{self.rule}] {self.detail}"


@dataclass
class KernelAsm:
    """The assembly of one kernel: its instructions and its resource facts."""

    name: str
    instructions: list[str] = field(default_factory=list)
    scratch_size: int | None = None  # "; ScratchSize: N"
    amdhsa_private_segment: int | None = None  # ".amdhsa_private_segment_fixed_size N"
    metadata: dict[str, str] = field(default_factory=dict)  # the .amdgpu_metadata entry


# ---------------------------------------------------------------------------- compilers


def supported_gfx_targets(argv: Sequence[str], timeout: float = 60.0) -> frozenset[str]:
    """The gfx targets a clang driver (``argv``) knows, from ``--print-supported-cpus``.

    Empty when it cannot be run or has no AMDGPU backend. Never raises.
    """
    cmd = [*argv, "--target=amdgcn-amd-amdhsa", "-nogpulib", "--print-supported-cpus"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    text = proc.stdout + proc.stderr
    return frozenset(re.findall(r"^\s*(gfx[0-9a-f]+)\s*$", text, re.M))


def _zig_binary() -> Path | None:
    try:
        spec = importlib.util.find_spec("ziglang")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    exe = Path(spec.origin).parent / ("zig.exe" if os.name == "nt" else "zig")
    return exe if exe.is_file() else None


def _candidate_argvs(env: Mapping[str, str]) -> list[tuple[tuple[str, ...], str]]:
    out: list[tuple[tuple[str, ...], str]] = []
    explicit = env.get("KVIO_CODEGEN_CLANG")
    if explicit:
        out.append(((explicit,), f"$KVIO_CODEGEN_CLANG ({explicit})"))
    path = env.get("PATH")
    for name in ("clang-19", "clang-20", "clang-21", "clang-22", "clang"):
        found = shutil.which(name, path=path)
        if found:
            out.append(((found,), f"{name} ({found})"))
    for rocm in filter(None, (env.get("ROCM_PATH"), "/opt/rocm")):
        clang = Path(rocm) / "llvm" / "bin" / "clang"
        if clang.is_file():
            out.append(((str(clang),), f"ROCm clang ({clang})"))
    zig = _zig_binary()
    if zig is not None:
        out.append(((str(zig), "clang"), f"ziglang clang ({zig} clang)"))
    return out


def find_compilers(env: Mapping[str, str] | None = None) -> list[Compiler]:
    """Every clang found that emits AMDGPU code, in preference order: ``$KVIO_CODEGEN_CLANG``,
    clang-19..22 and clang on PATH, ROCm's llvm/bin/clang, the ziglang wheel's ``zig clang``.
    """
    env = os.environ if env is None else env
    found: list[Compiler] = []
    seen: set[str] = set()
    for argv, label in _candidate_argvs(env):
        key = os.path.realpath(argv[0]) + " ".join(argv[1:])
        if key in seen:
            continue
        seen.add(key)
        targets = supported_gfx_targets(argv)
        if targets:
            found.append(Compiler(argv=argv, label=label, targets=targets))
    return found


def find_compiler(target: str, env: Mapping[str, str] | None = None,
                  prefer: str | None = None) -> Compiler | None:
    """The first compiler of :func:`find_compilers` that targets ``target`` (e.g. clang-19
    for gfx942, the ziglang clang for gfx950), or None. ``prefer`` picks the first whose label
    contains that text, if any does ("zig", "clang-19")."""
    compilers = [c for c in find_compilers(env) if target in c.targets]
    if prefer:
        preferred = [c for c in compilers if prefer in c.label]
        if preferred:
            return preferred[0]
    return compilers[0] if compilers else None


def compile_command(compiler: Compiler | Sequence[str], source: Path | str, target: str,
                    out: Path | str, extra: Sequence[str] = ()) -> list[str]:
    """The clang command emitting ``target`` assembly for the HIP device code in ``source``.

    No ROCm needed: ``-nogpuinc`` (no HIP headers), ``-nogpulib`` (no device libraries).
    """
    argv = compiler.argv if isinstance(compiler, Compiler) else tuple(compiler)
    return [*argv, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc",
            f"--offload-arch={target}", "-O3", "-std=c++17", "-S", *extra, "-o", str(out),
            str(source)]


def compile_to_asm(source: Path | str, target: str, compiler: Compiler | Sequence[str],
                   extra: Sequence[str] = ()) -> str:
    """Compile ``source`` for ``target`` and return the assembly text. Raises BuildError."""
    with tempfile.TemporaryDirectory(prefix="kvio_rocm_codegen_") as tmp:
        out = Path(tmp) / "device.s"
        cmd = compile_command(compiler, source, target, out, extra)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"cannot run {cmd[0]}: {exc}") from exc
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
            raise BuildError(f"device compile failed (exit {proc.returncode}):\n  "
                             f"{' '.join(cmd)}\n{tail}")
        return out.read_text()


# ---------------------------------------------------------------------------- parsing

_LABEL_RE = re.compile(r"^([A-Za-z_.$][\w.$]*):")
_FUNC_END_RE = re.compile(r"^\.Lfunc_end\d+:")
_MEM_RE = re.compile(r"^(global|flat|scratch|buffer)_(load|store)_(\w+)\b(.*)$")
_FLAG_RE = re.compile(r"\b(nt|sc0|sc1|glc|slc|dlc|nv|lds)\b")

#: bytes moved by each memory opcode suffix (the _d16 forms move 2 bytes)
_WIDTH = {
    "dwordx4": 16, "b128": 16, "dwordx3": 12, "b96": 12, "dwordx2": 8, "b64": 8,
    "dword": 4, "b32": 4, "short": 2, "ushort": 2, "sshort": 2, "b16": 2,
    "byte": 1, "ubyte": 1, "sbyte": 1, "u8": 1, "i8": 1, "u16": 2, "i16": 2,
}
_VEC_SUFFIX = {16: "dwordx4", 8: "dwordx2", 1: "byte"}
#: every payload store form of a width (byte_d16_hi: the byte in bits 16..23 of a register)
_VEC_STORE_SUFFIX = {16: ("dwordx4",), 8: ("dwordx2",), 1: ("byte", "byte_d16_hi")}
_VEC_LOAD_SUFFIX = {16: ("dwordx4",), 8: ("dwordx2",), 1: ("ubyte", "sbyte")}


def _width(suffix: str) -> int | None:
    if suffix in _WIDTH:
        return _WIDTH[suffix]
    base = suffix.split("_d16")[0]
    if "_d16" in suffix:
        return 1 if base in ("ubyte", "sbyte", "byte") else 2
    return _WIDTH.get(base)


def _strip(line: str) -> str:
    return line.split(";", 1)[0].strip()


def parse_kernels(asm: str, names: Iterable[str] | None = None) -> dict[str, KernelAsm]:
    """Split assembly into kernels: instructions between ``name:`` and ``.Lfunc_endN:``
    (the ``.amdhsa_kernel`` descriptor block is read for its private segment size, not kept
    as instructions), the ``; ScratchSize`` comment that follows, and the kernel's entry of
    the ``.amdgpu_metadata`` YAML (as flat ``.key: value`` strings).

    Only kernels with an ``.amdhsa_kernel`` descriptor are returned; ``names`` restricts
    them further.
    """
    lines = asm.splitlines()
    kernel_names = set(re.findall(r"^\s*\.amdhsa_kernel\s+(\S+)", asm, re.M))
    if names is not None:
        kernel_names &= set(names)
    out: dict[str, KernelAsm] = {}
    current: KernelAsm | None = None
    in_descriptor = False
    after_end: KernelAsm | None = None
    for raw in lines:
        line = raw.strip()
        label = _LABEL_RE.match(raw)
        if current is None:
            if label and label.group(1) in kernel_names:
                current = out.setdefault(label.group(1), KernelAsm(label.group(1)))
                after_end = None
                continue
            if after_end is not None:
                m = re.match(r";\s*ScratchSize:\s*(\S+)", line)
                if m and after_end.scratch_size is None:
                    after_end.scratch_size = _int_or_none(m.group(1))
                if label and not line.startswith(".L"):
                    after_end = None
            continue
        if _FUNC_END_RE.match(raw):
            after_end, current, in_descriptor = current, None, False
            continue
        if line.startswith(".amdhsa_kernel"):
            in_descriptor = True
            continue
        if line.startswith(".end_amdhsa_kernel"):
            in_descriptor = False
            continue
        if in_descriptor:
            m = re.match(r"\.amdhsa_private_segment_fixed_size\s+(\S+)", line)
            if m:
                current.amdhsa_private_segment = _int_or_none(m.group(1))
            continue
        text = _strip(raw)
        if text and not text.startswith(".") and not _LABEL_RE.match(text):
            current.instructions.append(text)
    for entry in _metadata_entries(asm):
        name = entry.get(".name")
        if name in out:
            out[name].metadata = entry
    return out


def _int_or_none(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _metadata_entries(asm: str) -> list[dict[str, str]]:
    m = re.search(r"^\s*\.amdgpu_metadata\s*$(.*?)^\s*\.end_amdgpu_metadata", asm, re.M | re.S)
    if not m:
        return []
    body = m.group(1)
    k = re.search(r"^(\s*)amdhsa\.kernels:\s*$", body, re.M)
    if not k:
        return []
    entries: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    item_indent: int | None = None
    for line in body[k.end():].splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break  # the next top-level key (amdhsa.target, amdhsa.version)
        stripped = line.strip()
        if stripped.startswith("- "):
            if item_indent is None:
                item_indent = indent
            if indent != item_indent:
                continue  # an item of a nested list (.args)
            current = {}
            entries.append(current)
            stripped, indent = stripped[2:], indent + 2
        # only the kernel's own keys (two columns right of its dash), not its args' keys
        if current is None or item_indent is None or indent != item_indent + 2:
            continue
        kv = re.match(r"^(\.\w+):\s*(.*)$", stripped)
        if kv:
            current[kv.group(1)] = kv.group(2).strip().strip("'\"")
    return entries


# ---------------------------------------------------------------------------- checking


@dataclass(frozen=True)
class _Mem:
    space: str  # global, flat, scratch, buffer
    op: str  # load, store
    suffix: str
    width: int | None
    flags: frozenset[str]
    text: str


def _mem(instr: str) -> _Mem | None:
    m = _MEM_RE.match(instr)
    if not m:
        return None
    space, op, suffix, rest = m.groups()
    return _Mem(space, op, suffix, _width(suffix), frozenset(_FLAG_RE.findall(rest)), instr)


def payload_instructions(kernel: KernelAsm) -> list[str]:
    """The non-temporal memory instructions of a kernel (its payload accesses), in order."""
    out = []
    for instr in kernel.instructions:
        m = _mem(instr)
        if m is not None and "nt" in m.flags:
            out.append(instr)
    return out


def _expected_wave(target: str | None) -> int | None:
    if target is None:
        return None
    return 64 if target.startswith(_WAVE64_PREFIXES) else None


def check_kernel(kernel: KernelAsm, vec: int, target: str | None = None,
                 min_in_flight: int = UNROLL) -> list[Violation]:
    """The violations of one copy kernel whose payload vector is ``vec`` bytes (16, 8, 1)."""
    v: list[Violation] = []
    name = kernel.name

    def bad(rule: str, detail: str) -> None:
        v.append(Violation(name, rule, detail))

    want = _VEC_SUFFIX[vec]
    want_stores = _VEC_STORE_SUFFIX[vec]
    want_loads = _VEC_LOAD_SUFFIX[vec]
    payload_loads = payload_stores = report_stores = 0
    in_flight = best_in_flight = 0
    for instr in kernel.instructions:
        if instr.startswith("s_waitcnt") and "vmcnt" in instr:
            in_flight = 0
            continue
        m = _mem(instr)
        if m is None:
            continue
        if m.space in ("flat", "scratch", "buffer"):
            rule = "flat-access" if m.space == "flat" else "scratch-access"
            bad(rule, instr)
            continue
        nt = "nt" in m.flags
        if m.op == "store":
            if not nt and m.suffix == "dwordx2" and {"sc0", "sc1"} <= m.flags:
                report_stores += 1  # the bounds report: a system-scope 64-bit field
                continue
            if m.suffix not in want_stores:
                bad("store-width", f"{instr}  (payload stores must be one {want})")
            elif not nt:
                bad("store-nt", f"{instr}  (missing nt)")
            else:
                payload_stores += 1
            continue
        # loads
        if nt:
            if m.suffix not in want_loads:
                bad("nt-load-width", f"{instr}  (payload loads must be one {want_loads[0]})")
            else:
                payload_loads += 1
                in_flight += 1
                best_in_flight = max(best_in_flight, in_flight)
            continue
        if vec == 16 and m.suffix == "dwordx4":
            bad("load-nt", f"{instr}  (16-byte load without nt)")
        elif m.width is not None and m.width < 4 and vec != 1:
            bad("narrow-load", f"{instr}  (byte/short load in the {vec}-byte path)")
        elif m.suffix not in ("dword", "dwordx2"):
            bad("unexpected-load", f"{instr}  (only dword/dwordx2 index and table loads)")
    if report_stores > MAX_REPORT_STORES:
        bad("report-stores", f"{report_stores} system-scope report stores (at most "
                             f"{MAX_REPORT_STORES}: one value and one epoch per side)")
    if payload_stores == 0 and not any(x.rule.startswith("store") for x in v):
        bad("no-payload", f"no {want} ... nt store found")
    if payload_loads != payload_stores and payload_loads and payload_stores:
        bad("payload-count", f"{payload_loads} payload loads vs {payload_stores} stores")
    if payload_loads and best_in_flight < min_in_flight:
        bad("in-flight", f"at most {best_in_flight} payload loads issued before an "
                         f"s_waitcnt vmcnt (want {min_in_flight})")

    def require_zero(rule: str, value: int | str | None, what: str) -> None:
        if value is None:
            bad(rule, f"{what} not found in the assembly")
        elif str(value) != "0":
            bad(rule, f"{what} is {value}")

    require_zero("scratch", kernel.scratch_size, "; ScratchSize")
    require_zero("scratch", kernel.amdhsa_private_segment, ".amdhsa_private_segment_fixed_size")
    md = kernel.metadata
    require_zero("scratch", md.get(".private_segment_fixed_size"), ".private_segment_fixed_size")
    require_zero("spill", md.get(".sgpr_spill_count"), ".sgpr_spill_count")
    require_zero("spill", md.get(".vgpr_spill_count"), ".vgpr_spill_count")
    wave = _expected_wave(target)
    if wave is not None and md.get(".wavefront_size") != str(wave):
        bad("wavefront", f".wavefront_size is {md.get('.wavefront_size')}, want {wave}")
    return v


def _vec_of(name: str) -> int | None:
    if name in COPY_KERNELS:
        return COPY_KERNELS[name]
    m = re.search(r"_v(16|8|1)(?:_|$)", name)
    return int(m.group(1)) if m else None


def check_assembly(asm: str, target: str | None = None,
                   kernels: Mapping[str, int] | Iterable[str] | None = None,
                   min_in_flight: int = UNROLL) -> list[Violation]:
    """Violations of every copy kernel in ``asm`` (see the module docstring).

    ``kernels`` names the kernels to check (a mapping gives their vector widths; names alone
    take the width from ``_v16_``/``_v8_``/``_v1_`` in the name). Default: the six
    ``kvio_copy_*`` kernels, each of which must be present. ``target`` (e.g. ``gfx942``)
    enables the wavefront-size check.
    """
    if kernels is None:
        wanted: dict[str, int] = dict(COPY_KERNELS)
    elif isinstance(kernels, Mapping):
        wanted = dict(kernels)
    else:
        wanted = {}
        for k in kernels:
            vec = _vec_of(k)
            if vec is None:
                raise ValueError(f"cannot tell the vector width of kernel {k!r}")
            wanted[k] = vec
    parsed = parse_kernels(asm, wanted)
    out: list[Violation] = []
    for name, vec in wanted.items():
        if name not in parsed:
            out.append(Violation(name, "missing", "kernel not found in the assembly"))
            continue
        out += check_kernel(parsed[name], vec, target, min_in_flight)
    return out
