"""The device pool view, the host pool and its page-granular slot allocator."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from kvcore.capabilities import HostMemory
from kvcore.errors import AllocatorError, InvalidArgument, TensorMismatch
from kvcore.layout import (
    ByteStrides,
    Geometry,
    Kind,
    Layout,
    byte_runs,
    byte_strides,
    host_shape,
    parse_enum,
    shape_names,
    size_from_shape,
)
from kvcore.validate import (
    check_cpu_indices,
    check_index_tensor,
    check_positive_int,
    describe_tensor,
    is_int,
)


def _pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    return ptrs.view(torch.uint64).to(device)


def _tensors(name: str, buffers: object) -> list[torch.Tensor]:
    """``buffers`` as a list of tensors, or TensorMismatch naming the first that is not."""
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, Sequence):
        raise TensorMismatch(name, "a sequence of tensors, one per layer", type(buffers).__name__)
    for i, t in enumerate(buffers):
        if not isinstance(t, torch.Tensor):
            raise TensorMismatch(f"{name}[{i}]", "a torch.Tensor", type(t).__name__)
    return list(buffers)


class DevicePool:
    """A view over per-layer device tensors of shape ``(size, head_num, head_dim)``.

    MHA pools have K and V tensors per layer, MLA pools one latent tensor per layer
    (``head_num == 1``). :meth:`wrap` adopts tensors an engine already owns; :meth:`allocate`
    makes new ones. ``k_ptrs``/``v_ptrs`` are uint64 tables of the layers' data pointers on
    the pool's device, as native kernels want them.
    """

    def __init__(self, kind: Kind, k_buffers: Sequence[torch.Tensor],
                 v_buffers: Sequence[torch.Tensor] | None, page_size: int) -> None:
        self.kind = kind
        self.k_buffers = _tensors("k_buffers", k_buffers)
        self.v_buffers = _tensors("v_buffers", v_buffers) if v_buffers is not None else None
        if kind is Kind.MHA and self.v_buffers is None:
            raise InvalidArgument("v_buffers", "one tensor per layer for an MHA pool", "None")
        if kind is Kind.MLA and self.v_buffers is not None:
            raise InvalidArgument("v_buffers", "None for an MLA pool", "tensors")
        if not self.k_buffers:
            raise InvalidArgument("k_buffers", "at least one layer", "0 tensors")
        if self.v_buffers is not None and len(self.v_buffers) != len(self.k_buffers):
            raise InvalidArgument("v_buffers", f"{len(self.k_buffers)} tensors (one per layer)",
                                  str(len(self.v_buffers)))
        first = self.k_buffers[0]
        if first.dim() != 3:
            raise TensorMismatch("k_buffers[0]", "shape (size, head_num, head_dim)",
                                 describe_tensor(first))
        for name, bufs in (("k_buffers", self.k_buffers), ("v_buffers", self.v_buffers or [])):
            for i, t in enumerate(bufs):
                if (t.shape != first.shape or t.dtype != first.dtype
                        or t.device != first.device):
                    raise TensorMismatch(f"{name}[{i}]", describe_tensor(first),
                                         describe_tensor(t))
                if not t.is_contiguous():
                    raise TensorMismatch(f"{name}[{i}]", "a contiguous tensor",
                                         f"strides {t.stride()}")
        self.size, self.head_num, self.head_dim = (int(s) for s in first.shape)
        if kind is Kind.MLA and self.head_num != 1:
            raise TensorMismatch("k_buffers[0]", "head_num 1 for an MLA pool",
                                 describe_tensor(first))
        if self.size == 0 or self.head_num == 0 or self.head_dim == 0:
            raise TensorMismatch("k_buffers[0]", "a pool of at least one token of one element",
                                 describe_tensor(first))
        if not is_int(page_size) or page_size <= 0 or self.size % page_size:
            raise InvalidArgument("page_size", f"a positive divisor of the pool size {self.size}",
                                  repr(page_size))
        self.page_size = int(page_size)
        self.dtype = first.dtype
        self.device = first.device
        self.k_ptrs = _pointer_table(self.k_buffers, self.device)
        self.v_ptrs = (_pointer_table(self.v_buffers, self.device)
                       if self.v_buffers is not None else None)

    @classmethod
    def wrap(cls, kind: Kind | str, k_buffers: Sequence[torch.Tensor],
             v_buffers: Sequence[torch.Tensor] | None = None, page_size: int = 1) -> DevicePool:
        """Adopt existing per-layer tensors (no copy)."""
        return cls(parse_enum(Kind, kind, "kind"), k_buffers, v_buffers,
                   page_size)

    @classmethod
    def allocate(cls, kind: Kind | str, num_layers: int, size: int, head_num: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 page_size: int) -> DevicePool:
        """Allocate new, uninitialised per-layer tensors."""
        k = parse_enum(Kind, kind, "kind")
        for name, value in (("num_layers", num_layers), ("size", size),
                            ("head_num", head_num), ("head_dim", head_dim),
                            ("page_size", page_size)):
            check_positive_int(name, value)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgument("dtype", "a torch.dtype", repr(dtype))
        shape = (int(size), int(head_num), int(head_dim))
        try:
            first = torch.empty(shape, dtype=dtype, device=device)
        except (RuntimeError, AssertionError, TypeError) as exc:
            raise InvalidArgument("device", "a device this torch can allocate on",
                                  f"{device!r} ({type(exc).__name__}: {exc})".splitlines()[0],
                                  ) from None
        ks = [first] + [torch.empty(shape, dtype=dtype, device=first.device)
                        for _ in range(num_layers - 1)]
        vs = ([torch.empty(shape, dtype=dtype, device=first.device) for _ in range(num_layers)]
              if k is Kind.MHA else None)
        return cls(k, ks, vs, page_size)

    @property
    def num_layers(self) -> int:
        """Layers of the pool (one tensor each for K, and for V under MHA)."""
        return len(self.k_buffers)

    @property
    def element_bytes(self) -> int:
        """Bytes of one token of one layer of K (or V): ``head_num x head_dim x itemsize``."""
        return self.head_num * self.head_dim * self.dtype.itemsize

    def layers(self, kv: int) -> list[torch.Tensor]:
        """Layer tensors of K (kv=0) or V (kv=1); MLA has only kv=0."""
        if kv == 0:
            return self.k_buffers
        if self.v_buffers is None:
            raise InvalidArgument("kv", "0 for an MLA pool", str(kv))
        return self.v_buffers

    def all_buffers(self) -> list[torch.Tensor]:
        """Every layer tensor, K's then V's."""
        return self.k_buffers + (self.v_buffers or [])

    def clone(self) -> DevicePool:
        """A pool of the same geometry on new tensors holding a copy of this one's data."""
        return DevicePool(self.kind, [t.clone() for t in self.k_buffers],
                          [t.clone() for t in self.v_buffers] if self.v_buffers is not None
                          else None, self.page_size)


@attrs.frozen
class AllocatorState:
    """A comparable snapshot of a :class:`SlotAllocator` (for tests and diagnostics)."""

    free_pages: tuple[int, ...]
    allocated: tuple[int, ...]


class SlotAllocator:
    """Page-granular allocator of host token slots, refusing a double free.

    Slots are handed out in whole pages; a page's ``page_size`` slots are contiguous. Indices
    are int64 token indices on the CPU. Safe for concurrent callers (controllers sharing a
    host pool, threads sharing a controller): each call holds a lock for its few
    microseconds. No page is handed out twice: the free list holds only pages never handed
    out or given back by :meth:`free`, which refuses any page that is not allocated.
    """

    def __init__(self, size: int, page_size: int) -> None:
        check_positive_int("page_size", page_size)
        if not is_int(size) or size <= 0 or size % page_size:
            raise InvalidArgument("size", f"a positive int multiple of page_size {page_size}",
                                  repr(size))
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        # a stack of free pages: [0, _top) holds them, the top (low pages first) is taken next
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._top = self.num_pages
        self._taken = np.zeros(self.num_pages, dtype=np.bool_)
        # every page's token indices (8 B per slot of a pool of at least 8 KiB per slot): an
        # allocation takes its rows instead of computing them
        self._tokens = np.arange(size, dtype=np.int64).reshape(self.num_pages, page_size)
        self._lock = threading.Lock()

    def available_size(self) -> int:
        """Free token slots."""
        return self._top * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Token indices of ``num_tokens / page_size`` free pages; all or nothing."""
        return self.alloc_values(num_tokens)[0]

    def alloc_values(self, num_tokens: int) -> tuple[torch.Tensor, np.ndarray]:
        """:meth:`alloc`, with the NumPy array the tensor shares its memory with (what a
        caller that keeps a copy of the values reads without converting the tensor)."""
        if (type(num_tokens) is not int and not is_int(num_tokens)) or num_tokens < 0 \
                or num_tokens % self.page_size:
            raise InvalidArgument("num_tokens", f"a non-negative int multiple of page_size "
                                  f"{self.page_size}", repr(num_tokens))
        n = num_tokens // self.page_size
        with self._lock:
            top = self._top
            if n > top:
                raise AllocatorError(f"host pool full: {num_tokens} slots requested, "
                                     f"{self.available_size()} free of {self.size}")
            if n == 1:  # (one page: scalar steps, a microsecond less than the general ones)
                page = int(self._free[top - 1])
                self._taken[page] = True
                self._top = top - 1
                tokens = self._tokens[page].copy()
            else:
                pages = self._free[top - n:top][::-1]
                self._taken[pages] = True
                self._top = top - n
                tokens = self._tokens.take(pages, axis=0).reshape(-1)
        return torch.from_numpy(tokens), tokens

    def free(self, indices: torch.Tensor, *, checked: bool = False, name: str = "indices",
             in_use: Callable[[np.ndarray], str | None] | None = None) -> None:
        """Return whole pages; freeing a page that is not allocated raises and frees nothing
        (errors name the argument ``name``).

        ``checked``: the caller vouches that ``indices`` holds whole pages of this pool
        (tensors this allocator handed out, unchanged since; the controller knows which
        through :class:`~kvcore.validate.CheckedTensors`): their tokens are then not checked
        one by one. Their pages still are: in range, each once, and every one allocated.

        ``in_use``: says why some of these pages must not be freed yet (the controller: a
        write-back into them is not acknowledged), or None; given the page numbers."""
        pages = self._pages_of(name, indices, checked)
        n = pages.size
        if n == 0:
            return
        if n > 1 and len(set(pages.tolist())) != n:  # (a set: half a sort's time here)
            raise AllocatorError(f"{name}: double free, the same page appears twice in "
                                 "one free() call; nothing was freed")
        if in_use is not None:
            why = in_use(pages)
            if why is not None:
                raise AllocatorError(f"{name}: {why}; nothing was freed")
        with self._lock:
            taken = self._taken
            held = taken[pages]
            if np.count_nonzero(held) != n:
                page = int(pages[np.flatnonzero(~held)[0]])
                raise AllocatorError(f"{name}: {self.describe_page(page)} is not allocated: "
                                     "freed already (a double free) or never handed out; "
                                     "nothing was freed")
            taken[pages] = False
            top = self._top
            self._free[top:top + n] = pages[::-1]
            self._top = top + n

    def describe_page(self, page: int) -> str:
        """``page N (slots A..B)``: a page and its token slots, for messages."""
        return f"page {page} (slots {page * self.page_size}..{(page + 1) * self.page_size - 1})"

    def is_allocated(self, indices: torch.Tensor) -> bool:
        """Whether every page of ``indices`` is allocated (``indices`` is value-checked)."""
        return self.first_free_page(indices) is None

    def first_free_page(self, indices: torch.Tensor, *, checked: bool = False,
                        name: str = "indices") -> int | None:
        """The first page of ``indices`` that is not allocated, or None where every one is
        (``checked`` as in :meth:`free`)."""
        pages = self._pages_of(name, indices, checked)
        with self._lock:
            free = np.flatnonzero(~self._taken[pages])
        return int(pages[free[0]]) if free.size else None

    def state(self) -> AllocatorState:
        """The free stack and the allocated pages, for tests and for checking nothing leaked."""
        with self._lock:
            return AllocatorState(tuple(self._free[:self._top].tolist()),
                                  tuple(np.flatnonzero(self._taken).tolist()))

    def _pages_of(self, name: str, indices: torch.Tensor, checked: bool = False) -> np.ndarray:
        t = check_index_tensor(name, indices)
        if not t.is_cpu:
            try:
                t = t.cpu()
            except (NotImplementedError, RuntimeError) as exc:  # (meta: no values to read)
                raise TensorMismatch(name, "a tensor whose values can be read (on the CPU)",
                                     describe_tensor(t)) from exc
        if not checked:
            check_cpu_indices(name, t, self.size, page_size=self.page_size)  # InvalidIndices
        a = t.numpy() if t.is_contiguous() else t.contiguous().numpy()
        pages = a[::self.page_size] // self.page_size
        if checked and pages.size:
            # vouched for, yet not of this pool: never index the page tables with it (Python
            # on the page list: a NumPy reduction costs a microsecond per call here)
            listed = pages.tolist()
            if min(listed) < 0 or max(listed) >= self.num_pages:
                check_cpu_indices(name, t, self.size, page_size=self.page_size)
        return pages


class HostPool:
    """A host buffer in one of the layouts of :mod:`kvcore.layout`, plus its slot allocator.

    Build it with :func:`kvcore.allocate_host_pool`, which asks the backend that will serve
    the device for a buffer its kernels can use (pinned where the platform has it, plain on
    the CPU), or with :meth:`wrap` around a buffer you already own.
    """

    def __init__(self, geometry: Geometry, buffer: torch.Tensor, memory: HostMemory) -> None:
        expected = host_shape(geometry)
        if tuple(buffer.shape) != expected:
            raise TensorMismatch("buffer", f"shape {expected}", describe_tensor(buffer))
        if buffer.device.type != "cpu":
            raise TensorMismatch("buffer", "a tensor in host memory (device cpu)",
                                 describe_tensor(buffer))
        if not buffer.is_contiguous():
            raise TensorMismatch("buffer", "a contiguous tensor", f"strides {buffer.stride()}")
        self.geometry = geometry
        self.buffer = buffer
        self.memory = memory
        self.dtype = buffer.dtype
        self.strides: ByteStrides = byte_strides(geometry, buffer.dtype.itemsize)
        self.allocator = SlotAllocator(geometry.size, geometry.page_size)

    @classmethod
    def wrap(cls, buffer: torch.Tensor, kind: Kind | str, layout: Layout | str,
             num_layers: int, head_num: int, head_dim: int, page_size: int,
             memory: HostMemory | None = None, head_group_num: int = 1) -> HostPool:
        """Adopt an existing host buffer (its size is read from its shape)."""
        k = parse_enum(Kind, kind, "kind")
        lay = parse_enum(Layout, layout, "layout")
        if not isinstance(buffer, torch.Tensor):
            raise TensorMismatch("buffer", "a torch.Tensor", type(buffer).__name__)
        check_positive_int("page_size", page_size)
        size = size_from_shape(tuple(buffer.shape), k, lay, page_size)
        try:
            g = Geometry(k, lay, num_layers, size, head_num, head_dim, page_size,
                         head_group_num)
        except InvalidArgument as exc:
            if exc.argument != "size":
                raise
            # the size was read from the buffer's shape: the shape is what is wrong
            raise TensorMismatch(
                "buffer", f"a {k.value} {lay.value} buffer whose token axes hold whole pages of "
                          f"{page_size} (axes {shape_names(k, lay)})",
                f"{describe_tensor(buffer)}: {size} tokens") from None
        if memory is None:
            memory = HostMemory.PINNED if buffer.is_pinned() else HostMemory.PLAIN
        else:
            memory = parse_enum(HostMemory, memory, "memory")
        return cls(g, buffer, memory)


    def byte_runs(self, pages: Sequence[int] | torch.Tensor, head_group: int | None = None,
                  layers: range | None = None) -> list[tuple[int, int]]:
        """The contiguous ``(address, length)`` byte runs of the given host pages (or of one
        head group's layer range of them), page after page: what an L3 store registers and
        moves. See :func:`kvcore.layout.byte_runs`."""
        base = self.buffer.data_ptr()
        listed = pages.tolist() if isinstance(pages, torch.Tensor) else pages
        return [(base + off, n) for off, n in byte_runs(self.geometry, self.dtype.itemsize,
                                                        listed, head_group, layers)]
