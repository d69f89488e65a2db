"""WriteQueue's agreement across ranks, with the all-reduce played by the test.

The spawned-rank tests (tests/distributed) show the protocol end to end over gloo; these pin
down what one rank does with each verdict, and that no host slot is released twice."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore.errors import ControllerUnusable, RanksFailed, TransferFailed
from kvcore.pools import SlotAllocator
from kvcore.write_queue import ACK_WINDOW, Health, WriteQueue

PAGE = 4


class Event:
    def __init__(self, done: bool = True) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class Member(Event):
    """One pool-group member's submission, as the queue sees it."""

    def check(self) -> None:
        pass


class Failing(Member):
    def check(self) -> None:
        raise RuntimeError("the kernel refused an index")


class Rounds:
    """Rank 0 of 2; the peer's statuses are what the test says."""

    rank, world = 0, 2

    def __init__(self) -> None:
        self.broken: RanksFailed | None = None
        self.lose: RanksFailed | None = None  # the next round fails with this
        self.peer: list[int] = [2] * ACK_WINDOW  # completed everything
        self.sent: list[list[int]] = []

    def min_each(self, values: list[int]) -> list[int]:
        self.sent.append(list(values))
        if self.lose is not None:
            self.broken = self.lose
            raise self.broken
        return [min(a, b) for a, b in zip(values, self.peer, strict=True)]


def _queue() -> tuple[WriteQueue, SlotAllocator, Rounds]:
    alloc = SlotAllocator(16 * PAGE, PAGE)
    rounds = Rounds()
    return WriteQueue(alloc, None, Health(), rounds), alloc, rounds


def _write(q: WriteQueue, alloc: SlotAllocator, event: Any = None,
           completions: list[Any] | None = None) -> Any:
    h = alloc.alloc(PAGE)
    return q.add(h, torch.arange(PAGE), event if event is not None else Event(),
                 completions or [], True)


def test_a_write_a_peer_failed_is_released_once_its_copy_here_finished() -> None:
    q, alloc, rounds = _queue()
    free = alloc.available_size()
    _write(q, alloc)
    running = Event(done=False)
    _write(q, alloc, event=running)
    rounds.peer[1] = 1 - 2  # rank 1 failed write 1
    with pytest.raises(TransferFailed, match=r"^write-back 1 failed at completion on rank 1 "):
        q.drain(block=False)
    assert alloc.available_size() == free - 2 * PAGE, "still copying here: slots kept"
    running.done = True
    assert q.drain(block=False)[0].id == 0  # write 0, agreed in the failing poll, comes now
    assert alloc.available_size() == free - PAGE, "write 1's slots released, write 0's kept"
    assert (len(q), q.completed) == (0, 1)


def test_a_write_is_acknowledged_only_once_every_members_transfer_completed() -> None:
    """The queue's event is the last member's; an earlier member's copy may complete on
    another stream (a library's copy stream) after it."""
    alloc = SlotAllocator(16 * PAGE, PAGE)
    q = WriteQueue(alloc, None, Health())
    first = Member(done=False)
    _write(q, alloc, completions=[first, Member()])  # the last member's event: done
    assert q.drain(block=False) == []
    first.done = True
    assert [a.id for a in q.drain(block=False)] == [0]


def test_a_write_a_peer_failed_keeps_its_slots_while_any_member_still_copies() -> None:
    q, alloc, rounds = _queue()
    free = alloc.available_size()
    first = Member(done=False)
    _write(q, alloc, completions=[first, Member()])
    rounds.peer[0] = 1 - 2  # rank 1 failed write 0
    with pytest.raises(TransferFailed, match=r"^write-back 0 failed at completion on rank 1 "):
        q.drain(block=False)
    assert alloc.available_size() == free - PAGE, "member 0 still copying: slots kept"
    first.done = True
    assert q.drain(block=False) == []
    assert alloc.available_size() == free


def test_a_lost_group_waits_for_every_members_copy_before_releasing_slots() -> None:
    q, alloc, rounds = _queue()
    free = alloc.available_size()
    first = Member(done=False)
    _write(q, alloc, completions=[first, Member()])
    rounds.lose = RanksFailed("acknowledgement round 1 failed on rank 0 of 2: gone", {},
                                [1])
    with pytest.raises(RanksFailed):
        q.drain(block=False)
    assert first.done, "member 0's copy was waited for"
    assert alloc.available_size() == free


def test_a_group_lost_after_a_local_failure_releases_every_slot_once() -> None:
    q, alloc, rounds = _queue()
    free = alloc.available_size()
    _write(q, alloc, completions=[Failing()])
    _write(q, alloc)
    rounds.lose = RanksFailed("acknowledgement round 1 failed on rank 0 of 2: gone", {},
                                [1])
    with pytest.raises(RanksFailed):
        q.drain(block=True)  # the failed write's slots were freed here, then the group lost
    assert alloc.available_size() == free, "both writes' slots released, none twice"
    with pytest.raises(ControllerUnusable, match="process group can no longer agree"):
        q.drain(block=False)


def test_a_window_reports_failed_pending_and_completed_by_write_id() -> None:
    q, alloc, rounds = _queue()
    _write(q, alloc)
    _write(q, alloc, completions=[Failing()])
    _write(q, alloc)
    _write(q, alloc, event=Event(done=False))
    _write(q, alloc)  # after a running one: pending
    rounds.peer = [1] * ACK_WINDOW  # the peer has completed nothing yet
    with pytest.raises(TransferFailed, match=r"this is rank 0.*the kernel refused"):
        q.drain(block=False)
    sent = rounds.sent[-1]
    assert sent[:5] == [2, -2, 2, 1, 1] and set(sent[5:]) == {1}


def test_a_write_holds_its_index_tensors_until_its_completion_was_seen() -> None:
    """The controller does not record a write's index tensors on its transfer stream: the
    queue must keep them alive (their memory unreusable) until the write completed."""
    import gc
    import weakref

    alloc = SlotAllocator(16 * PAGE, PAGE)
    queue = WriteQueue(alloc, None, Health())
    event = Event(done=False)
    h = alloc.alloc(2 * PAGE)
    d = torch.randperm(64)[:2 * PAGE]
    refs = [weakref.ref(h), weakref.ref(d)]
    queue.add(h, d, event, [], owns_host=True)
    del h, d
    gc.collect()
    assert queue.drain(block=False) == []
    assert all(r() is not None for r in refs)
    event.done = True
    (ack,) = queue.drain(block=False)
    assert ack.host_indices is refs[0]() and ack.device_indices is refs[1]()
    del ack
    gc.collect()
    assert all(r() is None for r in refs)
