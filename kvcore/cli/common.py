"""Checks every ``kvio`` command makes before it does any work, each a one-line typed error.

Options are checked when they are read, not when they are first used: a report path into a
missing folder fails before a sweep starts, a size that cannot fit in memory fails before
anything is allocated, and a device this machine does not have fails before a stream or a
pool is made for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import torch

from kvcore.errors import InvalidArgument, NoBackend, PluginLoadError
from kvcore.registry import ENTRY_POINT_GROUP, Registry, undeclared_plugins
from kvcore.streams import resolve_device


def default_device() -> torch.device:
    """The current accelerator if torch has one, else the CPU."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return resolve_device(acc.type) if acc else torch.device("cpu")


def parse_device(value: str | None, option: str = "--device",
                 must_exist: bool = True) -> torch.device:
    """The torch device ``value`` names, refused unless this machine has it (``must_exist``;
    without it, any device torch can name: a question about another machine); None gives
    the accelerator if there is one, else the CPU."""
    if value is None:
        return default_device()
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise InvalidArgument(option, "a torch device such as cpu or cuda:0",
                              repr(value)) from None
    if device.type == "cpu" or not must_exist:
        return device
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    try:
        present = bool(is_available()) if callable(is_available) else False
    except Exception:  # noqa: BLE001 - a broken driver is a missing device here
        present = False
    if not present:
        raise InvalidArgument(option, f"a device this machine has ({_present()})",
                              f"{value!r}: torch sees no {device.type} device here")
    count = getattr(module, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise InvalidArgument(option, f"a device this machine has ({_present()})",
                              f"{value!r}: only {count()} {device.type} device(s)")
    return device


def _present() -> str:
    names = ["cpu"]
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            names += [f"{acc.type}:{i}" for i in range(torch.accelerator.device_count())]
    return ", ".join(names)


def check_output_path(option: str, path: str | os.PathLike[str] | None) -> None:
    """Refuse a report file whose folder is missing or is not a writable folder ('-' is
    stdout)."""
    if path is None or str(path) == "-":
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise InvalidArgument(option, "a file path", f"{str(path)!r}, a directory")
    if not folder.is_dir():
        raise InvalidArgument(option, "a file in an existing folder",
                              f"{str(path)!r} (no folder {str(folder)!r})")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgument(option, "a file in a folder you can write",
                              f"{str(path)!r} (folder {str(folder)!r} is not writable)")


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new allocations on ``device`` (host RAM for the CPU), or None when it
    cannot be told."""
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        mem_get_info = getattr(module, "mem_get_info", None)
        try:
            return int(mem_get_info(device)[0]) if callable(mem_get_info) else None
        except Exception:  # noqa: BLE001 - unknown is not refused
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_fits(option: str, what: str, needs: dict[torch.device, int]) -> None:
    """Refuse before allocating when ``needs`` (bytes per device; the CPU's includes host
    memory) exceeds what is free."""
    for device, need in needs.items():
        free = available_memory(device)
        if free is not None and need > free:
            where = "host memory" if device.type == "cpu" else f"{device} memory"
            raise InvalidArgument(option, f"sizes that fit in {where} ({_gib(free)} free)",
                                  f"{what} needing at least {_gib(need)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def require_backend(registry: Registry, name: str, argument: str) -> None:
    """Refuse, in one line, a backend ``name`` (given as ``argument``) that is not installed
    or did not load."""
    try:
        registry.get(name)
    except NoBackend:
        known = ", ".join(r.name for r in registry.backends()) or "none"
        unseen = undeclared_plugins(name)
        hint = (f"; installed but not declared under the {ENTRY_POINT_GROUP!r} entry-point "
                f"group: {'; '.join(unseen)}" if unseen else "")
        raise InvalidArgument(argument, f"the name of an installed backend ({known})",
                              repr(name) + hint) from None
    except PluginLoadError as exc:
        raise PluginLoadError(f"{argument}={name}: {str(exc).splitlines()[0]}",
                              plugin_traceback=exc.plugin_traceback) from exc


def check_time_limit(seconds: float | None, option: str = "--time-limit") -> None:
    """Refuse a time limit that is not a positive number of seconds (0 or less would run
    nothing, NaN would mean no limit)."""
    if seconds is not None and not seconds > 0:  # (NaN too)
        raise InvalidArgument(option, "a positive number of seconds", str(seconds))


def check_forced_backend(registry: Registry, environ: dict[str, str] | None = None) -> None:
    """Refuse a KVCORE_BACKEND that names no backend that loaded, in one line."""
    env = os.environ if environ is None else environ
    name = env.get("KVCORE_BACKEND", "").strip()
    if name:
        require_backend(registry, name, "KVCORE_BACKEND")


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM (``timeout``, a job scheduler) into KeyboardInterrupt while measuring, so
    what was measured so far is still reported."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
