"""The kvio_cuda kernel library: prebuilt in the wheel, or built with nvcc on first use.

A wheel built by ``scripts/build_wheels.sh`` carries one library per CUDA major version in
``kvio_cuda/prebuilt/`` (SASS for :data:`PREBUILT_SASS` plus PTX of :data:`PREBUILT_PTX`),
listed with their sha256 in ``prebuilt/manifest.json``; :func:`choose_library` picks the one
for the CUDA major of torch's runtime when it holds code for the GPU. Otherwise (an editable
or source install, a GPU the wheel has no code for, ``KVIO_CUDA_TUNE``) the library is
compiled for exactly the GPU's architecture (real SASS, no PTX to JIT), links only against the
shared CUDA runtime, and is cached per user (kvcore.buildcache), keyed by the hash of its
sources, the architecture, the nvcc version and the flags.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcore.buildcache import (
    build_cached,
    cache_root,
    entry_path,
    files_digest,
    missing_executable,
    run_compiler,
    verify_entry,
)
from kvcore.errors import BuildError
from kvcore.native_abi import ABI_HEADER, INCLUDE_DIR

__all__ = [
    "MIN_NVCC",
    "Nvcc",
    "arch_flags",
    "arch_name",
    "build_library",
    "build_prebuilt",
    "choose_library",
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

#: the last place nvcc is looked for (after PATH, $CUDA_HOME/bin, $CUDA_PATH/bin and the
#: registry's nvidia-cuda-nvcc package in this environment)
DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")

#: where the registry's nvcc packages put nvcc under site-packages: ``nvidia-cuda-nvcc`` (CUDA
#: 13 and later, ``nvidia/cu13``) and ``nvidia-cuda-nvcc-cu12`` (``nvidia/cuda_nvcc``; its
#: wheels hold ptxas but no nvcc so far, looked at all the same)
REGISTRY_NVCC = ("nvidia/cu13/bin/nvcc", "nvidia/cu12/bin/nvcc", "nvidia/cuda_nvcc/bin/nvcc")

#: the prebuilt libraries of a wheel (absent in a source tree and an editable install)
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
MANIFEST_NAME = "manifest.json"

#: SASS in every prebuilt library: Ampere (A100; A10/A40/RTX 30), Ada (L4/L40/RTX 40), Hopper
#: (H100/H200), Blackwell (B200/GB200; RTX 50/RTX PRO 6000)...
PREBUILT_SASS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a")
#: ...and PTX of the oldest, which the driver compiles for any newer GPU (B300, Thor, ...)
PREBUILT_PTX = ("compute_80",)

#: ``0`` ignores the prebuilt libraries (always build on first use)
PREBUILT_ENV = "KVIO_CUDA_PREBUILT"

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


def _site_dirs() -> list[Path]:
    """This environment's site-packages directories (where pip puts nvidia-cuda-nvcc)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # pragma: no cover - some embedded interpreters
        pass
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    out: list[Path] = []
    for d in map(Path, dirs):
        if d not in out:
            out.append(d)
    return out


def registry_nvcc() -> Path | None:
    """nvcc of the registry package ``nvidia-cuda-nvcc`` (``-cu12``) in this environment."""
    for d in _site_dirs():
        for rel in REGISTRY_NVCC:
            if (d / rel).is_file():
                return d / rel
    return None


def _candidates() -> list[tuple[str, Path | None]]:
    out: list[tuple[str, Path | None]] = []
    on_path = shutil.which("nvcc")
    out.append(("PATH", Path(on_path) if on_path else None))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        out.append((f"${var}/bin", Path(home) / "bin" / "nvcc" if home else None))
    out.append(("the nvidia-cuda-nvcc package", registry_nvcc()))
    out.append((str(DEFAULT_NVCC.parent), DEFAULT_NVCC))
    return out


def nvcc_at(path: Path | str) -> Nvcc:
    """The nvcc at ``path`` and its version (BuildError when it cannot be run or read)."""
    try:
        proc = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"cannot run {path} --version: {exc}") from exc
    return Nvcc(path=Path(path), version=parse_nvcc_version(proc.stdout + proc.stderr))


def find_nvcc() -> Nvcc:
    """Locate nvcc (PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, the registry's nvidia-cuda-nvcc
    package in this environment, /usr/local/cuda/bin) and check its version.

    Raises BuildError naming where it looked when there is none, and saying what was found
    and what is needed when it is older than :data:`MIN_NVCC`.
    """
    looked: list[str] = []
    for where, path in _candidates():
        why = missing_executable(where, path)
        if why is not None or path is None:  # (a None path always has a why)
            looked.append(why or where)
            continue
        version = nvcc_at(path).version
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
    """The plugin's own sources of the library (the .cu and any headers next to it): what a
    prebuilt library's manifest records. kvcore's ABI header is left out there, so that a
    kvcore release touching only the header's comments does not make every prebuilt library
    stale; a change of the ABI itself changes ABI_VERSION, which loading checks."""
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
    registry = _registry_cudart(nvcc)
    return registry.parent if registry is not None else None


def _registry_cudart(nvcc: Path | str) -> Path | None:
    """The versioned libcudart (``lib/libcudart.so.13``) next to an nvcc of the registry's
    nvidia-cuda-nvcc package, whose profile looks in ``lib64`` and which has no unversioned
    ``libcudart.so`` to link with; None for a toolkit laid out as NVIDIA installs it."""
    top = Path(nvcc).resolve().parent.parent
    if (top / "lib64").exists() or (top / "lib" / "libcudart.so").exists():
        return None
    found = sorted((top / "lib").glob("libcudart.so.[0-9]*")) if (top / "lib").is_dir() else []
    return found[0] if found else None


#: the kernels' build-time tuning knobs and their ranges (see :func:`tuning_defines`)
TUNABLES = {"UNROLL": (1, 16), "BLOCKS_PER_SM": (1, 8), "DMA_BATCH": (0, 4096),
            "PIPELINE_CHUNKS": (2, 64)}


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
                    defines: Sequence[str] = (),
                    gencode: Sequence[str] | None = None) -> list[str]:
    """The nvcc command line building ``source`` into the shared library ``out``.

    -O3, C++17, position independent, hidden symbols except the ABI, line info for
    profilers, ``-Xptxas -v`` (register and spill report on stderr), the shared cudart
    (plus libdl for resolving cudaMemcpyBatchAsync at run time) and, with ``rpath``, a
    run path to the toolkit's libraries, used only when the process has not loaded a
    libcudart of the same major version already (torch's, normally). ``defines``: extra
    ``-D`` flags (:func:`tuning_defines`). ``gencode``: the architecture flags of a library
    for several GPUs (:func:`prebuilt_gencode`), instead of those of ``major.minor``.
    An nvcc of the registry's nvidia-cuda-nvcc package links its versioned libcudart by name.
    """
    arch = list(gencode) if gencode is not None else arch_flags(major, minor, nvcc_version)
    cudart = _registry_cudart(nvcc) if Path(str(nvcc)).is_absolute() else None
    link = ["-cudart", "shared"] if cudart is None else ["-cudart", "none"]
    cmd = [str(nvcc), "-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC",
           "-Xcompiler", "-fvisibility=hidden", "-lineinfo", *link, *arch, *defines]
    if verbose_ptxas:
        cmd += ["-Xptxas", "-v"]
    cmd += [f"-I{INCLUDE_DIR}", "-o", str(out), str(source), "-ldl"]
    if cudart is not None:
        cmd += [f"-L{cudart.parent}", "-Xlinker", f"-l:{cudart.name}"]
    if rpath is not None:
        cmd += ["-Xlinker", f"-rpath,{rpath}"]
    return cmd


def _cache_key(nvcc: Nvcc, major: int, minor: int, rpath: Path | None,
               defines: Sequence[str]) -> dict[str, str]:
    return {
        "sources": _sources_digest(),
        "abi_header": files_digest([ABI_HEADER]),  # a library built here follows the header
        "arch": arch_name(major, minor),
        "nvcc": ".".join(map(str, nvcc.version)),
        "command": " ".join(compile_command(nvcc.path, "SOURCE", "OUT", major, minor,
                                            nvcc.version, rpath, defines=defines)),
        "abi": "1",
    }


def built_entry(major: int, minor: int, cache_dir: Path | None = None) -> Path:
    """Where :func:`build_library` keeps (or will keep) the library for ``major.minor``;
    builds nothing. Raises BuildError as :func:`find_nvcc` and :func:`tuning_defines` do."""
    nvcc = find_nvcc()
    key = _cache_key(nvcc, major, minor, toolkit_lib_dir(nvcc.path), tuning_defines())
    return entry_path(LIBRARY_NAME, key, Path(cache_dir) if cache_dir else cache_root())


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
    key = _cache_key(nvcc, major, minor, rpath, defines)

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


# ------------------------------------------------------------------ prebuilt libraries


@dataclass(frozen=True)
class PrebuiltLibrary:
    """One library of a wheel's ``prebuilt/manifest.json``."""

    path: Path
    cuda_major: int
    sha256: str
    sass: tuple[str, ...]
    ptx: tuple[str, ...]
    nvcc: str
    sources: str

    def code_for(self, major: int, minor: int) -> str | None:
        """What of this library runs on a GPU of compute capability ``major.minor``: its
        SASS for exactly that architecture, else PTX of an older one (compiled by the driver
        when the library is loaded); None when neither."""
        try:
            sm = arch_name(major, minor)
        except BuildError:
            return None
        if sm in self.sass:
            return f"{sm} SASS"
        for ptx in sorted(self.ptx, key=_arch_number, reverse=True):
            if _arch_number(ptx) <= major * 10 + minor:
                return f"{ptx} PTX, compiled by the driver for {sm}"
        return None

    @property
    def architectures(self) -> str:
        """``sm_80 sm_86 ... + compute_80 PTX``."""
        return " ".join(self.sass) + (f" + {' '.join(self.ptx)} PTX" if self.ptx else "")


def _arch_number(arch: str) -> int:
    """90 for ``sm_90a`` or ``compute_90``."""
    return int(re.sub(r"\D", "", arch.split("_", 1)[1]))


def prebuilt_libraries(directory: Path | None = None) -> list[PrebuiltLibrary]:
    """The libraries listed in ``directory``'s manifest (default :data:`PREBUILT_DIR`);
    empty when there is none. A manifest that cannot be read is a BuildError."""
    root = Path(directory) if directory is not None else PREBUILT_DIR
    manifest = root / MANIFEST_NAME
    if not manifest.is_file():
        return []
    try:
        data = json.loads(manifest.read_text())
        return [PrebuiltLibrary(path=root / e["file"], cuda_major=int(e["cuda_major"]),
                                sha256=str(e["sha256"]), sass=tuple(e["sass"]),
                                ptx=tuple(e["ptx"]), nvcc=str(e["nvcc"]),
                                sources=str(data["sources"]))
                for e in data["libraries"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BuildError(f"cannot read the prebuilt libraries' manifest {manifest}: {exc}; "
                         "reinstall kvio-cuda") from exc


def runtime_cuda_major(cuda_version: str | None) -> int | None:
    """12 for torch.version.cuda ``"12.8"``; None for a torch without CUDA."""
    m = re.match(r"\s*(\d+)", cuda_version or "")
    return int(m.group(1)) if m else None


def _sha256(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


@dataclass(frozen=True)
class LibraryChoice:
    """Which library runs on a GPU: a wheel's prebuilt one (``prebuilt`` set, verified) or
    one built with nvcc on first use (``prebuilt`` None), and why."""

    reason: str
    prebuilt: PrebuiltLibrary | None = None
    code: str | None = None
    rejected: tuple[str, ...] = field(default=())

    @property
    def kind(self) -> str:
        return "prebuilt" if self.prebuilt is not None else "built"

    def describe(self) -> str:
        """One line for ``kvio backends``: the library, its sha256 and architectures."""
        lib = self.prebuilt
        if lib is None:
            return f"built on first use ({self.reason})"
        return (f"prebuilt library for CUDA {lib.cuda_major} ({self.code}; holds "
                f"{lib.architectures}; nvcc {lib.nvcc}) {lib.path} sha256 {lib.sha256}")


def choose_library(major: int, minor: int, cuda_version: str | None,
                   directory: Path | None = None) -> LibraryChoice:
    """The library for a GPU of compute capability ``major.minor`` under a CUDA runtime
    ``cuda_version`` (torch.version.cuda): the wheel's prebuilt library for that CUDA major
    when it holds code for the GPU (SASS for its architecture, or PTX of an older one), its
    sources are the installed ones and its sha256 is the one recorded when the wheel was
    built; else a build on first use, with the reason. ``KVIO_CUDA_TUNE`` (a tuned build) and
    ``KVIO_CUDA_PREBUILT=0`` always build."""
    if os.environ.get("KVIO_CUDA_TUNE", "").strip():
        return LibraryChoice("KVIO_CUDA_TUNE is set: a tuned build")
    if os.environ.get(PREBUILT_ENV, "").strip() == "0":
        return LibraryChoice(f"{PREBUILT_ENV}=0")
    try:
        libraries = prebuilt_libraries(directory)
    except BuildError as exc:
        return LibraryChoice(str(exc))
    if not libraries:
        return LibraryChoice("no prebuilt library installed (a source or editable install)")
    cuda_major = runtime_cuda_major(cuda_version)
    same_major = [lib for lib in libraries if lib.cuda_major == cuda_major]
    if not same_major:
        have = ", ".join(str(lib.cuda_major) for lib in libraries)
        return LibraryChoice(f"the prebuilt libraries are for CUDA {have}, torch runs CUDA "
                             f"{cuda_version}")
    rejected = []
    for lib in same_major:
        code = lib.code_for(major, minor)
        if code is None:
            rejected.append(f"the prebuilt library for CUDA {lib.cuda_major} holds "
                            f"{lib.architectures}, no code for compute capability "
                            f"{major}.{minor}")
        elif lib.sources != _sources_digest():
            rejected.append(f"the prebuilt library {lib.path.name} was built from other "
                            f"sources than the installed csrc/")
        elif _sha256(lib.path) != lib.sha256:
            rejected.append(f"the prebuilt library {lib.path} does not match the sha256 "
                            f"recorded when the wheel was built; reinstall kvio-cuda")
        else:
            return LibraryChoice(f"prebuilt for CUDA {lib.cuda_major}", lib, code)
    return LibraryChoice("; ".join(rejected), rejected=tuple(rejected))


def describe_built(major: int, minor: int, cache_dir: Path | None = None) -> str:
    """Where the library built on first use for ``major.minor`` is, with its sha256 once it
    is built (builds nothing; BuildError as :func:`built_entry`)."""
    entry = built_entry(major, minor, cache_dir)
    if verify_entry(entry):
        sha = entry.with_name(entry.name + ".sha256").read_text().strip()
        return f"built library {entry} sha256 {sha} ({arch_name(major, minor)} SASS)"
    return f"to be built on first use into {entry} ({arch_name(major, minor)} SASS)"


def library_path(major: int, minor: int, cuda_version: str | None,
                 cache_dir: Path | None = None) -> tuple[LibraryChoice, Path]:
    """The chosen library (:func:`choose_library`) and its path, building it if needed."""
    choice = choose_library(major, minor, cuda_version)
    if choice.prebuilt is not None:
        return choice, choice.prebuilt.path
    return choice, build_library(major, minor, cache_dir)


def supported_codes(nvcc: Nvcc) -> set[str]:
    """The ``sm_XY`` / ``compute_XY`` names ``nvcc --list-gpu-code`` / ``--list-gpu-arch``
    accepts (the ``a`` variants are not listed: ``sm_90`` stands for ``sm_90a``)."""
    codes: set[str] = set()
    for flag in ("--list-gpu-code", "--list-gpu-arch"):
        proc = subprocess.run([str(nvcc.path), flag], capture_output=True, text=True,
                              timeout=60, check=False)
        codes.update(proc.stdout.split())
    return codes


def prebuilt_gencode(sass: Sequence[str], ptx: Sequence[str]) -> list[str]:
    """``-gencode`` flags for SASS of ``sass`` and PTX of ``ptx``."""
    flags = []
    for sm in sass:
        flags += ["-gencode", f"arch=compute_{sm.removeprefix('sm_')},code={sm}"]
    for compute in ptx:
        flags += ["-gencode", f"arch={compute},code={compute}"]
    return flags


#: where a prebuilt library finds the CUDA runtime of the registry's wheels when the process
#: has not loaded one of its major already (torch normally has): relative to
#: site-packages/kvio_cuda/prebuilt/
_PREBUILT_RPATH = {12: "$ORIGIN/../../nvidia/cuda_runtime/lib",
                   13: "$ORIGIN/../../nvidia/cu13/lib"}


def _compile_prebuilt(cmd: list[str], name: str, log: bool) -> str:
    """One prebuilt library's nvcc run, its intermediate files in a folder of its own. A
    failed run is tried once more: nvcc 13 with ``--threads`` once failed in CI's device link
    (``nvlink fatal: Could not read file .../tmpxft_..._dlink.reg.c``) while another nvcc ran
    beside it, and passed again unchanged."""
    with tempfile.TemporaryDirectory(prefix="kvio-nvcc-") as tmp:
        try:
            return run_compiler(cmd, "nvcc", tmpdir=Path(tmp))
        except BuildError as exc:
            if log:
                print(f"kvio_cuda: {name}: nvcc failed, trying once more: "
                      f"{str(exc).splitlines()[-1]}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="kvio-nvcc-") as tmp:
        return run_compiler(cmd, "nvcc", tmpdir=Path(tmp))


def build_prebuilt(out_dir: Path, nvccs: Sequence[Nvcc], threads: int = 0,
                   log: bool = True) -> list[dict[str, object]]:
    """Compile one library per CUDA major of ``nvccs`` (the newest nvcc of each major) into
    ``out_dir`` (emptied first), with SASS for :data:`PREBUILT_SASS` and PTX of
    :data:`PREBUILT_PTX` (those an nvcc does not know are left out and listed as
    ``skipped``), its ptxas report next to it, and ``manifest.json`` with each library's
    sha256. Returns the manifest's entries. Raises BuildError when nvcc fails or ``nvccs``
    is empty."""
    newest: dict[int, Nvcc] = {}
    for n in nvccs:
        if n.version[:2] < MIN_NVCC:
            raise BuildError(f"nvcc {n} is too old for kvio_cuda (needs "
                             f"{MIN_NVCC[0]}.{MIN_NVCC[1]} or newer)")
        if n.version[0] not in newest or n.version > newest[n.version[0]].version:
            newest[n.version[0]] = n
    if not newest:
        raise BuildError("no nvcc to build the prebuilt libraries with")
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    entries: list[dict[str, object]] = []
    for cuda_major, nvcc in sorted(newest.items()):
        known = supported_codes(nvcc)

        def knows(arch: str, known: set[str] = known, nvcc: Nvcc = nvcc) -> bool:
            plain = arch.rstrip("a")
            needed = _ARCH_MIN_NVCC.get(arch, MIN_NVCC)
            return plain in known and tuple(nvcc.version[:2]) >= needed

        sass = [a for a in PREBUILT_SASS if knows(a)]
        ptx = [a for a in PREBUILT_PTX if knows(a)]
        skipped = [a for a in (*PREBUILT_SASS, *PREBUILT_PTX) if a not in sass + ptx]
        name = f"libkvio_cuda-cu{cuda_major}.so"
        rpath = _PREBUILT_RPATH.get(cuda_major)
        cmd = compile_command(nvcc.path, SOURCE, out_dir / name, 0, 0, nvcc.version,
                              rpath=rpath, gencode=prebuilt_gencode(sass, ptx))
        cmd[1:1] = ["--threads", str(threads)]
        if log:
            print(f"kvio_cuda: compiling {name} with nvcc {nvcc.release}: "
                  f"{' '.join(sass)} + {' '.join(ptx)} PTX"
                  + (f" (nvcc {nvcc.release} lacks {' '.join(skipped)})" if skipped else ""),
                  file=sys.stderr, flush=True)
        report = _compile_prebuilt(cmd, name, log)
        (out_dir / f"{Path(name).stem}.ptxas.txt").write_text(report)
        entries.append({"file": name, "cuda_major": cuda_major,
                        "nvcc": ".".join(map(str, nvcc.version)),
                        "sha256": _sha256(out_dir / name), "sass": sass, "ptx": ptx,
                        "skipped": skipped,
                        "command": " ".join(compile_command(
                            nvcc.path, f"csrc/{SOURCE.name}", name, 0, 0, nvcc.version,
                            rpath=rpath, gencode=prebuilt_gencode(sass, ptx)))})
    manifest = {"schema": 1, "sources": _sources_digest(), "libraries": entries}
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return entries
