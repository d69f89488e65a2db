"""kvcore.streams.CurrentStream: the caller's stream object is looked up again only when the
backend's handle lookup says the current stream changed, so a submit on an unchanged stream
builds no stream object, and one on another stream gets that stream. (The controller's calls
asking no stream lookup: tests/core/test_null_device_path.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvcore.streams
from kvcore.streams import CurrentStream


class Lookups:
    """A device whose current stream is ``self.handle``: each lookup builds a new object."""

    def __init__(self) -> None:
        self.handle = 7
        self.built: list[tuple[int, object]] = []

    def stream(self, device: torch.device) -> Any:
        made = (self.handle, object())
        self.built.append(made)
        return made


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> Lookups:
    seen = Lookups()
    monkeypatch.setattr(kvcore.streams, "current_stream", seen.stream)
    return seen


def test_the_same_stream_object_while_the_handle_stays(lookups: Lookups) -> None:
    current = CurrentStream(torch.device("meta"), lambda: lookups.handle)
    first = current()
    assert current() is first and current() is first
    assert len(lookups.built) == 1


def test_another_current_stream_is_looked_up_and_kept(lookups: Lookups) -> None:
    current = CurrentStream(torch.device("meta"), lambda: lookups.handle)
    first = current()
    lookups.handle = 9
    second = current()
    assert second is not first and second[0] == 9
    assert current() is second
    lookups.handle = 7  # back on the first stream: looked up again (one object is kept)
    third = current()
    assert third[0] == 7 and third is not first
    assert len(lookups.built) == 3


def test_without_a_handle_lookup_every_call_looks_the_stream_up(lookups: Lookups) -> None:
    current = CurrentStream(torch.device("meta"), None)
    assert current() is not current()
    assert len(lookups.built) == 2
