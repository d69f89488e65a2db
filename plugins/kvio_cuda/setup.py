"""kvio-cuda's wheel compiles the kernel library ahead of time (pyproject.toml has the rest).

``build_py`` adds ``kvio_cuda/prebuilt/``: one library per CUDA major version, with SASS for
the architectures users run and PTX of the oldest, their ptxas reports and a manifest with
each library's sha256 (:func:`kvio_cuda.build.build_prebuilt`). The wheel is tagged
``py3-none-linux_x86_64``: the libraries are loaded through ctypes with a plain C ABI, so
they do not depend on the Python version, only on the platform.

The compile uses kvio_cuda/build.py, which needs kvcore importable: build with
``--no-build-isolation`` in an environment that has kvcore (scripts/build_wheels.sh).

Environment:
  KVIO_CUDA_WHEEL_LIBS  auto (default): compile when kvcore and nvcc are at hand, else a wheel
                        that builds on first use, with a warning; require: fail instead;
                        off: no libraries (a pure wheel)
  KVIO_CUDA_WHEEL_NVCC  nvcc executables separated by ':' (one library per CUDA major;
                        default: the nvcc kvio_cuda finds, see kvio_cuda.build.find_nvcc)
An editable install (pip install -e) never compiles: it builds on first use.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
MODES = ("auto", "require", "off")


def _mode() -> str:
    mode = os.environ.get("KVIO_CUDA_WHEEL_LIBS", "auto").strip() or "auto"
    if mode not in MODES:
        raise SystemExit(f"KVIO_CUDA_WHEEL_LIBS={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _load_build():
    """kvio_cuda/build.py without importing the package (whose __init__ imports torch)."""
    name = "_kvio_cuda_wheel_build"
    spec = importlib.util.spec_from_file_location(name, HERE / "kvio_cuda" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class build_py_with_kernels(build_py):
    def run(self) -> None:
        super().run()
        mode = _mode()
        out = Path(self.build_lib) / "kvio_cuda" / "prebuilt"
        shutil.rmtree(out, ignore_errors=True)  # never ship the libraries of an earlier build
        if getattr(self, "editable_mode", False) or mode == "off":
            return
        try:
            build = _load_build()
            listed = [p for p in os.environ.get("KVIO_CUDA_WHEEL_NVCC", "").split(":") if p]
            nvccs = [build.nvcc_at(p) for p in listed] or [build.find_nvcc()]
            build.build_prebuilt(out, nvccs)
        except Exception as exc:
            if mode == "require":
                raise SystemExit(f"kvio-cuda: cannot compile the prebuilt kernel libraries: "
                                 f"{type(exc).__name__}: {exc}") from exc
            print(f"WARNING: kvio-cuda wheel without prebuilt kernels (they build on first use):"
                  f" {type(exc).__name__}: {exc}", file=sys.stderr)


class bdist_wheel_platform(bdist_wheel):
    """``py3-none-<platform>``: native libraries, but no CPython extension."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


class PlatformDistribution(Distribution):
    """Installs into platlib and makes a platform wheel (the libraries are native code)."""

    def has_ext_modules(self) -> bool:
        return _mode() != "off"


setup(distclass=PlatformDistribution,
      cmdclass={"build_py": build_py_with_kernels, "bdist_wheel": bdist_wheel_platform})
