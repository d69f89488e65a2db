"""Facts about the machine a benchmark ran on, for the report header. Never raises."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import timeit
from typing import Any

import torch

from kvcore.streams import has_streams

#: environment variables that change what a run measures (which backend, how its kernels were
#: built, how the controller issues write-backs); the report names those that are set
MEASURED_ENVIRONMENT = ("KVCORE_BACKEND", "KVCORE_PLUGINS", "KVCORE_ASYNC_WRITE_BACK",
                        "KVIO_CUDA_TUNE", "KVIO_CUDA_PREBUILT")

_SMI = {  # tool -> arguments that print the driver version
    "nvidia-smi": ["--query-gpu=driver_version", "--format=csv,noheader"],
    "rocm-smi": ["--showdriverversion"],
}


def machine_facts(device: torch.device, host_memory: str | None) -> dict[str, Any]:
    """GPU name, driver, CUDA/ROCm and torch versions, CPU model and cores, host memory kind."""
    version = getattr(torch, "version", None)
    return {
        "device": str(device),
        "gpu": _gpu_name(device),
        "driver": _driver() if has_streams(device) else None,
        "cuda": getattr(version, "cuda", None),
        "hip": getattr(version, "hip", None),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_memory": host_memory,
        "pinned": host_memory == "pinned",
        "host_speed_ns": host_speed(),
    }


#: what :func:`host_speed` times: (name, statement, setup, statements per sample)
HOST_SPEED_STEPS = (
    ("python_call", "f(1, 2)", "def f(a, b): return a", 20000),
    ("tensor_attributes", "t.dtype; t.is_cpu; t.numel()", "import torch; t = torch.arange(64)",
     20000),
    ("sum_range_1000", "sum(range(1000))", "", 200),
)


def host_speed() -> dict[str, float]:
    """Nanoseconds this host's CPU takes for a Python call, for reading three attributes of a
    small CPU tensor and for ``sum(range(1000))`` (the best of five samples each, about 50 ms
    in all). The controller rows' CPU times are made of such steps and follow them: machines
    of one kind, started minutes apart, ran them up to 2.2x apart
    (docs/benchmarks/h100-2026-12-05b), so compare CPU rows of two runs with these beside
    them. Empty where timing fails."""
    out: dict[str, float] = {}
    with contextlib.suppress(Exception):
        for step in HOST_SPEED_STEPS:
            out[step[0]] = _ns_per(step)
    return out


def python_call_ns() -> float | None:
    """:func:`host_speed`'s Python call alone (about 5 ms), for timing the host again beside
    each row of a run: one host's speed moved 2.7x within minutes (docs/benchmarks/
    h200-2026-12-07). None where timing fails."""
    with contextlib.suppress(Exception):
        return _ns_per(HOST_SPEED_STEPS[0])
    return None


def _ns_per(step: tuple[str, str, str, int]) -> float:
    """ns per statement of a :data:`HOST_SPEED_STEPS` step, the best of five samples."""
    _, stmt, setup, number = step
    return round(1e9 * min(timeit.repeat(stmt, setup, repeat=5, number=number)) / number, 1)


def measured_environment() -> dict[str, str]:
    """The :data:`MEASURED_ENVIRONMENT` variables set for this run, with their values."""
    return {k: os.environ[k] for k in MEASURED_ENVIRONMENT if k in os.environ}


def _gpu_name(device: torch.device) -> str | None:
    if not has_streams(device):
        return None
    with contextlib.suppress(Exception):
        return str(torch.get_device_module(device).get_device_name(device))
    return None


def _driver() -> str | None:
    for tool, args in _SMI.items():
        path = shutil.which(tool)
        if path is None:
            continue
        with contextlib.suppress(Exception):
            out = subprocess.run([path, *args], capture_output=True, text=True, timeout=10,
                                 check=False).stdout.strip()
            lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
            if lines:
                return lines[0] if tool == "nvidia-smi" else _rocm_driver(lines)
    return None


def _rocm_driver(lines: list[str]) -> str:
    for ln in lines:
        if "version" in ln.lower() and ":" in ln:
            return ln.rsplit(":", 1)[1].strip()
    return lines[-1]


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what the platform module says."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
