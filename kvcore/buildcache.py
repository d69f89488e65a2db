"""A per-user cache of natively built libraries (vendor-free; used by kvio_cuda, kvio_rocm).

A library is identified by a ``name`` and a ``key``: a mapping of strings that determines
its bytes (source hash, target architecture, compiler version, flags...). The entry's file
name is derived from a sha256 of both, so a changed key is a new entry, never a stale hit.

Guarantees:

- The cache directory belongs to the current user and is not writable by group or others
  (anything else is refused: a library loaded from a directory others can write to runs
  their code in our process). Every folder above it belongs to the user or to root and is
  not writable by group or others unless sticky (``/tmp``), so no one else can rename a
  component of the path under us. Missing folders, the cache's parents included, are created
  with mode 0o700 whatever the process umask. The path is used with its symlinks resolved,
  once, when it is checked.
- Builds happen under an exclusive ``fcntl.flock`` on ``<entry>.lock``; the result is
  written to a temporary file in the same directory and moved into place with
  ``os.replace``, so readers see either no entry or a whole one, and a library already
  loaded by another process is never modified under it.
- A sidecar ``<entry>.sha256`` records the library's sha256, checked before an entry is
  returned; a truncated or corrupt entry (or one without its sidecar) is rebuilt.
- Many processes asking at once build exactly once: the entry is checked again after the
  lock is taken.
- :func:`load_library` loads an entry through the file descriptor it verified: the entry is
  opened with ``O_NOFOLLOW`` (a symlink is refused), must be a regular file of the user not
  writable by group or others, its sha256 is computed from that descriptor and compared with
  the sidecar, and the dynamic loader maps that same open file (``/proc/self/fd/N``), so a
  file swapped in after the check is never what runs.
"""

from __future__ import annotations

import contextlib
import ctypes
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

__all__ = ["build_cached", "cache_root", "entry_path", "load_library", "verify_entry"]

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


def _sha256_fd(fd: int) -> str:
    """sha256 of the whole file behind ``fd``, read from its start (the offset is kept)."""
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _CHUNK, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def _read_private(path: Path) -> bytes:
    """The bytes of ``path``, refusing a symlink or a file others may write."""
    fd = _open_private(path)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def _open_private(path: Path, root_may_own: bool = False) -> int:
    """``path`` opened read-only without following a symlink; it must be a regular file of
    the current user (or of root, with ``root_may_own``: installed package files) that group
    and others cannot write. Raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_uid != os.getuid() and not (root_may_own and st.st_uid == 0):
            raise OSError(f"{path} is owned by uid {st.st_uid}, not by uid {os.getuid()}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise OSError(f"{path} is writable by group or others "
                          f"(mode {stat.S_IMODE(st.st_mode):#o})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_verified(entry: Path, sha256: str | None = None) -> int:
    """A descriptor of ``entry`` whose contents match its sidecar, or ``sha256`` where given
    (a library installed with its hash in a manifest, which root may own; see
    :func:`_open_private`); OSError or ValueError with the reason otherwise."""
    recorded = (sha256 if sha256 is not None
                else _read_private(_sidecar(entry)).decode("ascii").strip())
    fd = _open_private(entry, root_may_own=sha256 is not None)
    try:
        if not recorded or _sha256_fd(fd) != recorded:
            raise ValueError(f"{entry} does not match its recorded sha256")
    except BaseException:
        os.close(fd)
        raise
    return fd


def verify_entry(entry: Path) -> bool:
    """True when ``entry`` and its sidecar exist, are regular files of the current user (not
    symlinks, not writable by group or others) and the file's sha256 matches the sidecar."""
    try:
        os.close(_open_verified(entry))
        return True
    except (OSError, ValueError):
        return False


def load_library(entry: Path, sha256: str | None = None) -> ctypes.CDLL:
    """Load the cached library ``entry`` (a path :func:`build_cached` returned) with ctypes,
    mapping exactly the file that was verified. ``sha256``: a library that is not in the
    cache (a wheel's prebuilt one) with the hash its manifest recorded.

    The file is opened once with ``O_NOFOLLOW``, checked (regular, the user's own, not
    writable by group or others, sha256 equal to the recorded one) and handed to the dynamic
    loader as ``/proc/self/fd/N``, the same open file: replacing the entry or a symlink on
    its path after the check changes nothing that is loaded. Raises BuildError on any
    failed check or a failed load.
    """
    entry = Path(entry)
    try:
        fd = _open_verified(entry, sha256)
    except (OSError, ValueError) as exc:
        raise BuildError(f"refusing to load {entry}: {exc} (a symlink, a file others can "
                         f"write, or one changed since it was built; it is rebuilt on next "
                         f"use if removed)") from exc
    try:
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise BuildError(f"cannot load {entry}: {exc}") from exc
    finally:
        os.close(fd)


def _make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parent, each with mode 0o700 (not the umask's)."""
    missing = []
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, _DIR_MODE)
        except FileExistsError:
            continue  # made by a racing process: checked below like any existing folder
        os.chmod(p, _DIR_MODE)


def _check_parents(path: Path) -> None:
    """Refuse ``path`` (resolved) unless every folder above it belongs to the user or root
    and is not writable by group or others, or is sticky (like /tmp)."""
    uid = os.getuid()
    for parent in path.parents:
        st = os.lstat(parent)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (uid, 0):
            raise BuildError(f"build cache directory {path} lies under {parent}, owned by uid "
                             f"{st.st_uid} (neither you, uid {uid}, nor root); refusing to load "
                             f"native code from it. Set {CACHE_DIR_ENV} to a directory of your "
                             f"own")
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
            raise BuildError(f"build cache directory {path} lies under {parent}, mode "
                             f"{mode:#o} (writable by group or others, not sticky): others "
                             f"could swap the path. Set {CACHE_DIR_ENV} to a directory of "
                             f"your own")


def _secure_dir(path: Path) -> Path:
    """Create ``path`` (mode 0o700, parents too) if needed and refuse it unless it is a
    directory owned by the current user and not writable by group or others, under folders
    no one else can change (see :func:`_check_parents`). Returns it with symlinks resolved."""
    path = Path(os.path.abspath(path))
    try:
        _make_private_dirs(path)
        real = path.resolve(strict=True)
    except OSError as exc:
        raise BuildError(f"cannot create the build cache directory {path}: {exc}; "
                         f"set {CACHE_DIR_ENV} to a directory of your own") from exc
    st = os.lstat(real)
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
    _check_parents(real)
    return real


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
        os.chmod(tmp, 0o700)  # the compiler made it with the umask's mode: the user's only
        fd = os.open(tmp_sidecar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(_sha256_file(tmp) + "\n")
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


def run_compiler(cmd: list[str], what: str, tmpdir: Path | None = None) -> str:
    """Run a compiler command; its output on success, BuildError with the last 40 lines if not.
    ``tmpdir``: the compiler's TMPDIR (its intermediate files), else the environment's."""
    env = None if tmpdir is None else {**os.environ, "TMPDIR": str(tmpdir)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
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
