"""Host slots belong to one write at a time: a page a write-back not yet acknowledged writes
cannot be freed, a caller's host indices must be pages of the allocator, and a freed ack's
pages are no longer loadable. Each refusal is typed and leaves the allocator, the queue and
both pools as they were."""

from __future__ import annotations

import pytest
import torch

from kvcore.controller import HiCacheController
from kvcore.errors import AllocatorError, InvalidArgument, InvalidIndices, TensorMismatch
from kvcore.layout import Kind, Layout
from kvcore.pools import SlotAllocator
from kvcore.verify import random_fill
from kvcore.write_queue import Health, WriteQueue

from .helpers import make_pools, page_tokens, poison, reference_only

P = 4


@pytest.fixture
def ctl(gen: torch.Generator) -> HiCacheController:
    dev, host = make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=2, host_pages=6,
                           device_size=32, head_num=2, head_dim=8, page_size=P,
                           dtype=torch.bfloat16, registry=reference_only())
    for t in dev.all_buffers():
        random_fill(t, gen)
    poison(host.buffer)
    return HiCacheController(dev, host, registry=reference_only())


def test_the_pages_of_a_write_not_yet_acknowledged_cannot_be_freed(
        ctl: HiCacheController) -> None:
    first = ctl.write(torch.arange(16, 20))
    second = ctl.write(torch.arange(20, 28))
    before = ctl.allocator.state()
    # its own tensor, another tensor naming one of its pages, and a mix with a free page
    for t in (second.host_indices, second.host_indices[P:].clone(),
              torch.cat([page_tokens([5], P), first.host_indices])):
        with pytest.raises(AllocatorError, match=r"^host_indices: page \d+ .* is written by "
                           r"write-back \d+, not acknowledged yet.*nothing was freed"):
            ctl.free_host(t)
        assert ctl.allocator.state() == before
    # no page went to two writes: a third one gets fresh pages, and all three land whole
    third = ctl.write(torch.arange(0, 4))
    pages = [set(a.host_indices.tolist()) for a in (first, second, third)]
    assert not (pages[0] & pages[1] or pages[0] & pages[2] or pages[1] & pages[2])
    assert ctl.wait_acks() == [first, second, third]
    for ack in (first, second, third):  # acknowledged: now they can go
        ctl.free_host(ack.host_indices)
    assert ctl.allocator.available_size() == ctl.allocator.size


def test_with_many_writes_queued_a_free_names_the_write_that_holds_its_page(
        gen: torch.Generator) -> None:
    """free_host looks every queued write's pages up at once: with dozens in flight each
    refused page still names its own write, and a page no write holds is freed."""
    dev, host = make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=2, host_pages=40,
                           device_size=32, head_num=2, head_dim=8, page_size=P,
                           dtype=torch.bfloat16, registry=reference_only())
    for t in dev.all_buffers():
        random_fill(t, gen)
    ctl = HiCacheController(dev, host, registry=reference_only())
    spare = ctl.allocator.alloc(P)  # allocated, written by no write
    acks = [ctl.write(torch.arange(4 * (i % 8), 4 * (i % 8) + P)) for i in range(30)]
    assert ctl.pending_writes == 30
    before = ctl.allocator.state()
    for k in torch.randperm(30, generator=gen)[:10].tolist():
        mixed = torch.cat([spare, acks[k].host_indices])
        with pytest.raises(AllocatorError, match=rf"is written by write-back {acks[k].id}, "
                           "not acknowledged yet.*nothing was freed"):
            ctl.free_host(mixed)
        assert ctl.allocator.state() == before
    ctl.free_host(spare)
    assert ctl.wait_acks() == acks
    for ack in acks:
        ctl.free_host(ack.host_indices)
    assert ctl.allocator.available_size() == ctl.allocator.size


def test_a_caller_s_host_indices_must_be_allocated_pages(ctl: HiCacheController) -> None:
    host_before = ctl.members[0].host.buffer.clone()
    state = ctl.allocator.state()
    with pytest.raises(InvalidIndices, match=r"^host_indices: expected pages allocated from "
                       r"the host pool's allocator, got page 0 \(slots 0..3\), which is free"):
        ctl.write(torch.arange(0, 4), host_indices=page_tokens([0], P))
    assert ctl.allocator.state() == state and ctl.pending_writes == 0
    assert torch.equal(ctl.members[0].host.buffer.view(torch.uint8),
                       host_before.view(torch.uint8))
    # taken from the allocator, the same call runs, and the allocator keeps those pages
    mine = ctl.allocator.alloc(2 * P)
    ack = ctl.write(torch.arange(0, 8), host_indices=mine.flip(0).view(-1, P).flip(1).flatten())
    assert ctl.wait_acks() == [ack]
    assert ctl.write(torch.arange(8, 12)).host_indices.tolist() != mine[:P].tolist()


def test_a_freed_ack_s_pages_are_no_longer_loadable(ctl: HiCacheController) -> None:
    ack = ctl.write(torch.arange(0, 8))
    ctl.wait_acks()
    ctl.load(ack.host_indices, torch.arange(8, 16)).wait()
    ctl.free_host(ack.host_indices)
    dev_before = [t.clone() for t in ctl.members[0].device.all_buffers()]
    for all_layers in (False, True):
        with pytest.raises(InvalidIndices, match=r"^host_indices: .* which is free"):
            ctl.load(ack.host_indices, torch.arange(16, 24), all_layers=all_layers)
        with pytest.raises(InvalidIndices, match=r"which is free"):
            ctl.load(ack.host_indices.clone(), torch.arange(16, 24), all_layers=all_layers)
    for t, b in zip(ctl.members[0].device.all_buffers(), dev_before, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))


def test_pages_freed_through_another_tensor_are_refused_to_a_load_of_the_ack_s_own(
        ctl: HiCacheController) -> None:
    """An ack's own tensor is loaded without checking its pages again, until pages are freed
    through another tensor: a copy of it, or a concatenation naming it and another ack."""
    first, second, third = (ctl.write(torch.arange(i, i + P)) for i in (0, 4, 8))
    assert ctl.wait_acks() == [first, second, third]
    ctl.free_host(first.host_indices.clone())
    dev_before = [t.clone() for t in ctl.members[0].device.all_buffers()]
    for all_layers in (False, True):
        with pytest.raises(InvalidIndices, match=r"^host_indices: .* which is free"):
            ctl.load(first.host_indices, torch.arange(16, 20), all_layers=all_layers)
    for t, b in zip(ctl.members[0].device.all_buffers(), dev_before, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(AllocatorError, match="free"):
        ctl.free_host(first.host_indices)  # freed already, through the copy
    # the others' pages are still theirs: loaded (their pages checked), then freed
    # through one tensor naming both
    ctl.load(second.host_indices, torch.arange(16, 20)).wait()
    for t in ctl.members[0].device.all_buffers():  # written from 4..7, loaded into 16..19
        assert torch.equal(t[16:20].view(torch.uint8), t[4:8].view(torch.uint8))
    ctl.free_host(torch.cat([second.host_indices, third.host_indices]))
    for ack in (second, third):
        with pytest.raises(InvalidIndices, match=r"which is free"):
            ctl.load(ack.host_indices, torch.arange(16, 20))
    assert ctl.allocator.available_size() == ctl.allocator.size
    # later acks are vouched for again as before
    fourth = ctl.write(torch.arange(12, 16))
    ctl.wait_acks()
    ctl.load(fourth.host_indices, torch.arange(20, 24)).wait()
    ctl.free_host(fourth.host_indices)
    assert ctl.allocator.available_size() == ctl.allocator.size


@pytest.mark.parametrize("stale_use", ["free", "load then free"])
def test_a_stale_ack_freeing_a_page_handed_out_again_unvouches_its_new_owner(
        ctl: HiCacheController, stale_use: str) -> None:
    """An ack whose pages were freed through another tensor may name a page handed out again
    to a later ack. Freeing that page through the old ack's tensor (loaded first or not) must
    cost the later ack its unchecked loads: loaded, it is refused as a free page (found by
    tests/core/test_host_slot_model.py in a pool group)."""
    first = ctl.write(torch.arange(0, P))
    assert ctl.wait_acks() == [first]
    ctl.free_host(first.host_indices.clone())  # through another tensor
    later = ctl.write(torch.arange(4, 4 + P))  # gets the page `first` names
    assert ctl.wait_acks() == [later]
    assert later.host_indices.tolist() == first.host_indices.tolist()
    if stale_use == "load then free":  # the page is allocated (to `later`): accepted
        ctl.load(first.host_indices, torch.arange(16, 16 + P)).wait()
    ctl.free_host(first.host_indices)  # frees `later`'s page
    dev_before = [t.clone() for t in ctl.members[0].device.all_buffers()]
    for all_layers in (False, True):
        with pytest.raises(InvalidIndices, match=r"^host_indices: .* which is free"):
            ctl.load(later.host_indices, torch.arange(20, 20 + P), all_layers=all_layers)
    for t, b in zip(ctl.members[0].device.all_buffers(), dev_before, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(AllocatorError, match="free"):
        ctl.free_host(later.host_indices)
    assert ctl.allocator.available_size() == ctl.allocator.size


def test_a_failed_write_does_not_take_the_acks_drained_before_it() -> None:
    """The queue requeues the writes that completed before a failed one before it releases
    the failed one's slots: a release that raised could otherwise drop them unacknowledged."""

    class Done:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def check(self) -> None:
            pass

    class Failed(Done):
        def check(self) -> None:
            raise RuntimeError("the kernel refused an index")

    alloc = SlotAllocator(4 * P, P)
    queue = WriteQueue(alloc, None, Health())
    good = queue.add(alloc.alloc(P), torch.arange(P), None, [Done()], True)
    bad_slots = alloc.alloc(P)
    queue.add(bad_slots, torch.arange(P), None, [Failed()], True)
    alloc.free(bad_slots)  # what free_host now refuses: the slots went back early
    with pytest.raises(AllocatorError):
        queue.drain(block=False)
    assert queue.drain(block=False) == [good]


@pytest.mark.parametrize("bad", [
    torch.cat([page_tokens([0], P), page_tokens([0], P)]),  # a page twice
    torch.arange(-P, 0),                                      # negative
    page_tokens([7], P),                                      # beyond the pool
])
def test_free_with_checked_still_refuses_pages_not_of_the_pool_or_twice(
        bad: torch.Tensor) -> None:
    alloc = SlotAllocator(6 * P, P)
    alloc.alloc(6 * P)
    before = alloc.state()
    with pytest.raises((AllocatorError, InvalidIndices)):
        alloc.free(bad, checked=True)
    assert alloc.state() == before


def test_a_tensor_whose_values_cannot_be_read_is_refused_by_the_allocator(
        ctl: HiCacheController) -> None:
    meta = page_tokens([0], P).to("meta")
    for call in (lambda: ctl.free_host(meta), lambda: ctl.allocator.is_allocated(meta)):
        with pytest.raises(TensorMismatch, match=r"on meta"):
            call()


@pytest.mark.parametrize(("args", "argument"), [
    ((8, 0), "page_size"), ((8, -4), "page_size"), ((8, 4.0), "page_size"),
    ((8.0, 4), "size"), (("8", 4), "size"), ((None, 4), "size"), ((6, 4), "size"),
    ((8, True), "page_size"),
])
def test_slot_allocator_arguments_are_checked_by_name(args: tuple[object, object],
                                                       argument: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"^{argument}: expected"):
        SlotAllocator(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_tokens", [8.0, 4.0, "4", None, -4, 3, True])
def test_alloc_takes_a_whole_number_of_pages_as_an_int(num_tokens: object) -> None:
    alloc = SlotAllocator(8, 4)
    with pytest.raises(InvalidArgument, match=r"^num_tokens: expected a non-negative "
                       r"int multiple of page_size 4"):
        alloc.alloc(num_tokens)  # type: ignore[arg-type]
    assert alloc.available_size() == 8
