"""Building the kvio_rocm kernel library with hipcc (or ROCm's clang), cached per user.

The library is compiled for exactly the GPU's gfx target (``--offload-arch=gfx942``), links
the HIP runtime (libamdhip64) and is keyed in :mod:`kvcore.buildcache` by the hash of its
sources, the target, the ROCm version and the command line.

:func:`build_emulated` builds the same host source as a CPU library (``-DKVIO_EMULATE``, see
``csrc/kvio_emul.h``) with any clang, for tests on machines without an AMD GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcore.buildcache import files_digest, missing_executable, run_compiler
from kvcore.errors import BuildError
from kvcore.native_abi import ABI_HEADER, INCLUDE_DIR

__all__ = [
    "CSRC",
    "DEFAULT_ROCM_ROOT",
    "HOST_SOURCE",
    "LIBRARY_NAME",
    "RocmToolchain",
    "build_emulated",
    "build_library",
    "compile_command",
    "detect_gfx_arch",
    "emulated_compile_command",
    "find_emulation_compiler",
    "find_toolchain",
    "parse_gcn_arch",
    "parse_hip_version",
    "rocm_version",
    "search_locations",
    "source_digest",
]

#: the library's file name in the cache (the entry gets a hash before the suffix)
LIBRARY_NAME = "libkvio_rocm.so"
EMULATED_NAME = "libkvio_rocm_emul.so"

CSRC = Path(__file__).resolve().parent / "csrc"
HOST_SOURCE = CSRC / "kvio_rocm.hip"
#: sources of the real library (the broken_* codegen fixtures are not part of it)
_LIBRARY_SOURCES = ("kvio_index.h", "kvio_device.h", "kvio_rocm.hip")
_EMULATED_SOURCES = (*_LIBRARY_SOURCES, "kvio_emul.h")

_GFX_RE = re.compile(r"^gfx[0-9a-f]{3,4}$")

#: where ROCm lives when neither $ROCM_PATH nor PATH says otherwise
DEFAULT_ROCM_ROOT = Path("/opt/rocm")


@dataclass(frozen=True)
class RocmToolchain:
    """A HIP compiler and the ROCm installation it belongs to."""

    compiler: Path
    kind: str  # "hipcc" or "clang" (amdclang++ / ROCm's llvm/bin/clang++)
    rocm_root: Path | None
    version: str  # ROCm/HIP version, e.g. "6.4.43483" ("unknown" when it cannot be read)

    def __str__(self) -> str:
        return f"{self.kind} {self.compiler} (ROCm {self.version})"


def parse_gcn_arch(name: str) -> str:
    """The gfx target of a ``gcnArchName``: ``gfx942:sramecc+:xnack-`` gives ``gfx942``.

    Feature suffixes after ``:`` are dropped (the library is built for the default, feature-
    agnostic target). Raises BuildError for anything that is not ``gfx`` + 3-4 hex digits.
    """
    base = (name or "").strip().split(":", 1)[0].strip().lower()
    if not _GFX_RE.match(base):
        raise BuildError(f"cannot read a gfx target from gcnArchName {name!r} "
                         "(expected e.g. 'gfx942' or 'gfx942:sramecc+:xnack-')")
    return base


def detect_gfx_arch(device: int = 0) -> str:
    """The gfx target of visible GPU ``device`` from torch (``gcnArchName``).

    Raises BuildError when torch is not a ROCm build or sees no GPU.
    """
    import torch

    if getattr(torch.version, "hip", None) is None:
        raise BuildError(f"torch {torch.__version__} is not a ROCm build (torch.version.hip "
                         "is None); cannot detect the AMD GPU target")
    if not torch.cuda.is_available() or torch.cuda.device_count() <= device:
        raise BuildError(f"no AMD GPU {device} visible to torch "
                         f"(device_count={torch.cuda.device_count()})")
    return parse_gcn_arch(torch.cuda.get_device_properties(device).gcnArchName)


_HIP_VERSION_RE = {
    part: re.compile(rf"#define\s+HIP_VERSION_{part}\s+(\d+)")
    for part in ("MAJOR", "MINOR", "PATCH")
}


def parse_hip_version(header_text: str) -> str:
    """``major.minor.patch`` from the text of ``hip/hip_version.h``.

    Raises BuildError when HIP_VERSION_MAJOR or HIP_VERSION_MINOR is missing.
    """
    parts = {}
    for part, rx in _HIP_VERSION_RE.items():
        m = rx.search(header_text)
        parts[part] = m.group(1) if m else None
    if parts["MAJOR"] is None or parts["MINOR"] is None:
        raise BuildError("hip_version.h defines no HIP_VERSION_MAJOR/HIP_VERSION_MINOR")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH'] or 0}"


def rocm_version(rocm_root: Path | None) -> str:
    """The HIP version of a ROCm installation (its ``include/hip/hip_version.h``), else the
    ``.info/version`` file, else ``"unknown"``."""
    if rocm_root is None:
        return "unknown"
    header = rocm_root / "include" / "hip" / "hip_version.h"
    try:
        return parse_hip_version(header.read_text())
    except (OSError, BuildError):
        pass
    try:
        return (rocm_root / ".info" / "version").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _rocm_root_of(compiler: Path, env: Mapping[str, str]) -> Path | None:
    explicit = env.get("ROCM_PATH") or env.get("HIP_PATH")
    if explicit and (Path(explicit) / "include" / "hip").is_dir():
        return Path(explicit)
    for up in compiler.resolve().parents:
        if (up / "include" / "hip" / "hip_runtime.h").is_file():
            return up
    return None


def _candidates(env: Mapping[str, str]) -> list[tuple[str, str, Path | None]]:
    """(where, kind, path) in search order."""
    out: list[tuple[str, str, Path | None]] = []
    explicit = env.get("KVIO_ROCM_CXX")
    out.append(("$KVIO_ROCM_CXX", "clang" if explicit and "hipcc" not in explicit else "hipcc",
                Path(explicit) if explicit else None))
    for var in ("ROCM_PATH", "HIP_PATH"):
        root = env.get(var)
        out.append((f"${var}/bin", "hipcc", Path(root) / "bin" / "hipcc" if root else None))
    which = shutil.which("hipcc", path=env.get("PATH"))
    out.append(("PATH", "hipcc", Path(which) if which else None))
    default = DEFAULT_ROCM_ROOT
    out.append((f"{default}/bin", "hipcc", default / "bin" / "hipcc"))
    root = env.get("ROCM_PATH")
    if root:
        out.append(("$ROCM_PATH/llvm/bin", "clang", Path(root) / "llvm" / "bin" / "amdclang++"))
    which = shutil.which("amdclang++", path=env.get("PATH"))
    out.append(("PATH", "clang", Path(which) if which else None))
    out.append((f"{default}/llvm/bin", "clang", default / "llvm" / "bin" / "clang++"))
    return out


def search_locations(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Where :func:`find_toolchain` looks, in order, for messages (unset variables left out).
    """
    env = os.environ if env is None else env
    out: list[str] = []
    for where, _kind, path in _candidates(env):
        if where.startswith("$"):
            if path is not None:
                out.append(f"{where} ({path.parent})")
        elif where == "PATH":
            if "PATH" not in out:
                out.append("PATH")
        else:
            out.append(where)
    return tuple(out)


def find_toolchain(env: Mapping[str, str] | None = None) -> RocmToolchain:
    """Locate a HIP compiler: ``$KVIO_ROCM_CXX``, ``$ROCM_PATH/bin/hipcc``,
    ``$HIP_PATH/bin/hipcc``, hipcc on PATH, ``/opt/rocm/bin/hipcc``, then ROCm's clang
    (``$ROCM_PATH/llvm/bin/amdclang++``, amdclang++ on PATH, ``/opt/rocm/llvm/bin/clang++``).

    Raises BuildError naming every place it looked when there is none. A compiler without a
    ROCm installation next to it (HIP headers and libamdhip64) is refused too.
    """
    env = os.environ if env is None else env
    looked: list[str] = []
    for where, kind, path in _candidates(env):
        why = missing_executable(where, path)
        if why is not None or path is None:  # (a None path always has a why)
            looked.append(why or where)
            continue
        root = _rocm_root_of(path, env)
        if root is None:
            looked.append(f"{where} ({path}: no ROCm installation with include/hip next to "
                          "it; set ROCM_PATH)")
            continue
        return RocmToolchain(compiler=path, kind=kind, rocm_root=root,
                             version=rocm_version(root))
    raise BuildError("no HIP compiler found: kvio_rocm builds its kernels with ROCm's hipcc "
                     "or clang; looked in " + ", ".join(looked))


def compile_command(tc: RocmToolchain, source: Path | str, out: Path | str, arch: str,
                    extra: Sequence[str] = ()) -> list[str]:
    """The command line building ``source`` into the shared library ``out`` for ``arch``.

    -O3, C++17, position independent, hidden symbols except the C ABI, kvcore's ABI header
    on the include path, exactly one offload target, libamdhip64 (hipcc adds it itself; for
    clang it is named with an rpath to the ROCm installation) and libdl (dladdr/dlsym for
    hipMemcpyBatchAsync).
    """
    arch = parse_gcn_arch(arch)
    common = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden",
              f"-I{INCLUDE_DIR}", f"--offload-arch={arch}", *extra]
    if tc.kind == "hipcc":
        return [str(tc.compiler), *common, "-o", str(out), str(source), "-ldl"]
    cmd = [str(tc.compiler), "-x", "hip", *common]
    if tc.rocm_root is not None:
        cmd.append(f"--rocm-path={tc.rocm_root}")
    cmd += ["-o", str(out), str(source), "-x", "none"]
    if tc.rocm_root is not None:
        lib = tc.rocm_root / "lib"
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    cmd += ["-lamdhip64", "-ldl"]
    return cmd


def source_digest(names: Sequence[str] = _LIBRARY_SOURCES) -> str:
    """sha256 over the named files of ``csrc/`` and kvcore's ABI header (names and
    contents)."""
    return files_digest([CSRC / name for name in sorted(names)] + [ABI_HEADER])


def build_library(arch: str | None = None, cache_dir: Path | None = None,
                  toolchain: RocmToolchain | None = None) -> Path:
    """Path of the kernel library for ``arch`` (default: GPU 0's target), built on first use.

    The cache key is the sources' hash, the gfx target, the ROCm version and the command line.
    Raises BuildError when no ROCm compiler is found, the target cannot be detected, or the
    build fails.
    """
    tc = toolchain or find_toolchain()
    target = parse_gcn_arch(arch) if arch else detect_gfx_arch()
    key = {
        "sources": source_digest(),
        "arch": target,
        "rocm": tc.version,
        "compiler": str(tc.compiler),
        "command": " ".join(compile_command(tc, "SOURCE", "OUT", target)),
        "abi": "1",
    }

    def build(out: Path) -> None:
        print(f"kvio_rocm: building kernels for {target} with {tc} (first use, cached in "
              f"{out.parent})", file=sys.stderr, flush=True)
        run_compiler(compile_command(tc, HOST_SOURCE, out, target), "HIP compile")

    from kvcore.buildcache import build_cached

    return build_cached(LIBRARY_NAME, key, build, cache_dir)


def find_emulation_compiler(env: Mapping[str, str] | None = None) -> Path:
    """A host clang++ for the CPU emulation build (clang only: the kernels use clang's
    ext_vector_type): ``$KVIO_EMUL_CXX``, clang++, clang++-19 .. clang++-22 on PATH.

    Raises BuildError naming what it tried.
    """
    env = os.environ if env is None else env
    names = [env.get("KVIO_EMUL_CXX", ""), "clang++", *(f"clang++-{v}" for v in range(22, 17, -1))]
    for name in filter(None, names):
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return Path(found)
    raise BuildError("no host clang++ found for the kvio_rocm CPU emulation build; tried "
                     + ", ".join(filter(None, names)) + " (apt-get install clang-19)")


def emulated_compile_command(cxx: Path | str, out: Path | str) -> list[str]:
    """The command line of the CPU emulation library (same source, -DKVIO_EMULATE)."""
    return [str(cxx), "-x", "c++", "-std=c++17", "-O2", "-g", "-fPIC", "-shared",
            "-fvisibility=hidden", f"-I{INCLUDE_DIR}", "-DKVIO_EMULATE", "-Wall", "-Wextra",
            "-Wno-unknown-pragmas", "-o", str(out), str(HOST_SOURCE), "-ldl"]


def build_emulated(cache_dir: Path | None = None, cxx: Path | None = None) -> Path:
    """Path of the CPU emulation library (tests only), built on first use."""
    compiler = cxx or find_emulation_compiler()
    key = {
        "sources": source_digest(_EMULATED_SOURCES),
        "compiler": str(compiler),
        "command": " ".join(emulated_compile_command(compiler, "OUT")),
        "abi": "1",
    }

    def build(out: Path) -> None:
        run_compiler(emulated_compile_command(compiler, out), "emulation build")

    from kvcore.buildcache import build_cached

    return build_cached(EMULATED_NAME, key, build, cache_dir)
