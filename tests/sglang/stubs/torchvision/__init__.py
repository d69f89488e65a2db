"""CPU-only stand-in for torchvision, for the SGLang tests only (never shipped).

Why a stub: SGLang 0.5.23 imports ``torchvision.transforms`` at import time of its model
configs (``sglang.srt.configs`` -> ``multimodal/internvl_utils.py``), which the memory-pool
modules import. PyPI has no CPU build of torchvision: its wheels link ``libc10_cuda.so`` of a
CUDA torch and fail to load next to the CPU torch this repository pins (``operator
torchvision::nms does not exist``). The pool tests never touch an image. Every name here is a
placeholder that raises when called; ``scripts/install_sglang_test_deps.sh`` puts this folder on
the virtual environment's path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvcore-test-stub"


class _Unavailable(type):
    """A placeholder class: any attribute is another placeholder; calling it raises."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(name, (), {})

    def __call__(cls, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"torchvision stub: {cls.__name__} is not available in the kvcore "
                           "SGLang test environment (no CPU build of torchvision on PyPI)")


def _module_getattr(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[override]
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so deeper submodules import too
        module.__getattr__ = _module_getattr  # type: ignore[attr-defined]
        return module

    def exec_module(self, module):  # type: ignore[override]
        return None


sys.meta_path.append(_StubFinder())
__getattr__ = _module_getattr
