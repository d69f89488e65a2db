"""SlotAllocator: whole contiguous pages, no double allocation, double free refused cleanly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.errors import AllocatorError, InvalidArgument, KVCoreError
from kvcore.pools import SlotAllocator

from .helpers import page_tokens


def _pages_of(indices: torch.Tensor, page_size: int) -> list[int]:
    """The pages ``indices`` cover, asserting they are whole, aligned and contiguous."""
    assert indices.dtype == torch.int64 and indices.device.type == "cpu"
    assert indices.dim() == 1 and indices.numel() % page_size == 0
    rows = indices.view(-1, page_size)
    starts = rows[:, 0]
    assert bool((starts % page_size == 0).all())
    assert torch.equal(rows - starts[:, None], torch.arange(page_size).expand_as(rows))
    return (starts // page_size).tolist()


class AllocatorModel(RuleBasedStateMachine):
    """Random alloc/free sequences against a set of taken pages."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: SlotAllocator | None = None
        self.taken: set[int] = set()

    @precondition(lambda self: self.alloc is None)
    @rule(page_size=st.integers(1, 8), num_pages=st.integers(1, 24))
    def create(self, page_size: int, num_pages: int) -> None:
        self.alloc = SlotAllocator(num_pages * page_size, page_size)

    @property
    def free_count(self) -> int:
        assert self.alloc is not None
        return self.alloc.num_pages - len(self.taken)

    @precondition(lambda self: self.alloc is not None)
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        a = self.alloc
        n = data.draw(st.integers(0, a.num_pages + 1), label="pages")
        if n > self.free_count:
            before = a.state()
            with pytest.raises(AllocatorError, match=r"full"):
                a.alloc(n * a.page_size)
            assert a.state() == before
            return
        pages = _pages_of(a.alloc(n * a.page_size), a.page_size)
        assert len(set(pages)) == len(pages) == n
        assert not set(pages) & self.taken, "handed out a taken page"
        assert all(0 <= p < a.num_pages for p in pages)
        self.taken |= set(pages)

    @precondition(lambda self: self.alloc is not None and self.taken)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        a = self.alloc
        pages = data.draw(st.lists(st.sampled_from(sorted(self.taken)), min_size=1,
                                   unique=True), label="pages")
        # checked: the caller vouches for the values (whole distinct pages), as the controller
        # does for an ack's unchanged indices; only the allocated state is checked then
        a.free(page_tokens(pages, a.page_size, data.draw(st.sampled_from([torch.int32,
                                                                          torch.int64]))),
               checked=data.draw(st.booleans(), label="checked"))
        self.taken -= set(pages)

    @precondition(lambda self: self.alloc is not None and self.free_count > 0)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        a = self.alloc
        free = sorted(set(range(a.num_pages)) - self.taken)
        bad = data.draw(st.sampled_from(free), label="free page")
        good = data.draw(st.lists(st.sampled_from(sorted(self.taken)), unique=True)
                         if self.taken else st.just([]), label="taken pages")
        pages = data.draw(st.permutations([*good, bad]), label="order")
        before = a.state()
        with pytest.raises(AllocatorError, match=r"double free"):
            a.free(page_tokens(pages, a.page_size),
                   checked=data.draw(st.booleans(), label="checked"))
        assert a.state() == before

    @precondition(lambda self: self.alloc is not None and self.taken)
    @rule(data=st.data())
    def free_same_page_twice(self, data: st.DataObject) -> None:
        a = self.alloc
        page = data.draw(st.sampled_from(sorted(self.taken)))
        before = a.state()
        with pytest.raises(AllocatorError, match=r"double free"):
            a.free(page_tokens([page, page], a.page_size))
        assert a.state() == before

    @precondition(lambda self: self.alloc is not None and self.taken
                  and self.alloc.page_size > 1)
    @rule(data=st.data())
    def free_partial_page(self, data: st.DataObject) -> None:
        a = self.alloc
        page = data.draw(st.sampled_from(sorted(self.taken)))
        before = a.state()
        with pytest.raises(KVCoreError, match=r"indices"):
            a.free(page_tokens([page], a.page_size)[1:])
        assert a.state() == before

    @invariant()
    def consistent(self) -> None:
        a = self.alloc
        if a is None:
            return
        state = a.state()
        assert a.available_size() == self.free_count * a.page_size
        assert set(state.allocated) == self.taken
        assert sorted(state.free_pages) == sorted(set(range(a.num_pages)) - self.taken)
        if self.taken:
            assert a.is_allocated(page_tokens(sorted(self.taken), a.page_size))


AllocatorModel.TestCase.settings = settings(max_examples=60, stateful_step_count=25,
                                            deadline=None)
TestAllocatorModel = AllocatorModel.TestCase


def test_low_pages_first_and_reuse_after_free() -> None:
    a = SlotAllocator(16, 4)
    first = a.alloc(8)
    assert first.tolist() == list(range(8))
    a.free(first[4:])
    assert a.alloc(4).tolist() == [4, 5, 6, 7]
    assert a.available_size() == 8


def test_alloc_refuses_a_partial_page() -> None:
    a = SlotAllocator(16, 4)
    before = a.state()
    with pytest.raises(InvalidArgument, match=r"^num_tokens:"):
        a.alloc(6)
    assert a.state() == before


@pytest.mark.parametrize("bad", [torch.tensor([0.0, 1.0]), torch.zeros(2, 4, dtype=torch.int64),
                                 torch.tensor([16, 17, 18, 19])])
def test_free_refuses_bad_indices_and_changes_nothing(bad: torch.Tensor) -> None:
    a = SlotAllocator(16, 4)
    a.alloc(8)
    before = a.state()
    with pytest.raises(KVCoreError, match=r"indices"):
        a.free(bad)
    assert a.state() == before


@pytest.mark.parametrize(("size", "page_size"), [(0, 4), (10, 4), (8, 0)])
def test_bad_allocator_geometry(size: int, page_size: int) -> None:
    with pytest.raises(InvalidArgument):
        SlotAllocator(size, page_size)
