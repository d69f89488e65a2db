"""A per-user cache of natively built libraries (vendor-free; used by kvio_cuda, kvio_rocm).

A library is identified by a ``name`` and a ``key``: a mapping of strings that determines
its bytes (source hash, target architecture, compiler version, flags...). The entry's file
name is derived from a sha256 of both, so a changed key is a new entry, never a stale hit.

Guarantees:

- The cache directory belongs to the current user and is not writable by group or others
  (anything else is refused: a library loaded from a directory others can write to runs
  their code in our process). It is created with mode 0o700.
- Builds happen under an exclusive ``fcntl.flock`` on ``<entry>.lock``; the result is
  written to a temporary file in the same directory and moved into place with
  ``os.replace``, so readers see either no entry or a whole one, and a library already
  loaded by another process is never modified under it.
- A sidecar ``<entry>.sha256`` records the library's sha256, checked before an entry is
  returned; a truncated or corrupt entry (or one without its sidecar) is rebuilt.
- Many processes asking at once build exactly once: the entry is checked again after the
  lock is taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from kvcore.errors import BuildError

__all__ = ["build_cached", "cache_root", "entry_path", "verify_entry"]

#: the environment variable naming the cache directory (overrides the XDG default)
CACHE_DIR_ENV = "KVCORE_CACHE_DIR"

_DIR_MODE = 0o700
_CHUNK = 1 << 20


def cache_root() -> Path:
    """The default cache directory.

    ``$KVCORE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/kvcore``, else ``~/.cache/kvcore``.
    The directory is not created or checked here (see :func:`build_cached`).
    """
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvcore"
    return Path.home() / ".cache" / "kvcore"


def _key_digest(name: str, key: Mapping[str, str]) -> str:
    for k, v in key.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"build cache key entries must be str -> str, got {k!r}: {v!r}")
    canonical = json.dumps({"name": name, "key": dict(key)}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def entry_path(name: str, key: Mapping[str, str], cache_dir: Path) -> Path:
    """Where the library ``name`` built for ``key`` lives in ``cache_dir``.

    ``name`` may carry a suffix (``libkvio_cuda.so`` gives ``libkvio_cuda-<hash>.so``).
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"build cache name must be a plain file name, got {name!r}")
    p = Path(name)
    digest = _key_digest(name, key)[:32]
    return cache_dir / f"{p.stem}-{digest}{p.suffix}"


def _sidecar(entry: Path) -> Path:
    return entry.with_name(entry.name + ".sha256")


def _lockfile(entry: Path) -> Path:
    return entry.with_name(entry.name + ".lock")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_entry(entry: Path) -> bool:
    """True when ``entry`` and its sidecar exist and the file's sha256 matches the sidecar."""
    try:
        recorded = _sidecar(entry).read_text().strip()
        return bool(recorded) and entry.is_file() and _sha256_file(entry) == recorded
    except OSError:
        return False


def _secure_dir(path: Path) -> Path:
    """Create ``path`` (mode 0o700) if needed and refuse it unless it is a directory owned by
    the current user and not writable by group or others."""
    try:
        path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create the build cache directory {path}: {exc}; "
                         f"set {CACHE_DIR_ENV} to a directory of your own") from exc
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise BuildError(f"build cache path {path} is not a directory; "
                         f"set {CACHE_DIR_ENV} to a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    uid = os.getuid()
    if st.st_uid != uid:
        raise BuildError(f"build cache directory {path} is owned by uid {st.st_uid}, not by the "
                         f"current user (uid {uid}); refusing to load native code from it. "
                         f"Set {CACHE_DIR_ENV} to a directory of your own")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BuildError(f"build cache directory {path} has mode {mode:#o} (writable by group or "
                         f"others); refusing to load native code from it. Run "
                         f"'chmod 700 {path}' or set {CACHE_DIR_ENV} to a directory of your own")
    return path


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _build_into(entry: Path, build: Callable[[Path], None]) -> None:
    """Run ``build`` into a temporary file next to ``entry``, then publish it atomically."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.name}.", suffix=".tmp" + entry.suffix,
                                    dir=entry.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp_sidecar = tmp.with_name(tmp.name + ".sha256")
    try:
        build(tmp)
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise BuildError(f"building {entry.name} produced no output (expected a file at {tmp})")
        tmp_sidecar.write_text(_sha256_file(tmp) + "\n")
        # Library first: a crash between the two leaves a mismatched sidecar, which the next
        # caller detects and rebuilds.
        os.replace(tmp, entry)
        os.replace(tmp_sidecar, _sidecar(entry))
    finally:
        for leftover in (tmp, tmp_sidecar):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def build_cached(name: str, key: Mapping[str, str], build: Callable[[Path], None],
                 cache_dir: Path | None = None) -> Path:
    """Return the path of the cached library ``name`` for ``key``, building it if needed.

    ``build(out_path)`` must write the library to ``out_path`` (a temporary file in the cache
    directory, already created empty; its suffix is that of ``name``) or raise. It runs at
    most once per (name, key) however many processes ask at the same time, and again only if
    the entry is found missing or corrupt. ``cache_dir`` defaults to :func:`cache_root`.

    Raises BuildError when the cache directory is unsafe (owned by someone else or writable
    by group/others) or cannot be created, or when ``build`` leaves no output; exceptions
    raised by ``build`` propagate unchanged and leave no entry behind.
    """
    root = _secure_dir(Path(cache_dir) if cache_dir is not None else cache_root())
    entry = entry_path(name, key, root)
    if verify_entry(entry):
        return entry
    with _locked(_lockfile(entry)):
        if verify_entry(entry):  # built by another process while we waited
            return entry
        _build_into(entry, build)
    return entry


def files_digest(paths: Sequence[Path]) -> str:
    """sha256 over files' names and contents, in the given order (a cache-key part)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def run_compiler(cmd: list[str], what: str) -> str:
    """Run a compiler command; its output on success, BuildError with the last 40 lines if not."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BuildError(f"cannot run {cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n  {' '.join(cmd)}\n{tail}")
    return proc.stdout + proc.stderr


def missing_executable(where: str, path: Path | None) -> str | None:
    """Why a compiler candidate found through ``where`` is unusable, for the "looked in" list
    of a not-found error; None when ``path`` is an executable file."""
    if path is None:
        return f"{where} (not set)" if where.startswith("$") else f"{where} (none)"
    if not (path.is_file() and os.access(path, os.X_OK)):
        return f"{where} ({path}: not found)"
    return None
