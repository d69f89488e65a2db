"""The replay loop: waves of requests against a prefix index, a controller and two pools.

One wave: match every request's pages in the index (device hit, host hit or miss), make
room on the device (evicting least recently used pages; under write_back they are written
back first and their slots are reused only once acknowledged), queue the loads of host hits,
fill missed pages with key-derived data, queue the write-backs the policy asks for, then
wait for each loaded layer in turn and check its checksums on the device. Write-backs stay in
flight across waves; the host tier makes room by freeing its least recently used pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch

from kvcore.controller import CacheEvent, HiCacheController, WritePolicy
from kvcore.errors import InvalidArgument, KVCoreError
from kvcore.layout import Kind, Layout, parse_enum
from kvcore.pools import DevicePool
from kvcore.registry import Registry, allocate_host_pool, default_registry
from kvcore.replay.pages import PageCodec
from kvcore.replay.prefix_index import NOWHERE, PageEntry, PrefixIndex
from kvcore.replay.report import ReplayStats
from kvcore.replay.workload import Workload, WorkloadConfig


class ReplayStall(KVCoreError, RuntimeError):
    """The pools are too small for the workload: nothing can be evicted or completed."""


@attrs.frozen
class ReplayConfig:
    """What to replay, on what, and when to stop (the first bound reached stops the run).

    ``device_pages`` defaults to 5/4 of the most pages one wave can pin and ``host_pages`` to
    three times the device pool: small enough that both tiers evict and idle sessions come
    back as host hits.
    """

    workload: WorkloadConfig = attrs.Factory(WorkloadConfig)
    kind: Kind = Kind.MHA
    layout: Layout = Layout.PAGE_FIRST
    num_layers: int = 4
    head_num: int = 4
    head_dim: int = 64
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    device_pages: int | None = None
    host_pages: int | None = None
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    backend: str | None = None
    min_transfers: int | None = 10_000
    max_requests: int | None = None
    time_limit_s: float | None = None

    @property
    def wave_pages(self) -> int:
        """The most pages one wave can pin on the device."""
        return self.workload.concurrency * self.workload.max_request_pages

    def sizes(self) -> tuple[int, int]:
        """(device pages, host pages), defaults applied and checked."""
        dev = self.device_pages or self.wave_pages * 5 // 4
        host = self.host_pages or 3 * dev
        if dev < self.wave_pages:
            raise InvalidArgument("device_pages", f"at least {self.wave_pages} (concurrency x "
                                  "the longest request, all pinned during one wave)", str(dev))
        if host < self.workload.concurrency * self.workload.max_request_pages:
            raise InvalidArgument("host_pages", f"at least {self.wave_pages} (concurrency x "
                                  "the longest request: one wave's pages are written back)",
                                  str(host))
        return dev, host


class Replay:
    """One replay run; see the module docstring. Build it, then call :meth:`run`."""

    def __init__(self, config: ReplayConfig, registry: Registry | None = None) -> None:
        self.config = c = config
        reg = registry or default_registry()
        dev_pages, host_pages = c.sizes()
        P = c.page_size
        self.device_pool = DevicePool.allocate(c.kind, c.num_layers, dev_pages * P, c.head_num,
                                               c.head_dim, c.dtype, c.device, P)
        self.host_pool = allocate_host_pool(c.kind, c.layout, c.num_layers, host_pages * P,
                                           c.head_num, c.head_dim, c.dtype, P, c.device,
                                           backend=c.backend, registry=reg)
        self.ctl = HiCacheController(self.device_pool, self.host_pool, c.write_policy,
                                     c.backend, registry=reg)
        self.device = self.device_pool.device
        self.codec = PageCodec(self.device_pool, host_pages)
        self.index = PrefixIndex()
        self.workload = Workload(c.workload)
        self._free: list[int] = list(range(dev_pages - 1, -1, -1))
        self._inflight: dict[int, list[tuple[PageEntry, int]]] = {}
        self._release_on_ack: dict[int, list[int]] = {}
        self._ramp = torch.arange(P, dtype=torch.int64)
        self.stats = ReplayStats(
            page_bytes=self.host_pool.geometry.kv_count * c.num_layers * P
            * self.device_pool.element_bytes,
            backend=self.ctl.plan("write_back").backend_name, device=str(self.device),
            write_policy=self.ctl.write_policy.value)

    # -- the loop --------------------------------------------------------------------------

    def run(self, progress: Callable[[ReplayStats], None] | None = None,
            progress_every_s: float = 0.5) -> ReplayStats:
        """Replay waves until a bound is reached, an error stops it or it is interrupted
        (KeyboardInterrupt: ``stopped_by`` "interrupted"); return the stats so far."""
        c, s = self.config, self.stats
        start = last = time.perf_counter()
        try:
            while True:
                if c.min_transfers is not None and s.transfers >= c.min_transfers:
                    s.stopped_by = "min_transfers"
                    break
                if c.max_requests is not None and s.requests >= c.max_requests:
                    s.stopped_by = "max_requests"
                    break
                now = time.perf_counter()
                if c.time_limit_s is not None and now - start >= c.time_limit_s:
                    s.stopped_by = "time_limit"
                    break
                self._wave(self.workload.wave())
                if progress is not None and now - last >= progress_every_s:
                    last = now
                    s.wall_s = now - start
                    s.checksum_mismatches = self.codec.mismatches()
                    progress(s)
            self._collect(block=True)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM under `kvio replay`: report so far
            s.stopped_by = "interrupted"
        except KVCoreError as exc:
            s.transfer_errors += 1
            s.error_messages.append(f"{type(exc).__name__}: {exc}")
            s.stopped_by = "error"
        s.checksum_mismatches = self.codec.mismatches()
        s.wall_s = time.perf_counter() - start
        if progress is not None:
            progress(s)
        return s

    def _wave(self, requests: Sequence) -> None:
        s, policy = self.stats, self.ctl.write_policy
        pinned: set[int] = set()
        order: list[PageEntry] = []  # touch order: each request's pages leaf first
        loads: list[PageEntry] = []
        misses: list[PageEntry] = []
        selective: list[PageEntry] = []
        for req in requests:
            s.requests += 1
            s.pages_requested += len(req.keys)
            for key in req.keys:
                e = self.index.lookup(key)
                order.append(e)
                if key in pinned:
                    s.device_hits += 1  # another request of this wave brought it in
                    continue
                pinned.add(key)
                if e.device != NOWHERE:
                    s.device_hits += 1
                    e.hits += 1
                    if (policy is WritePolicy.WRITE_THROUGH_SELECTIVE
                            and e.hits == self.ctl.selective_threshold
                            and e.host == NOWHERE and not e.writing):
                        selective.append(e)
                elif e.host != NOWHERE:
                    s.host_hits += 1
                    loads.append(e)
                else:
                    s.misses += 1
                    misses.append(e)
        pages = self._alloc_device(len(loads) + len(misses), pinned)
        handle = None
        if loads:
            h_pages = [e.host for e in loads]
            d_pages = pages[:len(loads)]
            handle = self.ctl.load(self._tokens(h_pages), self._tokens(d_pages))
            for e, p in zip(loads, d_pages, strict=True):
                self.index.place_on_device(e, p)
            s.pages_loaded += len(loads)
        if misses:
            d_pages = pages[len(loads):]
            self.codec.fill(self._on_device(d_pages),
                            torch.tensor([e.key for e in misses], device=self.device))
            for e, p in zip(misses, d_pages, strict=True):
                self.index.place_on_device(e, p)
            if policy is WritePolicy.WRITE_THROUGH:
                self._write([e for e in misses if not e.writing], CacheEvent.INSERT, pinned)
        if selective:
            self._write(selective, CacheEvent.HIT, pinned, hits=self.ctl.selective_threshold)
        if handle is not None:
            h_dev, d_dev = self._on_device(h_pages), self._on_device(pages[:len(loads)])
            for layer in range(handle.num_layers):
                handle.wait_layer(layer)
                self.codec.verify(h_dev, d_dev, layer)
            handle.wait()  # host pages may be freed or rewritten from the next wave on
        for e in reversed(order):
            self.index.touch(e)
        self._collect(block=False)

    # -- device tier -----------------------------------------------------------------------

    def _alloc_device(self, n: int, pinned: set[int]) -> list[int]:
        """``n`` free device pages, evicting unpinned least recently used pages as needed."""
        while len(self._free) < n:
            want = n - len(self._free) - sum(len(v) for v in self._release_on_ack.values())
            write_out: list[PageEntry] = []
            for e in self.index.device_victims(pinned):
                if want <= 0:
                    break
                want -= 1
                self.stats.device_evicted += 1
                needs_write = (self.ctl.write_policy is WritePolicy.WRITE_BACK
                               and e.host == NOWHERE and not e.writing)
                if needs_write:
                    write_out.append(e)
                    continue
                write_id = e.write_id
                page = self.index.leave_device(e)
                if write_id is not None:
                    self._release_on_ack.setdefault(write_id, []).append(page)
                else:
                    self._free.append(page)
            if write_out:
                ack_id = self._write(write_out, CacheEvent.EVICT, pinned)
                for e in write_out:
                    self._release_on_ack.setdefault(ack_id, []).append(
                        self.index.leave_device(e))
            if len(self._free) < n:
                if not self._inflight:
                    raise ReplayStall(f"device pool of {len(self._free)} free pages cannot "
                                      f"hold {n} more; raise device_pages")
                self._collect(block=True)
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return taken

    # -- write-back and host tier ----------------------------------------------------------

    def _write(self, entries: list[PageEntry], event: CacheEvent, pinned: set[int],
               hits: int = 0) -> int:
        """Queue one write-back of ``entries``' device pages; record their checksums."""
        if not entries:
            return -1
        self._make_host_room(len(entries), pinned)
        d_pages = [e.device for e in entries]
        ack = self.ctl.on_cache_event(event, self._tokens(d_pages), hits)
        if ack is None:
            raise KVCoreError(f"write policy {self.ctl.write_policy.value} refused {event.value}")
        h_pages = (ack.host_indices.view(-1, self.config.page_size)[:, 0]
                   // self.config.page_size).tolist()
        self.codec.record(self._on_device(h_pages), self._on_device(d_pages))
        for e in entries:
            e.write_id = ack.id
        self._inflight[ack.id] = list(zip(entries, h_pages, strict=True))
        return ack.id

    def _make_host_room(self, n: int, pinned: set[int]) -> None:
        alloc = self.ctl.allocator
        P = self.config.page_size
        while alloc.available_size() < n * P:
            need = n - alloc.available_size() // P
            freed: list[int] = []
            for e in self.index.host_victims(pinned):
                if len(freed) >= need:
                    break
                freed.append(self.index.leave_host(e))
            if freed:
                self.ctl.free_host(self._tokens(freed))
                self.stats.host_evicted += len(freed)
            elif self._inflight:
                self._collect(block=True)
            else:
                raise ReplayStall(f"host pool cannot make room for {n} pages; raise host_pages")

    def _collect(self, block: bool) -> None:
        acks = self.ctl.wait_acks() if block else self.ctl.poll_acks()
        for ack in acks:
            written = self._inflight.pop(ack.id)
            for e, h in written:
                e.write_id = None
                self.index.place_on_host(e, h)
            self.stats.pages_written += len(written)
            self._free.extend(self._release_on_ack.pop(ack.id, ()))

    # -- helpers ---------------------------------------------------------------------------

    def _tokens(self, pages: list[int]) -> torch.Tensor:
        """Token indices (CPU int64) of whole pages."""
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * self.config.page_size + self._ramp).flatten()

    def _on_device(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.int64).to(self.device)


def run_replay(config: ReplayConfig, registry: Registry | None = None,
               progress: Callable[[ReplayStats], None] | None = None) -> ReplayStats:
    """Build a :class:`Replay` for ``config`` and run it."""
    return Replay(config, registry).run(progress)


def parse_policy(value: str) -> WritePolicy:
    return parse_enum(WritePolicy, value, "write_policy")
