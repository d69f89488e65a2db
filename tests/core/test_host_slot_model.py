"""Host-slot ownership through the controller against a model, in random order: writes (host
pages from the controller or taken from its allocator first), acknowledgements, per-layer and
all-layer loads and frees, each through an ack's own tensor or through another one naming its
pages (a copy, a slice, a concatenation of two acks), acks' tensors changed in place, and
writes and loads naming a device page past the pool.

The rule the model holds: a load or a free is accepted exactly when every page it names is
allocated (a free also refuses a page a write-back not yet acknowledged writes, and a page
named twice), whichever tensor names it; a load brings back what the latest write put in
those pages. After every step the device pool equals the model's byte for byte (so a refused
load changed nothing, and an accepted one only its destination pages) and the allocator
counts the model's free pages."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.controller import HiCacheController
from kvcore.errors import AllocatorError, InvalidIndices
from kvcore.handles import WriteAck
from kvcore.layout import Kind, Layout
from kvcore.verify import random_fill

from .helpers import make_pools, page_tokens, poison, reference_only

P, HOST_PAGES, DEVICE_PAGES = 4, 6, 8
pages_of_a_call = st.lists(st.integers(0, DEVICE_PAGES - 1), min_size=1, max_size=3,
                           unique=True)


def host_pages(t: torch.Tensor) -> list[int]:
    """The pages a tensor of whole pages names now."""
    return (t.view(-1, P)[:, 0] // P).tolist()


class HostSlots(RuleBasedStateMachine):
    #: (head_num, head_dim) of each pool pair; more than one makes a pool group (``members``)
    MEMBERS: tuple[tuple[int, int], ...] = ((2, 8),)

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0x5107)
        pairs = [make_pools(Kind.MHA, Layout.PAGE_FIRST, num_layers=2, host_pages=HOST_PAGES,
                            device_size=DEVICE_PAGES * P, head_num=heads, head_dim=dim,
                            page_size=P, dtype=torch.bfloat16, registry=reference_only())
                 for heads, dim in self.MEMBERS]
        self.buffers = [t for dev, _ in pairs for t in dev.all_buffers()]
        for t in self.buffers:
            random_fill(t, gen)
        for _, host in pairs:
            poison(host.buffer)
        self.ctl = HiCacheController(*pairs[0], registry=reference_only(), members=pairs[1:])
        self.device = [t.clone() for t in self.buffers]  # what the device pool must hold
        self.content: dict[int, list[torch.Tensor]] = {}  # host page -> its rows, per buffer
        self.allocated: set[int] = set()
        self.pending: list[tuple[WriteAck, list[int]]] = []
        self.acked: list[WriteAck] = []

    def _rows(self, page: int) -> list[torch.Tensor]:
        return [t[page * P:(page + 1) * P].clone() for t in self.device]

    @rule(pages=pages_of_a_call, take_first=st.booleans(), then_acknowledge=st.booleans())
    def write(self, pages: list[int], take_first: bool, then_acknowledge: bool) -> None:
        d = page_tokens(pages, P)
        state = self.ctl.allocator.state()
        if HOST_PAGES - len(self.allocated) < len(pages):
            with pytest.raises(AllocatorError, match="host pool full"):
                if take_first:
                    self.ctl.allocator.alloc(d.numel())
                else:
                    self.ctl.write(d)
            assert self.ctl.allocator.state() == state
            return
        h = self.ctl.allocator.alloc(d.numel()) if take_first else None
        ack = self.ctl.write(d, host_indices=h)
        if h is not None:
            assert ack.host_indices is h
        written = host_pages(ack.host_indices)
        assert not self.allocated & set(written)  # never pages another write holds
        self.allocated |= set(written)
        for hp, dp in zip(written, pages, strict=True):
            self.content[hp] = self._rows(dp)
        self.pending.append((ack, written))
        if then_acknowledge:
            self.acknowledge()

    @rule(data=st.data(), past_the_end=st.booleans())
    def write_past_the_pool(self, data: st.DataObject, past_the_end: bool) -> None:
        """A device index out of range: refused before anything moves, nothing taken (named
        even where the host pool has no room for the write)."""
        good = page_tokens(data.draw(pages_of_a_call), P)
        bad = DEVICE_PAGES * P + data.draw(st.integers(0, 9)) if past_the_end else -1
        d = torch.cat([good, torch.full((P,), bad)])
        state = self.ctl.allocator.state()
        with pytest.raises(InvalidIndices, match=rf"^device_indices: .*got {bad}"):
            self.ctl.write(d)
        assert self.ctl.allocator.state() == state and self.ctl.pending_writes == len(
            self.pending)

    @precondition(lambda self: self.pending)
    @rule()
    def acknowledge(self) -> None:
        assert self.ctl.wait_acks() == [ack for ack, _ in self.pending]
        self.acked += [ack for ack, _ in self.pending]
        self.pending.clear()

    def _named(self, data: st.DataObject, how: str) -> tuple[WriteAck, torch.Tensor]:
        """An acknowledged ack, and its pages through its own tensor or another one."""
        ack = data.draw(st.sampled_from(self.acked))
        own = ack.host_indices
        if how == "own":
            return ack, own
        if how == "slice" and own.numel() > P:
            return ack, own[P:]
        if how == "concatenation" and len(self.acked) > 1:
            other = data.draw(st.sampled_from([a for a in self.acked if a is not ack]))
            return ack, torch.cat([own, other.host_indices])
        return ack, own.clone()

    @precondition(lambda self: self.acked)
    @rule(data=st.data(), how=st.sampled_from(["own", "copy", "slice"]),
          all_layers=st.booleans())
    def load(self, data: st.DataObject, how: str, all_layers: bool) -> None:
        self._load(data, self._named(data, how)[1], all_layers)

    def _load(self, data: st.DataObject, h: torch.Tensor, all_layers: bool) -> None:
        pages = host_pages(h)
        dst = data.draw(st.lists(st.integers(0, DEVICE_PAGES - 1), min_size=len(pages),
                                 max_size=len(pages), unique=True))
        if not set(pages) <= self.allocated:
            with pytest.raises(InvalidIndices, match=r"^host_indices: .* which is free"):
                self.ctl.load(h, page_tokens(dst, P), all_layers=all_layers)
            return
        if data.draw(st.booleans()):  # one destination page past the pool: refused whole
            d = page_tokens(dst, P)
            d[-P:] += (DEVICE_PAGES - dst[-1]) * P
            with pytest.raises(InvalidIndices, match=r"^device_indices: "):
                self.ctl.load(h, d, all_layers=all_layers)
            return
        self.ctl.load(h, page_tokens(dst, P), all_layers=all_layers).wait()
        for hp, dp in zip(pages, dst, strict=True):
            for t, rows in zip(self.device, self.content[hp], strict=True):
                t[dp * P:(dp + 1) * P] = rows

    @precondition(lambda self: self.acked)
    @rule(data=st.data(), how=st.sampled_from(["own", "copy", "slice", "concatenation"]),
          then_load=st.booleans())
    def free(self, data: st.DataObject, how: str, then_load: bool) -> None:
        """A free, then maybe a load of the ack's own tensor (the controller skips checking
        an ack's own tensor until pages are freed through another one)."""
        ack, h = self._named(data, how)
        self._free(h)
        if then_load:
            self._load(data, ack.host_indices, all_layers=data.draw(st.booleans()))

    def _free(self, h: torch.Tensor) -> None:
        pages = host_pages(h)
        writing = {p for _, written in self.pending for p in written}
        state = self.ctl.allocator.state()
        if len(set(pages)) != len(pages):
            expected = "the same page appears twice"
        elif not set(pages) <= self.allocated:
            expected = "free"
        elif set(pages) & writing:
            expected = "not acknowledged yet"
        else:
            self.ctl.free_host(h)
            self.allocated -= set(pages)
            return
        with pytest.raises(AllocatorError, match=expected):
            self.ctl.free_host(h)
        assert self.ctl.allocator.state() == state

    @precondition(lambda self: self.acked)
    @rule(data=st.data(), then_load=st.booleans())
    def change_an_ack_s_tensor(self, data: st.DataObject, then_load: bool) -> None:
        """The caller writes into an ack's own tensor: it now names another page (whole), and
        is no longer the allocator's (loaded, it is checked again)."""
        ack = data.draw(st.sampled_from(self.acked))
        slot = data.draw(st.integers(0, ack.host_indices.numel() // P - 1))
        page = data.draw(st.integers(0, HOST_PAGES - 1))
        ack.host_indices[slot * P:(slot + 1) * P] = torch.arange(page * P, (page + 1) * P)
        if then_load:
            self._load(data, ack.host_indices, all_layers=data.draw(st.booleans()))

    @invariant()
    def the_device_pool_and_the_allocator_match_the_model(self) -> None:
        for t, expected in zip(self.buffers, self.device, strict=True):
            assert torch.equal(t.view(torch.int16), expected.view(torch.int16))
        assert self.ctl.allocator.available_size() == (HOST_PAGES - len(self.allocated)) * P
        assert self.ctl.usable


class HostSlotsOfAGroup(HostSlots):
    """The same through a pool group: a second pool pair of other heads shares the host
    slots (every write and load moves both)."""

    MEMBERS = ((2, 8), (1, 16))


SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestHostSlots = HostSlots.TestCase
TestHostSlots.settings = SETTINGS
TestHostSlotsOfAGroup = HostSlotsOfAGroup.TestCase
TestHostSlotsOfAGroup.settings = settings(SETTINGS, max_examples=60)
