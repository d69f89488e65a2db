"""``kvio build``: build (or load from the cache) the native kernels of available backends.

Native backends build their kernels on first use; running this once at deployment (or in a
container image) keeps the build out of the first request. Backend-agnostic: it instantiates
each available backend for the device, which is where a native backend builds.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvcore.cli.common import parse_device, require_backend
from kvcore.registry import default_registry


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("build", help="prebuild native kernels of available backends",
                       description="Build or load the cached native kernels of every available "
                                   "backend (or only --backend NAME) for a device.")
    p.add_argument("--backend", action="append", default=None,
                   help="backend name (repeatable; default: every available one)")
    p.add_argument("--device", default=None, help="torch device (default: the accelerator)")
    return p


def run(args: argparse.Namespace) -> int:
    registry = default_registry()
    device = parse_device(args.device)
    for name in args.backend or []:  # a typo is a usage error, not a failed build
        require_backend(registry, name, "--backend")
    names = args.backend or registry.runnable(device)
    status = 0
    for name in names:
        start = time.perf_counter()
        try:
            registry.instance(name, device)
        except Exception as exc:  # noqa: BLE001 - report every backend, then fail
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            status = 1
            continue
        print(f"{name}: ready for {device} ({time.perf_counter() - start:.1f} s)")
    if not names:
        print(f"no available backend runs on {device}")
    return status
