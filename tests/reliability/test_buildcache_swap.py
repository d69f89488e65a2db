"""Issue 25, item 2: the build cache loads the file it verified, never one swapped in later.

A process checks its cache entry and then loads a library: an attacker (or a racing process)
who swaps a symlink in between must not get their library loaded. The swap is simulated by
monkeypatching the cache at the moment between its check and the load.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import ClassVar

import pytest

from kvcore import buildcache
from kvcore.errors import BuildError

KEY = {"source": "sha256:feed", "arch": "sm_90", "compiler": "cc"}
GOOD = b"\x7fELF the library we built " + bytes(range(256)) * 16
EVIL = b"\x7fELF someone else's library " + bytes(range(256)) * 16


def _writes(payload: bytes):
    def build(out: Path) -> None:
        out.write_bytes(payload)

    return build


def _swap_for_symlink(entry: Path, target: Path) -> None:
    """Replace ``entry`` atomically by a symlink to ``target`` (whose sidecar matches)."""
    link = entry.with_name(entry.name + ".swap")
    os.symlink(target, link)
    os.replace(link, entry)


class LoadedBytes:
    """Stands in for ctypes.CDLL: records the bytes the loader would map from ``path``."""

    loaded: ClassVar[list[bytes]] = []

    def __init__(self, path: str) -> None:
        LoadedBytes.loaded.append(Path(path).read_bytes())


def test_a_swap_between_check_and_load_loads_the_checked_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    entry = buildcache.build_cached("libswap.so", KEY, _writes(GOOD), cache)
    evil = tmp_path / "evil.so"
    evil.write_bytes(EVIL)
    real_open_verified = buildcache._open_verified

    def check_then_swap(path: Path, sha256: str | None = None) -> int:
        fd = real_open_verified(path, sha256)  # the check passed on the library we built ...
        _swap_for_symlink(entry, evil)  # ... and the entry is swapped right after it
        return fd

    monkeypatch.setattr(buildcache, "_open_verified", check_then_swap)
    monkeypatch.setattr(ctypes, "CDLL", LoadedBytes)
    LoadedBytes.loaded = []
    buildcache.load_library(entry)
    assert LoadedBytes.loaded == [GOOD]  # the verified file, not the swapped-in one


def test_a_symlinked_entry_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    entry = buildcache.build_cached("libswap.so", KEY, _writes(GOOD), cache)
    copy = tmp_path / "copy.so"
    shutil.copy(entry, copy)  # same bytes: the sidecar's sha256 matches through the link
    _swap_for_symlink(entry, copy)
    assert not buildcache.verify_entry(entry)
    monkeypatch.setattr(ctypes, "CDLL", LoadedBytes)
    LoadedBytes.loaded = []
    with pytest.raises(BuildError, match="refusing to load"):
        buildcache.load_library(entry)
    assert LoadedBytes.loaded == []
    # the next build_cached rebuilds a real file in its place
    again = buildcache.build_cached("libswap.so", KEY, _writes(GOOD), cache)
    assert again == entry and not entry.is_symlink() and buildcache.verify_entry(entry)


def test_an_entry_changed_after_it_was_built_is_refused(tmp_path: Path) -> None:
    entry = buildcache.build_cached("libswap.so", KEY, _writes(GOOD), tmp_path / "cache")
    entry.write_bytes(EVIL)
    with pytest.raises(BuildError, match="does not match its recorded sha256"):
        buildcache.load_library(entry)


def test_a_symlinked_cache_dir_is_resolved_once(tmp_path: Path) -> None:
    """The path handed back has no symlink in it, so re-pointing the link changes nothing."""
    real, other = tmp_path / "real", tmp_path / "other"
    real.mkdir(mode=0o700)
    other.mkdir(mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(real)
    entry = buildcache.build_cached("libswap.so", KEY, _writes(GOOD), link)
    assert entry.parent == real.resolve()
    link.unlink()
    link.symlink_to(other)
    assert buildcache.verify_entry(entry) and entry.read_bytes() == GOOD


def test_cache_parents_are_created_private_whatever_the_umask(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "b" / "kvcore"
    old = os.umask(0)
    try:
        buildcache.build_cached("libswap.so", KEY, _writes(GOOD), cache)
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", cache):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_cache_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        entry = buildcache.build_cached("libswap.so", KEY, _writes(GOOD), tmp_path / "c")
    finally:
        os.umask(old)
    for f in (entry, entry.with_name(entry.name + ".sha256")):
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, f


def test_a_parent_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    called = []
    with pytest.raises(BuildError, match=r"lies under .*shared.*0o777"):
        buildcache.build_cached("libswap.so", KEY, called.append, shared / "mine")
    assert called == []


def test_a_sticky_parent_is_accepted(tmp_path: Path) -> None:
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: others cannot rename what is ours
    entry = buildcache.build_cached("libswap.so", KEY, _writes(GOOD), sticky / "mine")
    assert buildcache.verify_entry(entry)


_SOURCE = "int kvcore_swap_answer(void) { return %d; }\n"


def test_a_real_library_swapped_after_the_check_is_not_the_one_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race with real shared objects and the real dynamic loader."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") \
        or shutil.which("clang-19")
    if cc is None:
        pytest.skip("no C compiler to build the two shared objects")

    def compile_to(out: Path, answer: int) -> None:
        src = tmp_path / f"answer{answer}.c"
        src.write_text(_SOURCE % answer)
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)

    entry = buildcache.build_cached("libanswer.so", KEY, lambda out: compile_to(out, 42),
                                    tmp_path / "cache")
    evil = tmp_path / "evil.so"
    compile_to(evil, 666)
    real_open_verified = buildcache._open_verified

    def check_then_swap(path: Path, sha256: str | None = None) -> int:
        fd = real_open_verified(path, sha256)
        _swap_for_symlink(entry, evil)
        return fd

    monkeypatch.setattr(buildcache, "_open_verified", check_then_swap)
    lib = buildcache.load_library(entry)
    assert lib.kvcore_swap_answer() == 42
    monkeypatch.undo()
    with pytest.raises(BuildError, match="refusing to load"):  # the link itself: refused
        buildcache.load_library(entry)
