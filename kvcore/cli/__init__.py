"""The ``kvio`` command. Each subcommand lives in its own module with ``add_parser``/``run``."""

from __future__ import annotations

import argparse
import importlib
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KVCoreError as exc:
        print(f"kvio {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
