"""Building the kvio_cuda kernel library with nvcc, cached per user (kvcore.buildcache).

The library is compiled for exactly the GPU's architecture (real SASS, no PTX to JIT), links
only against the shared CUDA runtime, and is keyed in the cache by the hash of its sources,
the architecture, the nvcc version and the flags.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcore.buildcache import build_cached, files_digest, missing_executable, run_compiler
from kvcore.errors import BuildError

__all__ = [
    "MIN_NVCC",
    "Nvcc",
    "arch_flags",
    "arch_name",
    "build_library",
    "compile_command",
    "find_nvcc",
    "parse_nvcc_version",
    "source_files",
    "toolkit_lib_dir",
]

#: oldest CUDA toolkit the kernels build with (cudaMemcpyBatchAsync needs 12.8 at run time)
MIN_NVCC = (12, 0)

#: the library's file name in the cache (the entry gets a hash before the suffix)
LIBRARY_NAME = "libkvio_cuda.so"

#: the last place nvcc is looked for (after PATH, $CUDA_HOME/bin and $CUDA_PATH/bin)
DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "kvio_cuda.cu"

#: oldest nvcc that knows each architecture (only the newer ones are listed)
_ARCH_MIN_NVCC = {
    "sm_90a": (12, 0),
    "sm_100a": (12, 8),
    "sm_101a": (12, 8),
    "sm_120a": (12, 8),
    "sm_103a": (12, 9),
    "sm_121a": (12, 9),
    "sm_110a": (13, 0),
}

_VERSION_RE = re.compile(r"release\s+(\d+)\.(\d+)(?:.*?V(\d+)\.(\d+)\.(\d+))?", re.S)


@dataclass(frozen=True)
class Nvcc:
    """An nvcc executable and its version."""

    path: Path
    version: tuple[int, int, int]

    @property
    def release(self) -> str:
        """``major.minor``, e.g. ``13.0``."""
        return f"{self.version[0]}.{self.version[1]}"

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.version))} ({self.path})"


def parse_nvcc_version(text: str) -> tuple[int, int, int]:
    """The (major, minor, patch) of ``nvcc --version`` output.

    ``Cuda compilation tools, release 13.0, V13.0.88`` gives (13, 0, 88); a missing ``V``
    part gives patch 0. Raises BuildError when there is no ``release X.Y``.
    """
    m = _VERSION_RE.search(text)
    if m is None:
        first = text.strip().splitlines()[-1] if text.strip() else "(no output)"
        raise BuildError(f"cannot read the CUDA version from nvcc --version: {first!r}")
    major, minor = int(m.group(1)), int(m.group(2))
    patch = int(m.group(5)) if m.group(5) is not None else 0
    return major, minor, patch


def _candidates() -> list[tuple[str, Path | None]]:
    out: list[tuple[str, Path | None]] = []
    on_path = shutil.which("nvcc")
    out.append(("PATH", Path(on_path) if on_path else None))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        out.append((f"${var}/bin", Path(home) / "bin" / "nvcc" if home else None))
    out.append((str(DEFAULT_NVCC.parent), DEFAULT_NVCC))
    return out


def find_nvcc() -> Nvcc:
    """Locate nvcc (PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin) and check its
    version.

    Raises BuildError naming where it looked when there is none, and saying what was found
    and what is needed when it is older than :data:`MIN_NVCC`.
    """
    looked: list[str] = []
    for where, path in _candidates():
        why = missing_executable(where, path)
        if why is not None:
            looked.append(why)
            continue
        try:
            proc = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                                  timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"cannot run {path} --version: {exc}") from exc
        version = parse_nvcc_version(proc.stdout + proc.stderr)
        if version[:2] < MIN_NVCC:
            raise BuildError(
                f"nvcc {version[0]}.{version[1]} found at {path} is too old: kvio_cuda needs "
                f"the CUDA toolkit {MIN_NVCC[0]}.{MIN_NVCC[1]} or newer (set CUDA_HOME or PATH "
                f"to a newer toolkit)")
        return Nvcc(path=path, version=version)
    raise BuildError("nvcc not found: kvio_cuda builds its kernels with the CUDA toolkit "
                     f"{MIN_NVCC[0]}.{MIN_NVCC[1]} or newer; looked in " + ", ".join(looked))


def arch_name(major: int, minor: int) -> str:
    """The real architecture the kernels are built for: ``sm_90a`` for 9.0, ``sm_100a`` for
    10.0, ``sm_86`` for 8.6 (the architecture-specific ``a`` variant from Hopper on)."""
    if (major, minor) < (7, 5) or minor < 0 or minor > 9:
        raise BuildError(f"compute capability {major}.{minor} is not supported by kvio_cuda "
                         "(needs 7.5 or newer)")
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def arch_flags(major: int, minor: int, nvcc_version: tuple[int, ...] | None = None) -> list[str]:
    """nvcc flags generating SASS for compute capability ``major.minor`` and no PTX.

    9.0 gives ``-gencode arch=compute_90a,code=sm_90a``. With ``nvcc_version``, an
    architecture that toolkit does not know raises BuildError saying which one does.
    """
    sm = arch_name(major, minor)
    needed = _ARCH_MIN_NVCC.get(sm)
    if nvcc_version is not None and needed is not None and tuple(nvcc_version[:2]) < needed:
        raise BuildError(f"{sm} needs nvcc {needed[0]}.{needed[1]} or newer, found nvcc "
                         f"{nvcc_version[0]}.{nvcc_version[1]}")
    compute = "compute_" + sm.removeprefix("sm_")
    return ["-gencode", f"arch={compute},code={sm}"]


def source_files() -> list[Path]:
    """The sources the library is built from (the .cu and any headers next to it)."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h"))


def _sources_digest() -> str:
    return files_digest(source_files())


def toolkit_lib_dir(nvcc: Path | str) -> Path | None:
    """The directory holding the toolkit's libcudart, as nvcc itself links against it
    (``nvcc --dryrun`` reports its -L directories; wrappers and symlinks are followed)."""
    try:
        proc = subprocess.run([str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull,
                               "-o", os.devnull], capture_output=True, text=True, timeout=60,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("#$ LIBRARIES="):
            for d in re.findall(r'-L"?([^"\s]+)"?', line):
                p = Path(d).resolve()
                if p.name != "stubs" and p.is_dir():
                    return p
    return None


#: the kernels' build-time tuning knobs and their ranges (see :func:`tuning_defines`)
TUNABLES = {"UNROLL": (1, 16), "BLOCKS_PER_SM": (1, 8), "DMA_BATCH": (0, 4096)}


def tuning_defines(spec: str | None = None) -> list[str]:
    """``-DKVIO_<NAME>=<value>`` flags from ``spec`` (default: the ``KVIO_CUDA_TUNE``
    environment variable), e.g. ``"UNROLL=8,BLOCKS_PER_SM=2"``; none when unset or empty.

    For experiments on a new GPU: each setting is its own cache entry (the flags are part
    of the key), and the defaults are what ships. Raises BuildError for an unknown name or
    a value out of range.
    """
    if spec is None:
        spec = os.environ.get("KVIO_CUDA_TUNE", "")
    flags = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        name = name.strip().upper()
        bounds = TUNABLES.get(name)
        try:
            number = int(value)
        except ValueError:
            number = None
        if bounds is None or number is None or not bounds[0] <= number <= bounds[1]:
            allowed = ", ".join(f"{n}=[{lo}, {hi}]" for n, (lo, hi) in TUNABLES.items())
            raise BuildError(f"KVIO_CUDA_TUNE: expected comma-separated NAME=INT with {allowed}; "
                             f"got {item!r}")
        flags.append(f"-DKVIO_{name}={number}")
    return flags


def compile_command(nvcc: Path | str, source: Path | str, out: Path | str, major: int,
                    minor: int, nvcc_version: tuple[int, ...] | None = None,
                    rpath: Path | str | None = None, verbose_ptxas: bool = True,
                    defines: Sequence[str] = ()) -> list[str]:
    """The nvcc command line building ``source`` into the shared library ``out``.

    -O3, C++17, position independent, hidden symbols except the ABI, line info for
    profilers, ``-Xptxas -v`` (register and spill report on stderr), the shared cudart
    (plus libdl for resolving cudaMemcpyBatchAsync at run time) and, with ``rpath``, a
    run path to the toolkit's libraries, used only when the process has not loaded a
    libcudart of the same major version already (torch's, normally). ``defines``: extra
    ``-D`` flags (:func:`tuning_defines`).
    """
    cmd = [str(nvcc), "-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC",
           "-Xcompiler", "-fvisibility=hidden", "-lineinfo", "-cudart", "shared",
           *arch_flags(major, minor, nvcc_version), *defines]
    if verbose_ptxas:
        cmd += ["-Xptxas", "-v"]
    cmd += ["-o", str(out), str(source), "-ldl"]
    if rpath is not None:
        cmd += ["-Xlinker", f"-rpath,{rpath}"]
    return cmd


def build_library(major: int, minor: int, cache_dir: Path | None = None) -> Path:
    """Path of the kernel library for compute capability ``major.minor``, built on first use.

    The cache key is the sources' hash, the architecture, the nvcc version and the flags; a
    one-line note goes to stderr while a build runs. The ptxas report (registers, spills) of
    the last build for an architecture is kept in the cache as ``libkvio_cuda-<sm>.ptxas.txt``.
    Raises BuildError when nvcc is missing, too old or
    fails.
    """
    nvcc = find_nvcc()
    sm = arch_name(major, minor)
    rpath = toolkit_lib_dir(nvcc.path)
    defines = tuning_defines()
    key = {
        "sources": _sources_digest(),
        "arch": sm,
        "nvcc": ".".join(map(str, nvcc.version)),
        "command": " ".join(compile_command(nvcc.path, "SOURCE", "OUT", major, minor,
                                            nvcc.version, rpath, defines=defines)),
        "abi": "1",
    }

    def build(out: Path) -> None:
        tuned = f", tuned {' '.join(defines)}" if defines else ""
        print(f"kvio_cuda: building kernels for {sm} with nvcc {nvcc.release}{tuned} "
              f"(first use, cached in {out.parent})", file=sys.stderr, flush=True)
        log = run_compiler(compile_command(nvcc.path, SOURCE, out, major, minor, nvcc.version,
                                           rpath, defines=defines), "nvcc")
        # The report is informative only; it is rewritten by every build.
        report = out.parent / f"{Path(LIBRARY_NAME).stem}-{sm}.ptxas.txt"
        try:
            report.write_text(log)
        except OSError:
            pass

    return build_cached(LIBRARY_NAME, key, build, cache_dir)
