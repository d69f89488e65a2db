"""Transfers whose completion the native library tracks: issued on its own thread
(``kvio_write_back_staged_async``), or by the caller with work on a stream of the library's
own (``kvio_write_back_staged_after``).

For the thread, the caller's thread only checks the arguments and hands the transfer over;
a library thread makes the runtime calls (dozens for a large staged write-back). A
:class:`NativeJob` is such a transfer's completion: it is what the submission's event is for
a synchronous transfer (``query``/``synchronize``) and its completion check in one
(``check``).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from kvcore.native_abi import JOB_PENDING

_flushed_at_exit: set[int] = set()
_flush_lock = threading.Lock()


def flush_at_exit(lib: Any) -> None:
    """Make sure ``lib``'s thread has issued every job before the interpreter exits (the
    runtime is torn down after that; a job issued then would touch freed state)."""
    with _flush_lock:
        if id(lib) in _flushed_at_exit:
            return
        _flushed_at_exit.add(id(lib))
    atexit.register(lib.jobs_flush)


class NativeJob:
    """One transfer the library reports on through a job handle (``function``: the call
    that made it, ``kvio_write_back_staged_async`` or ``kvio_write_back_staged_after``).

    ``query()`` is True once the job has finished: issued and completed, or failed.
    ``synchronize()`` blocks until then. ``check()`` raises what failed it: the library's
    error (KernelError), or the kernels' report of an out-of-range device index
    (InvalidIndices, from ``done``). ``keep`` holds what the transfer reads (indices,
    staging buffer) until it finished. Dropped unfinished, a job is waited for: the transfer
    must never outlive the memory it reads and writes.
    """

    __slots__ = ("_done", "_function", "_handle", "_keep", "_lib", "_status")

    def __init__(self, lib: Any, handle: int, done: Any, keep: tuple[Any, ...],
                 function: str = "kvio_write_back_staged_async") -> None:
        self._lib = lib
        self._function = function
        self._handle: int | None = handle
        self._done = done
        self._keep: tuple[Any, ...] | None = keep
        self._status: int | None = None

    def _settle(self, status: int) -> None:
        if status == JOB_PENDING:
            return
        self._status = status
        handle, self._handle, self._keep = self._handle, None, None
        if handle is not None:
            self._lib.job_release(handle)

    def query(self) -> bool:
        if self._status is None and self._handle is not None:
            self._settle(self._lib.job_status(self._handle))
        return self._status is not None

    def synchronize(self) -> None:
        if self._status is None and self._handle is not None:
            self._settle(self._lib.job_wait(self._handle))

    def check(self) -> None:
        self.synchronize()
        if self._status:
            self._lib.check(self._function, self._status)
        self._done.check()

    def __del__(self) -> None:
        if self._handle is None:
            return
        try:
            self.synchronize()  # dropped unfinished (its controller was)
        except Exception:  # noqa: BLE001 - nothing to report to at collection
            pass
