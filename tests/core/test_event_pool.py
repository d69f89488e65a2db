"""EventPool records an event again only once nothing but the pool holds it (no GPU needed:
the events are stand-ins that log their records)."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import torch

from kvcore.plan import Submission
from kvcore.streams import EventPool, recorded_event


class Event:
    made = 0

    def __init__(self) -> None:
        Event.made += 1
        self.records: list[Any] = []

    def record(self, stream: Any) -> None:
        self.records.append(stream)


def _pool(size: int = 64) -> EventPool:
    Event.made = 0
    return EventPool(Event, size)


def test_an_event_nothing_holds_is_recorded_again_instead_of_a_new_one() -> None:
    pool = _pool()
    first = pool.recorded("s1")
    first_id = id(first)
    assert first.records == ["s1"]
    del first
    again = pool.recorded("s2")
    assert id(again) == first_id and Event.made == 1
    assert again.records == ["s1", "s2"]  # the same event, recorded on the new stream


def test_an_event_anything_still_holds_is_never_recorded_again() -> None:
    pool = _pool()
    in_a_list = [pool.recorded(0)]
    in_a_dict = {"e": pool.recorded(1)}
    held_by_a_submission = Submission({}, pool.recorded(2), [])
    waits_of_a_load = Submission({0: pool.recorded(3), 1: pool.recorded(4)}, None, [])
    as_a_local = pool.recorded(5)
    held = [in_a_list[0], in_a_dict["e"], held_by_a_submission.event, as_a_local]
    held += [waits_of_a_load._waits[layer] for layer in waits_of_a_load.layers]
    held_ids = {id(e) for e in held}
    del held
    for n in range(20):
        event = pool.recorded(100 + n)
        assert id(event) not in held_ids
        del event  # (free again: the next call may take it)
    assert all(len(e.records) == 1 for e in (in_a_list[0], in_a_dict["e"],
                                            held_by_a_submission.event, as_a_local))
    # the six held, and fewer than one per later call: freed events came round again (each
    # call looks at the two oldest only, so a few were made while held ones were in front)
    assert Event.made < 6 + 20


def test_the_pool_keeps_at_most_its_size_and_still_hands_out_events() -> None:
    pool = _pool(size=4)
    held = [pool.recorded(i) for i in range(10)]
    assert len(pool) == 4 and len({id(e) for e in held}) == 10
    del held
    reused = pool.recorded("again")
    assert Event.made == 10 and reused.records[-1] == "again"


def test_threads_never_get_an_event_another_one_holds() -> None:
    pool = _pool()
    lock = threading.Lock()
    holders: dict[Any, int] = {}  # event -> the thread holding it (the dict holds it too)
    failures: list[str] = []

    def work(me: int) -> None:
        rng = random.Random(me)
        mine: list[Any] = []
        for _ in range(2000):
            event = pool.recorded(me)
            with lock:
                if event in holders:
                    failures.append(f"thread {me} got an event thread {holders[event]} holds")
                holders[event] = me
            mine.append(event)
            del event
            while len(mine) > rng.randint(0, 3):
                old = mine.pop(0)
                with lock:
                    del holders[old]
                del old

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert Event.made < 6 * 2000 // 10  # and events were reused


def test_a_device_without_streams_records_nothing() -> None:
    assert recorded_event(torch.device("cpu"), None) is None


def test_a_device_without_streams_has_no_current_stream_however_often_asked() -> None:
    from kvcore.streams import current_stream

    assert [current_stream(torch.device("cpu")) for _ in range(3)] == [None, None, None]


def test_the_pool_checks_its_own_count_at_import_and_refuses_a_wrong_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The count an unheld event has at the check is calibrated, then the real method is
    tried: one too high would hand out held events, one too low would reuse none; either
    turns reuse off (every call makes a new event) instead of risking the first."""
    from kvcore import streams

    calibrated = streams._unheld_count()
    assert calibrated is not None and streams._UNHELD == calibrated  # (CPython with a GIL)
    for wrong in (calibrated - 1, calibrated + 1):
        monkeypatch.setattr(streams, "_UNHELD", wrong)
        assert streams._reuse_is_sound() is False
    monkeypatch.setattr(streams, "_UNHELD", calibrated)
    assert streams._reuse_is_sound() is True
