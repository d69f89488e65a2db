"""``kvio check [NAME]``: run the conformance suite and print a capability-by-result matrix."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from kvcore.cli.common import parse_device, require_backend
from kvcore.errors import BackendUnavailable, MissingDependency
from kvcore.layout import Op
from kvcore.registry import Registry, default_registry


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="run the conformance suite against installed backends",
                       description="Run kvcore.testing's conformance suite (differential "
                                   "against the reference) for backend NAME, or for every "
                                   "available backend, and print one row per op, kind, "
                                   "layout and variant with its passed/failed/not claimed/"
                                   "skipped/xfail counts. Exit status 1 if any case failed, "
                                   "or if no case ran (a -k selection of unclaimed "
                                   "cases, or capabilities that claim nothing).")
    p.add_argument("name", nargs="?", default=None, help="backend to check (default: all)")
    p.add_argument("--device", default=None,
                   help="torch device (default: the accelerator if there is one, else cpu)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=None,
                      help="small cases (the default on cpu)")
    size.add_argument("--full", action="store_true", help="full-size cases (default off cpu)")
    p.add_argument("-k", dest="keyword", default=None, help="only cases matching (pytest -k)")
    p.add_argument("-v", "--verbose", action="store_true", help="show each case")
    return p


def _runnable(registry: Registry, name: str, device: torch.device) -> str | None:
    """Why ``name`` cannot run on ``device``, or None."""
    caps = registry.get(name).spec.capabilities
    if not caps.supports_device(device):
        return f"runs on {', '.join(sorted(caps.device_types or ()))} devices, not {device.type}"
    avail = registry.availability(name)
    return None if avail else avail.reason  # type: ignore[union-attr]


#: pytest's configuration files, in the order it looks for them in a folder, and the section
#: that makes each one count
CONFIG_FILES = (("pytest.ini", ""), (".pytest.ini", ""),
                ("pyproject.toml", "[tool.pytest.ini_options]"), ("tox.ini", "[pytest]"),
                ("setup.cfg", "[tool:pytest]"))


def local_config(folder: Path) -> Path | None:
    """The pytest configuration of ``folder`` where it is a backend plugin's (it sets
    ``kvio_xfail`` or ``kvio_backend``), found as pytest finds one in a folder; else None.
    The suite lives in kvcore, so pytest would otherwise read kvcore's configuration, and
    a plugin's expected failures would not count."""
    for name, section in CONFIG_FILES:
        path = folder / name
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if not section or section in text:  # the one pytest would read
            return path if "kvio_xfail" in text or "kvio_backend" in text else None
    return None


def _ran(result: Any, transfers_only: bool = True) -> int:
    """How many cases ran against the backend, whatever their outcome: transfer cases only
    (the host memory row runs for every backend), or any (a ``-k`` selection may ask for the
    host memory row alone)."""
    ops = tuple(f"{op.value} " for op in Op) if transfers_only else ("",)
    return sum(c[o] for row, c in result.counts.items() if row.startswith(ops)
               for o in ("passed", "failed", "xfail", "xpass"))


def run(args: argparse.Namespace) -> int:
    try:
        from kvcore.testing.runner import matrix, run_suite
    except ImportError as exc:
        raise MissingDependency(f"kvio check runs the conformance suite with pytest, which "
                                f"cannot be imported ({exc}); install it with "
                                f"pip install 'kvcore[test]'") from exc

    registry = default_registry()
    device = parse_device(args.device)
    if args.name:  # asked for by name: unknown or unable to run here is an error, not a skip
        require_backend(registry, args.name, "NAME")
        why = _runnable(registry, args.name, device)
        if why is not None:
            raise BackendUnavailable(f"backend {args.name!r} cannot be checked on {device}: "
                                     f"{why}")
    names = [args.name] if args.name else [r.name for r in registry.backends()]
    quick = True if args.quick else (False if args.full else None)
    extra = ["-v" if args.verbose else "-q", "--tb=short", "--no-header"]
    if args.keyword:
        extra += ["-k", args.keyword]
    config = local_config(Path.cwd())
    if config is not None:  # run from a plugin's folder: its kvio_xfail counts
        extra += ["-c", str(config), "--rootdir", str(config.parent)]
        print(f"kvio check: pytest configuration {config}")
    failed = False
    if not args.name:  # a plugin that did not load is not checked, and says so
        for broken in registry.broken():
            print(f"== {broken.name}: not run, {broken.reason}")
            failed = True
    for name in names:
        why = _runnable(registry, name, device)
        if why is not None:
            print(f"== {name} on {device}: not run, unavailable: {why}")
            continue
        print(f"== {name} on {device}")
        result = run_suite(name, str(device), quick, extra)
        print(f"\n{name} on {device}: capability-by-result matrix")
        print(matrix(result))
        if result.failures:
            print(f"{name}: {len(result.failures)} failed; pytest's report of each is above "
                  "(a differential case's ends with the command that reruns it)")
        if not result.ok:
            failed = True
        elif args.keyword and not sum(result.totals().values()):
            print(f"{name}: no case matches -k {args.keyword!r}")
            failed = True
        elif args.keyword and not _ran(result, transfers_only=False):
            counts = ", ".join(f"{n} {o}" for o, n in sorted(result.totals().items()) if n)
            print(f"{name}: no case matching -k {args.keyword!r} ran ({counts}): its "
                  "capabilities claim none of them (kvio backends lists what it claims)")
            failed = True
        elif not args.keyword and not _ran(result):
            print(f"{name}: ran no case: its capabilities claim nothing the suite covers "
                  "(kvio backends lists what it claims)")
            failed = True
    return 1 if failed else 0
