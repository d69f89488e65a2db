"""Which kernel library kvio_cuda uses, without a GPU: the wheel's prebuilt library for the
CUDA major of torch's runtime when it holds code for the GPU's architecture, else a build on
first use, or Unavailable naming the missing nvcc. torch.version.cuda and the device queries
are monkeypatched; the prebuilt libraries are fake files with a real manifest."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path
from typing import Any

import kvio_cuda
import pytest
import torch
from kvio_cuda import build

from kvcore.capabilities import Available, Unavailable
from kvcore.errors import BuildError

FULL = list(build.PREBUILT_SASS)
#: what nvcc 12.4 can build: no Blackwell
CUDA_12_4 = ["sm_80", "sm_86", "sm_89", "sm_90a"]


def write_prebuilt(directory: Path, libraries: dict[int, tuple[list[str], list[str]]],
                   sources: str | None = None) -> Path:
    """A prebuilt/ folder: for each CUDA major (sass, ptx), a fake library and its manifest
    entry."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for major, (sass, ptx) in libraries.items():
        name = f"libkvio_cuda-cu{major}.so"
        payload = f"fake kernels for CUDA {major}".encode()
        (directory / name).write_bytes(payload)
        entries.append({"file": name, "cuda_major": major, "nvcc": f"{major}.0.1",
                        "sha256": hashlib.sha256(payload).hexdigest(), "sass": sass,
                        "ptx": ptx, "skipped": [], "command": "nvcc ..."})
    manifest = {"schema": 1, "sources": sources or build._sources_digest(),
                "libraries": entries}
    (directory / build.MANIFEST_NAME).write_text(json.dumps(manifest))
    return directory


@pytest.fixture
def wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed wheel with libraries for CUDA 12 (as nvcc 12.4 builds them) and 13."""
    for var in ("KVIO_CUDA_TUNE", build.PREBUILT_ENV):
        monkeypatch.delenv(var, raising=False)
    directory = write_prebuilt(tmp_path / "prebuilt", {12: (CUDA_12_4, ["compute_80"]),
                                                       13: (FULL, ["compute_80"])})
    monkeypatch.setattr(build, "PREBUILT_DIR", directory)
    return directory


@pytest.fixture
def no_nvcc(no_toolkit: Path) -> None:
    """No nvcc anywhere (conftest's no_toolkit)."""


def fake_nvcc(path: Path, release: str = "13.0", codes: str = "sm_80 sm_90 sm_100 sm_120",
              ) -> Path:
    """An nvcc answering --version and --list-gpu-code/-arch, and 'compiling' into -o."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in
        --version) echo "Cuda compilation tools, release {release}, V{release}.99"; exit 0;;
        --list-gpu-code) for c in {codes}; do echo $c; done; exit 0;;
        --list-gpu-arch) for c in {codes}; do echo $c | sed s/sm_/compute_/; done; exit 0;;
        esac
        out=""
        while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
        [ -n "$out" ] && printf 'fatbin' > "$out"
        echo "ptxas info    : Compiling entry function 'kvio_set_flags' for 'sm_80'" >&2
        exit 0
        """))
    path.chmod(0o755)
    return path


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``gpu((9, 0), "13.0")``: torch sees one such GPU under that CUDA runtime."""

    def set_gpu(cc: tuple[int, int], cuda: str | None = "13.0") -> None:
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.version, "hip", None, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")

    return set_gpu


# ------------------------------------------------------------------ choose_library


@pytest.mark.parametrize(
    ("cuda", "cc", "library", "code"),
    [("13.0", (9, 0), 13, "sm_90a SASS"),
     ("12.8", (9, 0), 12, "sm_90a SASS"),
     ("13.2", (8, 6), 13, "sm_86 SASS"),
     ("13.0", (8, 9), 13, "sm_89 SASS"),
     ("13.0", (10, 0), 13, "sm_100a SASS"),
     ("13.0", (12, 0), 13, "sm_120a SASS"),
     # no SASS for the exact architecture: the driver compiles the sm_80 PTX
     ("13.0", (10, 3), 13, "compute_80 PTX, compiled by the driver for sm_103a"),
     ("13.0", (8, 7), 13, "compute_80 PTX, compiled by the driver for sm_87"),
     ("12.4", (10, 0), 12, "compute_80 PTX, compiled by the driver for sm_100a")],
)
def test_the_library_follows_the_runtime_cuda_major_and_the_gpu(
        wheel: Path, cuda: str, cc: tuple[int, int], library: int, code: str) -> None:
    choice = build.choose_library(*cc, cuda)
    assert choice.prebuilt is not None, choice.reason
    assert choice.prebuilt.path == wheel / f"libkvio_cuda-cu{library}.so"
    assert choice.prebuilt.cuda_major == library
    assert choice.code == code
    assert choice.kind == "prebuilt"


def test_no_library_for_the_runtime_cuda_major_builds(wheel: Path, tmp_path: Path) -> None:
    only_13 = write_prebuilt(tmp_path / "only13", {13: (FULL, ["compute_80"])})
    choice = build.choose_library(9, 0, "12.8", only_13)
    assert choice.prebuilt is None and choice.kind == "built"
    assert choice.reason == "the prebuilt libraries are for CUDA 13, torch runs CUDA 12.8"


def test_a_gpu_the_library_has_no_code_for_builds(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    sass_only = write_prebuilt(tmp_path / "sass-only", {13: (FULL, [])})
    choice = build.choose_library(10, 3, "13.0", sass_only)
    assert choice.prebuilt is None
    assert "no code for compute capability 10.3" in choice.reason
    assert "holds sm_80 sm_86 sm_89 sm_90a sm_100a sm_120a" in choice.reason
    # PTX of a newer architecture does not run on an older GPU
    newer_ptx = write_prebuilt(tmp_path / "newer-ptx", {13: (["sm_90a"], ["compute_90"])})
    assert build.choose_library(8, 0, "13.0", newer_ptx).prebuilt is None


def test_a_source_install_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    choice = build.choose_library(9, 0, "13.0", tmp_path / "nothing")
    assert choice.prebuilt is None and "no prebuilt library installed" in choice.reason


@pytest.mark.parametrize(("var", "value", "reason"),
                         [("KVIO_CUDA_TUNE", "UNROLL=8", "KVIO_CUDA_TUNE is set"),
                          ("KVIO_CUDA_PREBUILT", "0", "KVIO_CUDA_PREBUILT=0")])
def test_a_tuned_build_or_the_switch_ignores_the_prebuilt_library(
        wheel: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str,
        reason: str) -> None:
    monkeypatch.setenv(var, value)
    choice = build.choose_library(9, 0, "13.0")
    assert choice.prebuilt is None and reason in choice.reason


def test_a_library_that_fails_its_sha256_is_not_loaded(wheel: Path) -> None:
    (wheel / "libkvio_cuda-cu13.so").write_bytes(b"tampered")
    choice = build.choose_library(9, 0, "13.0")
    assert choice.prebuilt is None
    assert "does not match the sha256 recorded when the wheel was built" in choice.reason
    (wheel / "libkvio_cuda-cu13.so").unlink()
    assert build.choose_library(9, 0, "13.0").prebuilt is None


def test_a_library_of_other_sources_is_not_loaded(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    stale = write_prebuilt(tmp_path / "stale", {13: (FULL, ["compute_80"])}, sources="0" * 64)
    choice = build.choose_library(9, 0, "13.0", stale)
    assert choice.prebuilt is None and "other sources" in choice.reason


def test_an_unreadable_manifest_builds_and_says_why(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    (tmp_path / build.MANIFEST_NAME).write_text("{not json")
    choice = build.choose_library(9, 0, "13.0", tmp_path)
    assert choice.prebuilt is None and "cannot read the prebuilt libraries' manifest" in \
        choice.reason


def test_library_path_loads_the_prebuilt_library_without_nvcc(
        wheel: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_build(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("nothing may be compiled")

    monkeypatch.setattr(build, "build_library", no_build)
    choice, path = build.library_path(9, 0, "13.0")
    assert path == wheel / "libkvio_cuda-cu13.so" and choice.kind == "prebuilt"

    built = tmp_path / "cache" / "libkvio_cuda-abc.so"
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(build, "build_library",
                        lambda major, minor, cache_dir=None: calls.append((major, minor))
                        or built)
    choice, path = build.library_path(9, 0, "11.8")  # no library for CUDA 11
    assert path == built and calls == [(9, 0)] and choice.kind == "built"


def test_the_backend_loads_the_chosen_library(wheel: Path, gpu: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import kvio_cuda._native
    from kvio_cuda.backend import CudaBackend

    import kvcore.native

    gpu((9, 0), "13.0")
    import kvio_cuda.backend

    loaded: list[Path] = []
    verified: list[tuple[Path, str | None]] = []
    monkeypatch.setattr(kvio_cuda._native, "NativeLibrary",
                        lambda path, lib=None: loaded.append(path))
    monkeypatch.setattr(kvio_cuda.backend, "load_library",
                        lambda path, sha256=None: verified.append((path, sha256)))
    monkeypatch.setattr(kvcore.native.NativeBackend, "__init__", lambda self, dev, lib: None)
    monkeypatch.setattr(build, "build_library", lambda *a, **k: pytest.fail("compiled"))
    backend = CudaBackend(torch.device("cuda", 0))
    assert loaded == [wheel / "libkvio_cuda-cu13.so"]
    assert backend.library_choice.code == "sm_90a SASS"
    # loaded through a descriptor checked against the manifest's sha256, not by path again
    prebuilt = backend.library_choice.prebuilt
    assert prebuilt is not None and verified == [(loaded[0], prebuilt.sha256)]


# ------------------------------------------------------------- availability probe


def test_probe_available_without_nvcc_when_a_prebuilt_library_covers_the_gpu(
        wheel: Path, gpu: Any, no_nvcc: None) -> None:
    gpu((9, 0), "13.0")
    avail = kvio_cuda.check_availability()
    assert isinstance(avail, Available), avail
    lib = wheel / "libkvio_cuda-cu13.so"
    sha = hashlib.sha256(lib.read_bytes()).hexdigest()
    assert avail.detail == (
        f"Fake GPU (sm_90), CUDA 13.0: prebuilt library for CUDA 13 (sm_90a SASS; holds "
        f"sm_80 sm_86 sm_89 sm_90a sm_100a sm_120a + compute_80 PTX; nvcc 13.0.1) {lib} "
        f"sha256 {sha}")


def test_probe_unavailable_naming_the_missing_nvcc_when_nothing_covers_the_gpu(
        wheel: Path, gpu: Any, no_nvcc: None) -> None:
    gpu((9, 0), "11.8")
    avail = kvio_cuda.check_availability()
    assert isinstance(avail, Unavailable)
    assert avail.reason.startswith(
        "no prebuilt library for Fake GPU (sm_90) (the prebuilt libraries are for CUDA 12, 13, "
        "torch runs CUDA 11.8), and nvcc not found: kvio_cuda builds its kernels with the CUDA "
        "toolkit 12.0 or newer; looked in PATH (none)")
    assert "the nvidia-cuda-nvcc package (none)" in avail.reason


def test_probe_available_with_nvcc_for_a_build_on_first_use(
        wheel: Path, gpu: Any, no_nvcc: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc = fake_nvcc(tmp_path / "cuda" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(nvcc.parent.parent))
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVIO_CUDA_TUNE", "UNROLL=8")
    gpu((9, 0), "13.0")
    avail = kvio_cuda.check_availability()
    assert isinstance(avail, Available), avail
    assert f"to be built on first use into {tmp_path / 'cache'}/libkvio_cuda-" in avail.detail
    assert "(sm_90a SASS) with nvcc 13.0.99" in avail.detail
    assert avail.detail.endswith("not prebuilt: KVIO_CUDA_TUNE is set: a tuned build")


def test_probe_names_an_old_gpu_before_looking_for_a_library(wheel: Path, gpu: Any) -> None:
    gpu((7, 5), "13.0")
    avail = kvio_cuda.check_availability()
    assert isinstance(avail, Unavailable) and "compute capability 7.5" in avail.reason


# ------------------------------------------------------------ nvcc from the registry


def test_find_nvcc_finds_the_nvidia_cuda_nvcc_package(no_nvcc: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "venv-site"
    monkeypatch.setattr(build, "_site_dirs", lambda: [tmp_path / "user-site", site])
    exe = fake_nvcc(site / "nvidia" / "cu13" / "bin" / "nvcc", "13.0")
    found = build.find_nvcc()
    assert found.path == exe and found.version == (13, 0, 99)


def test_a_registry_nvcc_links_its_versioned_cudart(tmp_path: Path) -> None:
    top = tmp_path / "site" / "nvidia" / "cu13"
    nvcc = fake_nvcc(top / "bin" / "nvcc")
    (top / "lib").mkdir()
    (top / "lib" / "libcudart.so.13").write_bytes(b"")
    cmd = build.compile_command(nvcc, "k.cu", "o.so", 9, 0)
    joined = " ".join(cmd)
    assert "-cudart none" in joined and "-cudart shared" not in joined
    assert f"-L{top / 'lib'} -Xlinker -l:libcudart.so.13" in joined
    assert build.toolkit_lib_dir(nvcc) == (top / "lib").resolve()
    # a toolkit as NVIDIA installs it links the shared cudart as before
    (top / "lib64").mkdir()
    assert "-cudart shared" in " ".join(build.compile_command(nvcc, "k.cu", "o.so", 9, 0))


# --------------------------------------------------------------- the wheel build


def test_build_prebuilt_leaves_out_what_an_nvcc_does_not_know(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    old = build.nvcc_at(fake_nvcc(tmp_path / "12.4" / "nvcc", "12.4", "sm_80 sm_86 sm_89 sm_90"))
    new = build.nvcc_at(fake_nvcc(tmp_path / "13.0" / "nvcc", "13.0",
                                  "sm_75 sm_80 sm_86 sm_89 sm_90 sm_100 sm_120"))
    out = tmp_path / "prebuilt"
    (out / "stale").mkdir(parents=True)
    entries = build.build_prebuilt(out, [old, new], log=False)
    assert [e["file"] for e in entries] == ["libkvio_cuda-cu12.so", "libkvio_cuda-cu13.so"]
    assert entries[0]["sass"] == CUDA_12_4 and entries[0]["skipped"] == ["sm_100a", "sm_120a"]
    assert entries[1]["sass"] == FULL and entries[1]["ptx"] == ["compute_80"]
    assert "-gencode arch=compute_80,code=compute_80" in str(entries[1]["command"])
    assert "-rpath,$ORIGIN/../../nvidia/cu13/lib" in str(entries[1]["command"])
    assert sorted(p.name for p in out.iterdir()) == [
        "libkvio_cuda-cu12.ptxas.txt", "libkvio_cuda-cu12.so", "libkvio_cuda-cu13.ptxas.txt",
        "libkvio_cuda-cu13.so", "manifest.json"]
    for cuda, cc, code in (("12.4", (9, 0), "sm_90a SASS"), ("13.0", (12, 0), "sm_120a SASS")):
        assert build.choose_library(*cc, cuda, out).code == code
    with pytest.raises(BuildError, match="no nvcc"):
        build.build_prebuilt(out, [])


def test_a_prebuilt_compile_runs_in_its_own_temp_folder_and_is_tried_once_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("KVIO_CUDA_TUNE", raising=False)
    nvcc = fake_nvcc(tmp_path / "13.0" / "nvcc", "13.0", "sm_80 sm_86 sm_89 sm_90 sm_100 sm_120")
    real = nvcc.read_text()
    seen, failed = tmp_path / "tmpdirs", tmp_path / "failed"
    # the first compile fails as nvcc's device link once did in CI; the next one passes
    flaky = (f'echo "$TMPDIR" >> {seen}\n'
             f'if [ ! -e {failed} ]; then touch {failed}; '
             'echo "nvlink fatal   : Could not read file x_dlink.reg.c" >&2; exit 255; fi\n')
    nvcc.write_text(real.replace('out=""', flaky + 'out=""'))
    entries = build.build_prebuilt(tmp_path / "out", [build.nvcc_at(nvcc)])
    assert [e["file"] for e in entries] == ["libkvio_cuda-cu13.so"]
    first, second = seen.read_text().split()
    assert first != second and "kvio-nvcc-" in first and not Path(first).exists()
    assert "nvcc failed, trying once more: nvlink fatal" in capsys.readouterr().err
    nvcc.write_text(real.replace('out=""', 'exit 3\nout=""'))  # fails every time
    with pytest.raises(BuildError, match="exit 3"):
        build.build_prebuilt(tmp_path / "out", [build.nvcc_at(nvcc)], log=False)


def test_a_library_built_here_follows_kvcores_abi_header_and_a_prebuilt_one_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore.native_abi import ABI_HEADER

    header = tmp_path / "kvio_abi.h"
    header.write_bytes(ABI_HEADER.read_bytes())
    monkeypatch.setattr(build, "ABI_HEADER", header)
    nvcc = build.nvcc_at(fake_nvcc(tmp_path / "13.0" / "nvcc", "13.0", "sm_90"))
    before = build._cache_key(nvcc, 9, 0, None, ())
    prebuilt_sources = build._sources_digest()
    header.write_text(header.read_text() + "/* a comment */\n")
    assert build._cache_key(nvcc, 9, 0, None, ()) != before  # the cached build is redone
    assert build._sources_digest() == prebuilt_sources  # the wheel's library still serves
    assert ABI_HEADER not in build.source_files()
