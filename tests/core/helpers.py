"""Shared helpers of the core tests: poisoning, pools, fake backends, fake installed plugins."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from kvio_reference.backend import ReferenceBackend

from kvcore.capabilities import (
    API_VERSION,
    Availability,
    Available,
    BackendSpec,
    Capabilities,
    HostMemory,
    OpSupport,
    Residency,
    op_support,
)
from kvcore.layout import Kind, Layout, Op, layouts_for
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import Registry, allocate_host_pool
from kvcore.testing.recording import Received, RecordingBackend

#: Every (kind, layout) pair that exists.
KIND_LAYOUTS = [(k, lay) for k in Kind for lay in layouts_for(k)]

#: Four bytes repeated over every poisoned buffer; random data never reproduces it by chance.
SENTINEL = bytes([0xDE, 0xAD, 0xBE, 0xEF])


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` (any dtype) with the repeating SENTINEL byte pattern."""
    raw = t.view(-1).view(torch.uint8)
    pattern = torch.tensor(list(SENTINEL), dtype=torch.uint8)
    reps = -(-raw.numel() // len(SENTINEL))
    raw.copy_(pattern.repeat(reps)[: raw.numel()])


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``t``'s shape and dtype holding only the sentinel."""
    out = torch.empty_like(t)
    poison(out)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (so comparisons are bit exact, NaN payloads included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def page_tokens(pages: Iterable[int], page_size: int, dtype: torch.dtype = torch.int64,
                ) -> torch.Tensor:
    """Token indices of whole ``pages``, in the given page order."""
    p = torch.tensor(list(pages), dtype=torch.int64)
    ramp = torch.arange(page_size, dtype=torch.int64)
    return (p[:, None] * page_size + ramp).flatten().to(dtype)


def make_pools(kind: Kind, layout: Layout, *, num_layers: int, host_pages: int,
               device_size: int, head_num: int, head_dim: int, page_size: int,
               dtype: torch.dtype, registry: Registry) -> tuple[DevicePool, HostPool]:
    """A CPU device pool and a host pool allocated through the reference backend."""
    dev = DevicePool.allocate(kind, num_layers, device_size, head_num, head_dim, dtype, "cpu",
                              page_size)
    host = allocate_host_pool(kind, layout, num_layers, host_pages * page_size, head_num,
                             head_dim, dtype, page_size, "cpu", backend="reference",
                             registry=registry)
    return dev, host


def snapshot(dev: DevicePool, host: HostPool) -> tuple[list[torch.Tensor], torch.Tensor, object]:
    """Copies of every pool byte and the allocator state, to prove a refusal changed nothing."""
    return ([t.clone() for t in dev.all_buffers()], host.buffer.clone(), host.allocator.state())


def assert_unchanged(dev: DevicePool, host: HostPool, before: tuple) -> None:
    dev_bufs, host_buf, alloc_state = before
    assert all(bytes_equal(a, b) for a, b in zip(dev.all_buffers(), dev_bufs, strict=True))
    assert bytes_equal(host.buffer, host_buf)
    assert host.allocator.state() == alloc_state


# -- fake backends ---------------------------------------------------------------------------


def all_ops(layouts: Iterable[Layout] = tuple(Layout), kinds: Iterable[Kind] = tuple(Kind),
            **kw: object) -> tuple[OpSupport, ...]:
    """One default variant per op for ``kinds`` x ``layouts``, reference-like residency."""
    return tuple(op_support(op, tuple(kinds), tuple(layouts), Residency.HOST, Residency.DEVICE,
                            **kw) for op in Op)


def fake_spec(name: str, priority: int = 10, ops: tuple[OpSupport, ...] | None = None, *,
              probe: Callable[[], Availability] = Available,
              device_types: frozenset[str] | None = None,
              host_memory: HostMemory = HostMemory.PLAIN, api_version: int = API_VERSION,
              received: list[Received] | None = None) -> BackendSpec:
    """A backend spec whose instances record their jobs and delegate to the reference."""
    log = received if received is not None else []
    caps = Capabilities(name=name, version="9.9", api_version=api_version, platform="fake",
                        priority=priority, probe=probe, ops=all_ops() if ops is None else ops,
                        host_memory=host_memory, device_types=device_types)
    return BackendSpec(capabilities=caps,
                       factory=lambda device: RecordingBackend(ReferenceBackend(device), log))


def reference_only() -> Registry:
    """A registry that imports only the reference plugin and ignores the caller's env."""
    return Registry(environ={"KVCORE_PLUGINS": ""})


# -- fake installed distributions ------------------------------------------------------------


def install_fake_plugin(root: Path, dist: str, entry_point: str, module: str,
                        source: str) -> None:
    """Write ``<dist>-0.1.dist-info/`` (METADATA, entry_points.txt) and ``<module>.py``.

    With ``root`` on sys.path, importlib-metadata finds the distribution and its entry point
    in group ``kvcore.backends`` exactly as it finds a pip-installed plugin.
    """
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"  # escaped as in a wheel
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvcore.backends]\n{entry_point} = {module}\n")
    (info / "RECORD").write_text("")


BROKEN_PLUGIN_SOURCE = """
    raise RuntimeError("fake plugin exploded on import")
"""

GOOD_PLUGIN_SOURCE = """
    import kvcore
    from kvcore.capabilities import API_VERSION, Available, BackendSpec, Capabilities
    from kvcore.capabilities import HostMemory, Residency, op_support
    from kvcore.layout import Kind, Layout, Op

    CAPS = Capabilities(
        name={name!r}, version="0.3", api_version=API_VERSION + {api_offset}, platform="fake",
        priority=5, probe=Available,
        ops=tuple(op_support(op, tuple(Kind), tuple(Layout), Residency.HOST, Residency.DEVICE)
                  for op in Op),
        host_memory=HostMemory.PLAIN)


    def _factory(device):
        from kvio_reference.backend import ReferenceBackend
        return ReferenceBackend(device)


    @kvcore.hookimpl
    def kvcore_register_backends(register):
        register(BackendSpec(capabilities=CAPS, factory=_factory))
"""


def good_plugin_source(name: str, api_offset: int = 0) -> str:
    """Source of a working plugin module registering backend ``name`` (API version + offset)."""
    return GOOD_PLUGIN_SOURCE.replace("{name!r}", repr(name)).replace("{api_offset}",
                                                                      str(api_offset))
