"""Write-backs from submission to acknowledgement: what ``poll_acks``/``wait_acks`` drain.

A :class:`WriteQueue` holds the controller's queued write-backs in submission order. A write is
acknowledged only after its stream work completed and its completions checked. One that
failed is never acknowledged, and the host slots it owns are released once nothing copies
into them any more.

With a process group (tensor parallelism) the ranks agree on every write by its id. The ids
agree across ranks because the ranks issue the same writes in the same order. Each drain
all-reduces (MIN, :class:`~kvcore.distributed.AckAgreement`) every queued write's status
here: completed, pending, or failed on rank r. A write is acknowledged once it completed on
every rank. Once it failed on any rank, it is dropped on all of them: never acknowledged, its
slots released after its copy here finished, and the same TransferFailed raised on every
rank in that drain (the writes agreed complete in that drain come with the next).

:class:`Health` is the controller's one record of whether it can still be used: a device
fault, or a process group that can no longer agree.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from kvcore.errors import ControllerUnusable, DeviceFault, RanksFailed, TransferFailed
from kvcore.handles import PendingWrite, WriteAck
from kvcore.pools import SlotAllocator
from kvcore.streams import synchronize_quietly

#: write statuses in an acknowledgement round (a failure is sent as rank - world, below 0)
_OK, _PENDING, _FAILED = 2, 1, 0
#: writes one round decides on, from the oldest undecided one
ACK_WINDOW = 64


class Health:
    """Whether the controller can still be used, and why not."""

    def __init__(self) -> None:
        self.lost: BaseException | None = None

    def record(self, exc: BaseException) -> None:
        """Note ``exc`` if it means the device is lost (a fault no later call can undo)."""
        if isinstance(exc, DeviceFault) or type(exc).__name__ == "AcceleratorError":
            self.lost = exc

    def check(self, detail: str = "") -> None:
        """Raise ControllerUnusable if the controller was lost."""
        if self.lost is not None:
            what = ("its process group can no longer agree" if isinstance(self.lost, RanksFailed)
                    else "a device fault")
            raise ControllerUnusable(
                f"the controller is unusable after {what}: {self.lost}{detail}; recreate it "
                "(and the device context or process group) to continue")


class WriteQueue:
    """The queued write-backs of one controller (see the module docstring).

    ``rounds`` is the process group's :class:`~kvcore.distributed.AckAgreement`, or None for
    a single rank. The controller holds its lock around every call.
    """

    def __init__(self, allocator: SlotAllocator, write_stream: Any, health: Health,
                 rounds: Any = None) -> None:
        self.allocator = allocator
        self.write_stream = write_stream
        self.health = health
        self.rounds = rounds
        self.completed = 0  # writes acknowledged so far
        self._pending: collections.deque[PendingWrite] = collections.deque()
        self._doomed: list[PendingWrite] = []  # failed on a peer, still copying here
        self._marks: np.ndarray | None = None  # holding()'s page marks, all False between calls
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, host_indices: Any, device_indices: Any, event: Any, completions: list[Any],
            owns_host: bool) -> WriteAck:
        """Queue a submitted write; return its (pending) acknowledgement."""
        ack = WriteAck(self._next_id, host_indices, device_indices)
        self._next_id += 1
        self._pending.append(PendingWrite(ack, event, completions, owns_host))
        return ack

    def holding(self, pages: np.ndarray) -> str | None:
        """Why some of these host pages must not be freed: the first queued write-back (not
        acknowledged yet) whose host pages include one of them, or None. Host indices a
        caller gave on the device are not looked at (reading them would wait for it).

        One lookup against every queued write's pages together (each write's read once): a
        free_host with a hundred writes in flight costs tens of microseconds more, not one
        lookup per write (about 30 us each). ``pages`` are in range (the allocator's)."""
        page_size = self.allocator.page_size
        queued = []
        held = []
        for p in (*self._pending, *self._doomed):
            if p.host_pages is None:
                h = p.ack.host_indices
                if not h.is_cpu:
                    continue
                p.host_pages = h.numpy()[::page_size] // page_size
            queued.append(p)
            held.append(p.host_pages)
        if not held:
            return None
        # a mark per page this queue holds, cleared again at once (np.isin cost 20-80 us)
        if self._marks is None:
            self._marks = np.zeros(self.allocator.num_pages, dtype=np.bool_)
        marks, every = self._marks, np.concatenate(held) if len(held) > 1 else held[0]
        every = every[(every >= 0) & (every < marks.size)]  # (a caller's tensor, changed since)
        marks[every] = True
        hit = np.flatnonzero(marks[pages])
        marks[every] = False
        if not hit.size:
            return None
        page = int(pages[hit[0]])
        first = next(p for p, h in zip(queued, held, strict=True) if page in h)
        return (f"{self.allocator.describe_page(page)} is written by write-back "
                f"{first.ack.id}, not acknowledged yet (free an ack's pages once "
                "poll_acks() or wait_acks() returned it)")

    def drain(self, block: bool) -> list[WriteAck]:
        """The writes acknowledged now, in submission order (``block``: wait for every queued
        write first)."""
        if self.rounds is not None:
            return self._drain_agreed(block)
        if self.health.lost is not None:
            finished = self._take_finished()
            if finished:  # completed and checked before the fault: their pages are backed up
                return self._acknowledge(finished)
            self._abandon()
        done: list[PendingWrite] = []
        while self._pending:
            p = self._pending[0]
            try:
                if block:
                    if p.event is not None:
                        p.event.synchronize()
                elif not p.finished():
                    break
                self._pending.popleft()
                for c in p.completions:
                    c.check()
            except Exception as exc:
                if self._pending and self._pending[0] is p:
                    self._pending.popleft()
                self._requeue(done)  # (first: what completed stays acknowledgeable)
                self.health.record(exc)
                if p.owns_host:
                    self.allocator.free(p.ack.host_indices)
                raise TransferFailed(
                    f"write-back {p.ack.id} failed at completion; its "
                    f"{p.ack.host_indices.numel()} host slots were released: {exc}", exc) from exc
            done.append(p)
        return self._acknowledge(done)

    def _acknowledge(self, done: list[PendingWrite]) -> list[WriteAck]:
        self.completed += len(done)
        return [p.ack for p in done]

    def _take_finished(self) -> list[PendingWrite]:
        """The writes at the front of the queue that already completed and were checked
        (requeued by a drain that then failed): nothing of them is left on the device."""
        finished = []
        while self._pending and self._pending[0].event is None \
                and not self._pending[0].completions:
            finished.append(self._pending.popleft())
        return finished

    def _requeue(self, done: list[PendingWrite]) -> None:
        """Completed writes drained before a failure are acknowledged by the next drain; they
        keep their ownership of the host slots (released if they are dropped after all)."""
        for p in reversed(done):
            self._pending.appendleft(PendingWrite(p.ack, None, [], p.owns_host))

    def _abandon(self) -> None:
        """After a device fault nothing queued can be trusted: release it all and refuse."""
        dropped = self._release_all()
        self.health.check(f"; {dropped} queued write-backs were dropped and their host "
                          "slots released" if dropped else "")

    def quiesce(self) -> None:
        """Block until every queued write-back, a library thread's not yet issued included,
        has stopped touching the pools, whatever its outcome (raises nothing); acknowledges
        nothing."""
        for p in (*self._pending, *self._doomed):
            p.wait_quietly()

    def _release_all(self) -> int:
        """Drop every queued write and release the host slots it owns; return how many."""
        dropped = 0
        while self._pending:
            p = self._pending.popleft()
            if p.owns_host and p.failed is None:  # a failed one's slots are already free
                self.allocator.free(p.ack.host_indices)
            dropped += 1
        return dropped

    # -- across ranks ------------------------------------------------------------------------

    def _drain_agreed(self, block: bool) -> list[WriteAck]:
        rounds = self.rounds
        if rounds.broken is not None:
            self._abandon_after_lost_group()
            self.health.check()
        self._reap_doomed(block)
        here = self._statuses_here(block)
        lo = self._pending[0].ack.id if self._pending else self._next_id
        mine = rounds.rank - rounds.world  # FAILED here, so that MIN names the lowest rank
        try:
            agreed = rounds.min_each([mine if here.get(lo + k) == _FAILED
                                      else here.get(lo + k, _PENDING)
                                      for k in range(ACK_WINDOW)])
        except RanksFailed:
            self._abandon_after_lost_group()
            raise
        acked: list[PendingWrite] = []
        failed: list[tuple[PendingWrite, int]] = []
        keep: collections.deque[PendingWrite] = collections.deque()
        for p in self._pending:
            k = p.ack.id - lo
            verdict = agreed[k] if k < ACK_WINDOW else _PENDING
            if verdict == _OK:
                acked.append(p)
            elif verdict < 0:
                failed.append((p, verdict + rounds.world))
                if p.failed is None:  # completed here, or still copying
                    self._doomed.append(p)
            else:
                keep.append(p)
        self._pending = keep
        self._reap_doomed(block=False)
        if failed:
            self._requeue(acked)
            raise TransferFailed(_failed_message(failed, rounds.rank),
                                 next((p.failed for p, _ in failed if p.failed), None))
        self.completed += len(acked)
        if self.health.lost is not None and not acked:
            self.health.check()
        return [p.ack for p in acked]

    def _statuses_here(self, block: bool) -> dict[int, int]:
        """Each queued write's status on this rank, in submission order (one still running
        makes the later ones pending). A write that failed here has its host slots released
        at once: its copy has finished (or the device is lost)."""
        here: dict[int, int] = {}
        running = False
        for p in self._pending:
            i = p.ack.id
            if p.failed is not None:
                here[i] = _FAILED
            elif p.event is None and not p.completions:
                here[i] = _OK  # checked by an earlier drain
            elif self.health.lost is not None:  # nothing more completes on a lost device
                self._fail_here(p, self.health.lost)
                here[i] = _FAILED
            elif running or (not block and not p.finished()):
                running = True
                here[i] = _PENDING
            else:
                try:
                    if p.event is not None:
                        p.event.synchronize()
                    for c in p.completions:
                        c.check()
                except Exception as exc:  # noqa: BLE001 - the write's outcome here
                    self.health.record(exc)
                    self._fail_here(p, exc)
                    here[i] = _FAILED
                    continue
                p.event, p.completions = None, []
                here[i] = _OK
        return here

    def _fail_here(self, p: PendingWrite, exc: BaseException) -> None:
        p.failed = exc
        if p.owns_host:
            self.allocator.free(p.ack.host_indices)

    def _reap_doomed(self, block: bool) -> None:
        """Release the host slots of writes a peer failed once their copy here finished."""
        still = []
        for p in self._doomed:
            if not block and not p.finished():
                still.append(p)
                continue
            p.wait_quietly()
            if p.owns_host:
                self.allocator.free(p.ack.host_indices)
        self._doomed = still

    def _abandon_after_lost_group(self) -> None:
        """The ranks can no longer agree: nothing queued will be acknowledged. The copies
        still running are waited for before their host slots are released (another
        controller may share the allocator), then the controller refuses every call."""
        if self.health.lost is None:
            self.health.lost = self.rounds.broken
        if self._pending or self._doomed:
            self.quiesce()  # (a transfer another thread issues included)
            synchronize_quietly(self.write_stream)
            self._pending.extend(self._doomed)
            self._doomed = []
            self._release_all()


def _failed_message(failed: list[tuple[PendingWrite, int]], rank: int) -> str:
    ids = ", ".join(str(p.ack.id) for p, _ in failed)
    ranks = sorted({r for _, r in failed})
    here = next((p.failed for p, _ in failed if p.failed is not None), None)
    where = ", ".join(f"rank {r}" for r in ranks)
    cause = f": {here}" if here is not None else ""
    return (f"write-back {ids} failed at completion on {where} (this is rank {rank}); it is "
            f"acknowledged on no rank and its host slots were released{cause}")
