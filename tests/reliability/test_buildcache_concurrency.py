"""The kernel build cache (kvcore.buildcache) under concurrent first use and tampering.

The build is a stand-in for nvcc/hipcc: a Python function that sleeps, counts itself in a
file and writes bytes. Eight processes start at once (behind a barrier) asking for the same
entry: exactly one builds, all eight get the same path and bytes.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcore.buildcache import build_cached, entry_path, verify_entry
from kvcore.errors import BuildError

RANKS = 8
KEY = {"source": "sha256:0123", "arch": "sm_90", "compiler": "nvcc 13.0"}
LIBRARY = b"\x7fELF stand-in library " + bytes(range(256)) * 64


def stand_in_build(counter: Path, payload: bytes = LIBRARY,
                   delay_s: float = 0.3) -> Callable[[Path], None]:
    """A build function: sleeps (so racing processes overlap), counts the build, writes."""

    def build(out: Path) -> None:
        time.sleep(delay_s)
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
        out.write_bytes(payload)

    return build


def builds(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def _rank(cache: str, counter: str, barrier: mp.synchronize.Barrier, results: mp.Queue) -> None:
    barrier.wait()
    try:
        path = build_cached("libkvio_test.so", KEY, stand_in_build(Path(counter)), Path(cache))
        results.put((os.getpid(), str(path), hashlib.sha256(path.read_bytes()).hexdigest()))
    except Exception as exc:  # noqa: BLE001 - reported, so the parent fails with the reason
        results.put((os.getpid(), "error", repr(exc)))


def race(cache: Path, counter: Path) -> list[tuple[int, str, str]]:
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(RANKS), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(cache), str(counter), barrier, results))
             for _ in range(RANKS)]
    for p in procs:
        p.start()
    out = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def test_eight_ranks_at_once_build_once_and_load_the_same_file(tmp_path: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "builds.log"
    out = race(cache, counter)
    assert [r for r in out if r[1] == "error"] == []
    assert builds(counter) == 1
    paths = {r[1] for r in out}
    digests = {r[2] for r in out}
    assert len(paths) == 1 and len(digests) == 1
    assert digests == {hashlib.sha256(LIBRARY).hexdigest()}
    assert len({r[0] for r in out}) == RANKS  # eight distinct processes
    entry = Path(paths.pop())
    assert verify_entry(entry)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    # no temporary files left behind by the build or the losers of the race
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [entry.name, entry.name + ".sha256", entry.name + ".lock"])


def test_eight_ranks_rebuild_a_corrupt_entry_once(tmp_path: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "builds.log"
    entry = build_cached("libkvio_test.so", KEY, stand_in_build(counter, delay_s=0), cache)
    entry.write_bytes(LIBRARY[:100])  # truncated by a crash or a full disk
    out = race(cache, counter)
    assert builds(counter) == 2
    assert {r[2] for r in out} == {hashlib.sha256(LIBRARY).hexdigest()}


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_sidecar", "bad_sidecar"])
def test_a_damaged_entry_is_detected_and_rebuilt(tmp_path: Path, damage: str) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "builds.log"
    build = stand_in_build(counter, delay_s=0)
    entry = build_cached("libkvio_test.so", KEY, build, cache)
    assert build_cached("libkvio_test.so", KEY, build, cache) == entry
    assert builds(counter) == 1  # a valid entry is reused
    sidecar = entry.with_name(entry.name + ".sha256")
    if damage == "truncate":
        entry.write_bytes(entry.read_bytes()[:-1])
    elif damage == "flip":
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0x01
        entry.write_bytes(bytes(data))
    elif damage == "drop_sidecar":
        sidecar.unlink()
    else:
        sidecar.write_text("0" * 64 + "\n")
    assert not verify_entry(entry)
    assert build_cached("libkvio_test.so", KEY, build, cache) == entry
    assert builds(counter) == 2
    assert entry.read_bytes() == LIBRARY and verify_entry(entry)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_cache_dir_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "builds.log"
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(BuildError, match="writable by group or others"):
        build_cached("libkvio_test.so", KEY, stand_in_build(counter, delay_s=0), cache)
    assert builds(counter) == 0
    assert list(cache.iterdir()) == []


def test_the_cache_dir_is_created_private(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "kvcore"
    build_cached("libkvio_test.so", KEY, stand_in_build(tmp_path / "n", delay_s=0), cache)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "builds.log"

    def broken(out: Path) -> None:
        out.write_bytes(b"half a library")
        raise BuildError("nvcc: exit status 1")

    with pytest.raises(BuildError, match="exit status 1"):
        build_cached("libkvio_test.so", KEY, broken, cache)
    entry = entry_path("libkvio_test.so", KEY, cache)
    assert not entry.exists()
    assert [p.name for p in cache.iterdir()] == [entry.name + ".lock"]
    assert build_cached("libkvio_test.so", KEY, stand_in_build(counter, delay_s=0),
                        cache) == entry
    assert builds(counter) == 1


def test_a_changed_key_is_a_new_entry(tmp_path: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "builds.log"
    build = stand_in_build(counter, delay_s=0)
    a = build_cached("libkvio_test.so", KEY, build, cache)
    b = build_cached("libkvio_test.so", {**KEY, "arch": "sm_100"}, build, cache)
    assert a != b and builds(counter) == 2
