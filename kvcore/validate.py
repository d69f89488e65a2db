"""Checks on index tensors and pools, run before any backend code sees them.

Every check raises a typed error naming the argument, what was expected and what came, and
changes nothing. Only index values already on the CPU are checked here (before anything is
enqueued); device-resident values are the kernels' to refuse (see :mod:`kvcore.plan`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref

import numpy as np
import torch

from kvcore.capabilities import INDEX_DTYPES
from kvcore.errors import InvalidArgument, InvalidIndices, TensorMismatch


def is_int(value: object) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_positive_int(name: str, value: object, context: str = "") -> None:
    """InvalidArgument naming ``name`` unless ``value`` is an int (see :func:`is_int`) above
    zero."""
    if not is_int(value) or value <= 0:  # type: ignore[operator]
        raise InvalidArgument(name, "a positive int", repr(value), context)


def check_instance(name: str, value: object, cls: type | tuple[type, ...], expected: str,
                   context: str = "") -> None:
    """InvalidArgument naming ``name`` unless ``value`` is an instance of ``cls``."""
    if not isinstance(value, cls):
        raise InvalidArgument(name, expected, type(value).__name__, context)


def as_layer(layer: object, expected: str = "an int", context: str = "") -> int:
    """``layer`` as a Python int where it is an integer (a NumPy integer or a 0-d integer
    tensor counts, a bool does not), else InvalidArgument naming ``layer``."""
    if type(layer) is int:
        return layer
    if is_int(layer) or (isinstance(layer, torch.Tensor) and layer.dim() == 0
                         and not layer.dtype.is_floating_point and not layer.dtype.is_complex
                         and layer.dtype is not torch.bool):
        return int(layer)  # type: ignore[call-overload]
    raise InvalidArgument("layer", expected, repr(layer), context)


def check_layer(layer: object, num_layers: int, context: str = "") -> int:
    """``layer`` as a Python int in ``[0, num_layers)`` (see :func:`as_layer`), else
    InvalidArgument naming ``layer``."""
    expected = f"an int in [0, {num_layers})"
    n = as_layer(layer, expected, context)
    if not 0 <= n < num_layers:
        raise InvalidArgument("layer", expected, repr(layer), context)
    return n


def describe_tensor(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on {t.device}"


def check_index_tensor(name: str, t: object, context: str = "") -> torch.Tensor:
    """A 1-D int32/int64 tensor, or TensorMismatch."""
    if not isinstance(t, torch.Tensor):
        raise TensorMismatch(name, "a 1-D int32 or int64 torch.Tensor", type(t).__name__, context)
    if t.dtype not in INDEX_DTYPES:
        raise TensorMismatch(name, "dtype int32 or int64", describe_tensor(t), context)
    if t.dim() != 1:
        raise TensorMismatch(name, "a 1-D tensor", describe_tensor(t), context)
    if t.layout is not torch.strided or (
            type(t) is not torch.Tensor
            and type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__):
        # (sparse tensors and wrapper subclasses have no memory a check or a kernel can read)
        raise TensorMismatch(name, "a dense (strided) torch.Tensor",
                             f"{describe_tensor(t)}, {type(t).__name__} of layout {t.layout}",
                             context)
    return t


def check_pages(name: str, values: torch.Tensor, page_size: int, context: str = "") -> None:
    """Whole pages: each run of page_size starts at a multiple of it and counts up by one."""
    if values.numel() % page_size:
        raise InvalidIndices(name, f"a length that is a multiple of page_size {page_size}",
                             f"{values.numel()} entries", context)
    pages = values.view(-1, page_size)
    starts = pages[:, 0]
    misaligned = torch.nonzero(starts % page_size).flatten()
    if misaligned.numel():
        i = int(misaligned[0])
        raise InvalidIndices(name, f"page starts that are multiples of page_size {page_size}",
                             f"{int(starts[i])} at position {i * page_size}", context)
    offsets = pages - starts[:, None]
    ramp = torch.arange(page_size, dtype=values.dtype)
    broken = torch.nonzero((offsets != ramp).any(dim=1)).flatten()
    if broken.numel():
        i = int(broken[0])
        raise InvalidIndices(name, "consecutive tokens within each page",
                             f"page at position {i * page_size} = "
                             f"{pages[i, :4].tolist()}...", context)


#: from this many runs on, finding a tensor's runs (to sort their starts only) costs less than
#: sorting all its values (finding them costs about 4 us, sorting about 0.7 us more per run of
#: 64 values, on a desktop core)
RUNS_FROM = 12


@functools.lru_cache(maxsize=16)
def _ramp(page_size: int) -> np.ndarray:
    return np.arange(page_size, dtype=np.int64)


def check_cpu_indices(name: str, t: torch.Tensor, size: int, context: str = "", *,
                      page_size: int | None = None, unique: bool = False,
                      runs: int | None = None) -> None:
    """Values of a CPU index tensor: in ``[0, size)``, whole pages of ``page_size`` (when
    given) and no value twice (``unique``). Runs on a NumPy view, no copy: this is on every
    submit's path, so it must cost microseconds, not a torch dispatch per check.

    Duplicates are looked for among the starts of the tensor's runs of consecutive values
    where it is made of them (whole pages, or ``runs``: the length its runs usually have):
    runs of one length overlap only where two sorted starts are closer than that length, so a
    page's tokens are not sorted one by one."""
    a = t.numpy() if t.is_contiguous() else t.contiguous().numpy()
    n = a.size
    if n == 0:
        return
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= size:
        raise InvalidIndices(name, f"values in [0, {size})", f"{lo if lo < 0 else hi}",
                             context)
    starts = None
    if page_size is not None and page_size > 1:
        if n % page_size:
            raise InvalidIndices(name, f"a length that is a multiple of page_size {page_size}",
                                 f"{n} entries", context)
        pages = a.reshape(-1, page_size)
        starts = pages[:, :1]
        if (starts % page_size).any() or ((pages - starts) != _ramp(page_size)).any():
            check_pages(name, t, page_size, context)  # names the first broken page
        run = page_size
    elif unique and runs is not None and runs > 1 and n % runs == 0 and n >= RUNS_FROM * runs:
        rows = a.reshape(-1, runs)
        if not ((rows - rows[:, :1]) != _ramp(runs)).any():
            starts, run = rows[:, :1], runs
    if unique and n > 1:
        if starts is not None:  # runs of `run` consecutive values
            ordered = np.sort(starts.ravel())
            dup = np.flatnonzero(ordered[1:] - ordered[:-1] < run)
            if dup.size:  # the later run starts inside the earlier one
                raise InvalidIndices(name, "no duplicate destination indices",
                                     f"{int(ordered[dup[0] + 1])} more than once", context)
            return
        ordered = np.sort(a)
        dup = np.flatnonzero(ordered[1:] == ordered[:-1])
        if dup.size:
            raise InvalidIndices(name, "no duplicate destination indices",
                                 f"{int(ordered[dup[0]])} more than once", context)


class _Memory:
    """``nbytes`` bytes at ``address`` as NumPy sees an array (``np.asarray`` of it): an array
    over memory it neither owns nor keeps alive. (A ctypes array type per length would be
    cached by ctypes for the life of the process.)"""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


class CheckedTensors:
    """CPU index tensors whose values need no check again: checked already (or made by kvcore
    itself) and holding the same values since.

    A tensor counts while it is the same object, of the same dtype, holding byte for byte the
    values it held when remembered (a copy of them is kept): whatever wrote into it since,
    torch or a NumPy view, a changed value is checked again. Comparing costs about a
    microsecond per thousand indices, against the tens a check costs. ``capacity``: how many
    tensors are remembered (the oldest is forgotten first); None: every one alive.

    :meth:`match` returns a proof: an object that stands for the values remembered, the same
    object while the tensor holds them and a new one each time they are remembered again. A
    caller that kept what it derived from those values (the index ring's staged slot) can
    tell by identity that they still hold.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self._capacity = capacity
        # id -> (weak reference, dtype, the bytes remembered, an array over the memory the
        # values were read from, and that memory's address: the array is read only while the
        # tensor, alive and laid out as then, still uses that memory)
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], torch.dtype, bytes,
                                       np.ndarray | None, int]] = {}
        self._lock = threading.Lock()

    def add(self, t: torch.Tensor, values: np.ndarray | None = None) -> object:
        """Remember ``t`` with its values now (a CPU tensor); return the proof of them (see
        :meth:`match`). ``values``: the NumPy array ``t`` was made from (``torch.from_numpy``:
        it shares ``t``'s memory and does not refer to ``t``): it saves converting ``t`` now."""
        key = id(t)
        # a bounded memory lets its dead entries age out; an unbounded one drops them as
        # their tensors go
        ref: weakref.ref[torch.Tensor]
        if self._capacity is not None:
            ref = weakref.ref(t)
        else:
            def forget(_: object, k: int = key) -> None:
                self._forget(k)
            ref = weakref.ref(t, forget)
        entry: tuple[weakref.ref[torch.Tensor], torch.dtype, bytes, np.ndarray | None, int]
        if values is not None:
            entry = (ref, t.dtype, values.tobytes(), values, t.data_ptr())
        elif t.is_contiguous():
            # an array over t's memory that does not keep it (or t) alive: a lookup reads it
            # only after finding t alive at that address with as many bytes
            nbytes, address = t.nbytes, t.data_ptr()
            raw = np.asarray(_Memory(address, nbytes)) if nbytes else np.empty(0, np.uint8)
            entry = (ref, t.dtype, raw.tobytes(), raw, address)
        else:
            entry = (ref, t.dtype, t.numpy().tobytes(), None, 0)
        with self._lock:
            entries = self._entries
            entries.pop(key, None)
            if self._capacity is not None and len(entries) >= self._capacity:
                entries.pop(next(iter(entries)), None)
            entries[key] = entry
        return entry

    def match(self, t: object) -> object | None:
        """The proof :meth:`add` returned for ``t`` where ``t`` still holds the values it
        remembered, else None (never false otherwise: ``t in self`` asks the same)."""
        entry = self._entries.get(id(t))
        if entry is None:
            return None
        tensor = entry[0]()
        if tensor is None or tensor is not t or tensor.dtype is not entry[1] or not tensor.is_cpu:
            return None
        remembered, values = entry[2], entry[3]
        if tensor.is_contiguous():
            nbytes = len(remembered)
            if tensor.nbytes != nbytes:
                return None
            address = tensor.data_ptr()
            # still at the memory the array reads, which covers its bytes: read the array
            if values is not None and address == entry[4] and values.nbytes == nbytes:
                same = values.tobytes() == remembered
            else:  # other memory (set_): its bytes, without NumPy
                same = ctypes.string_at(address, nbytes) == remembered
        else:
            same = tensor.numpy().tobytes() == remembered
        return entry if same else None

    __contains__ = match  # (one call fewer on every submit than a method calling it)

    def __len__(self) -> int:
        return len(self._entries)

    def discard(self, t: object) -> None:
        """Forget ``t`` (its values are checked again wherever it comes back)."""
        with self._lock:
            entry = self._entries.get(id(t))
            if entry is not None and entry[0]() is t:
                del self._entries[id(t)]

    def _forget(self, key: int) -> None:
        # a weakref callback, possibly inside add() on this thread (a collection): no lock,
        # and only an entry whose tensor is gone (not a newer tensor under a reused id)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is None:
            self._entries.pop(key, None)
