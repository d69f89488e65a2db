"""``kvio new-backend NAME DIR``: write a plugin skeleton that installs and passes the suite."""

from __future__ import annotations

import argparse
import keyword
import re
import string
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

from kvcore.errors import InvalidArgument
from kvcore.registry import SHIPPED

TEMPLATE = "backend"
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
#: the longest NAME: its module folder name (kvio_NAME) must fit every file system's 255 bytes
MAX_NAME = 64


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("new-backend", help="write a backend plugin skeleton",
                       description="Write a plugin skeleton for backend NAME into DIR: a "
                                   "pyproject.toml registering the kvcore.backends entry "
                                   "point, a module with capabilities and the hookimpl, and a "
                                   "backend delegating to the reference, so it installs, is "
                                   "discovered and passes `kvio check NAME` from the start.")
    p.add_argument("name", help="backend name (lowercase letters, digits, _)")
    p.add_argument("dir", help="directory to create (must not exist or be empty)")
    return p


def template_values(name: str) -> dict[str, str]:
    """The substitutions of the skeleton templates for backend ``name``."""
    from kvcore import __version__

    if not _NAME.match(name) or keyword.iskeyword(name):
        raise InvalidArgument("NAME", "lowercase letters, digits and _, starting with a letter",
                              repr(name))
    if len(name) > MAX_NAME:
        raise InvalidArgument("NAME", f"at most {MAX_NAME} characters",
                              f"{len(name)} characters")
    if name in SHIPPED:
        raise InvalidArgument("NAME", f"a name no shipped plugin uses (not "
                                      f"{', '.join(sorted(SHIPPED))})",
                              f"{name!r}, which would shadow {SHIPPED[name]}")
    return {
        "name": name,
        "module": f"kvio_{name}",
        "distribution": f"kvio-{name.replace('_', '-')}",
        "class_name": "".join(part.capitalize() for part in name.split("_")) + "Backend",
        "kvcore_version": __version__,
    }


def _files(root: Traversable, prefix: str = "") -> list[tuple[str, Traversable]]:
    out = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        rel = f"{prefix}{entry.name}"
        if entry.is_dir():
            out += _files(entry, rel + "/")
        elif entry.name.endswith(".tmpl"):
            out.append((rel.removesuffix(".tmpl"), entry))
    return out


def write_skeleton(name: str, target: Path) -> list[Path]:
    """Render the skeleton for ``name`` into ``target``; return the files written."""
    values = template_values(name)
    if target.exists() and not target.is_dir():
        raise InvalidArgument("DIR", "a new or empty directory", f"{target} (a file)")
    if target.exists() and any(target.iterdir()):
        raise InvalidArgument("DIR", "a new or empty directory", f"{target} (not empty)")
    try:  # made (or found writable) before the first file is written
        target.mkdir(parents=True, exist_ok=True)
        probe = target / ".kvio-new-backend"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise InvalidArgument("DIR", "a directory you can create and write",
                              f"{target} ({exc.strerror or exc})") from exc
    root = resources.files("kvcore").joinpath("templates").joinpath(TEMPLATE)
    written: list[Path] = []
    try:
        for rel, entry in _files(root):
            path = target / rel.replace("package/", values["module"] + "/", 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(string.Template(entry.read_text()).substitute(values))
            written.append(path)
    except OSError as exc:  # no half-written skeleton is left behind to look complete
        for path in reversed(written):
            path.unlink(missing_ok=True)
        for folder in sorted({p.parent for p in written}, key=lambda f: -len(f.parts)):
            if folder != target and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise InvalidArgument("DIR", "a directory the skeleton can be written into",
                              f"{target} ({exc.strerror or exc}); nothing was left "
                              "there") from exc
    return written


def run(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    written = write_skeleton(args.name, target)
    for path in written:
        print(f"wrote {path}")
    module = template_values(args.name)["module"]
    print(f"\nnext: pip install -e {target} && kvio backends && kvio check {args.name}\n"
          f"then replace {target / module / 'backend.py'} one operation at a time.")
    return 0
