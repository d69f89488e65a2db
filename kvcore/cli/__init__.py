"""The ``kvio`` command. Each subcommand lives in its own module with ``add_parser``/``run``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvcore.errors import KVCoreError

#: subcommand name -> module (relative to kvcore.cli) defining add_parser(sub) and run(args)
SUBCOMMANDS = {
    "backends": "backends",
    "check": "check",
    "new-backend": "new_backend",
    "replay": "replay",
    "bench": "bench",
    "build": "build",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvio", description="kvcore: move paged KV-cache data between GPU and host memory")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS.values():
        mod = importlib.import_module(f"kvcore.cli.{module}")
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


#: commands that use installed backends, so KVCORE_BACKEND is checked before they start
USES_BACKENDS = frozenset({"backends", "check", "replay", "bench", "build"})


def main(argv: list[str] | None = None) -> int:
    """Run ``kvio``; a refusal is one line on stderr, ``kvio CMD: ErrorType: message``, and
    exit status 2 (under KVCORE_STRICT=1 a plugin's traceback follows the line)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in USES_BACKENDS:
            from kvcore.cli.common import check_forced_backend
            from kvcore.registry import default_registry

            check_forced_backend(default_registry())
        return int(args._run(args) or 0)
    except KVCoreError as exc:
        print(f"kvio {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        plugin_traceback = getattr(exc, "plugin_traceback", None)
        if plugin_traceback and os.environ.get("KVCORE_STRICT", "").strip() not in ("", "0"):
            print(plugin_traceback.rstrip("\n"), file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader stopped reading (`kvio backends | head -1`): stop as a pipe's writer
        # does, quietly, with the status of SIGPIPE; what is still buffered goes nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
