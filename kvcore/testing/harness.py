"""Run one :class:`~kvcore.testing.cases.Case` against a backend and the reference, and judge it.

Everything goes through kvcore's public API: pools, ``Registry.resolve``, ``TransferPlan.transfer``
and ``HiCacheController``. A check that fails raises :class:`ConformanceFailure` whose message
starts with the cause (bytes outside the destination, bytes that differ from the reference,
indices placed against the declared residency, a refusal that did not happen) and ends with a
reproduction: the case's facts, the index pages (abbreviated) and the seed.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import ParamSpec

import attrs
import pytest
import torch

from kvcore.capabilities import HostMemory, Residency
from kvcore.controller import HiCacheController
from kvcore.errors import (
    AllocatorError,
    InvalidArgument,
    InvalidIndices,
    KVCoreError,
    TensorMismatch,
)
from kvcore.layout import Geometry, Kind, Op, canonical_view, host_shape, split_heads
from kvcore.plan import TransferPlan
from kvcore.pools import DevicePool, HostPool
from kvcore.registry import Registry, make_request
from kvcore.streams import current_stream
from kvcore.testing.cases import Case, page_bytes
from kvcore.testing.recording import Received, RecordingBackend
from kvcore.verify import random_fill

REFERENCE = "reference"
P = ParamSpec("P")


class ConformanceFailure(AssertionError):
    """A backend did something the contract forbids; the message says what and how to rerun."""


#: frames of a backend's own raise kept in a failure's message (its cause is then dropped)
CAUSE_FRAMES = 4


def detached(check: Callable[P, None]) -> Callable[P, None]:
    """``check`` whose ConformanceFailure holds text only: no traceback into the frames that
    hold the case's pools, nor the backend's exception with its frames. Hypothesis keeps
    every failing example's exception while it shrinks, and pytest the last one: with the
    frames, a backend failing the randomised full-size cases kept gigabytes alive per case.
    The backend's raise stays in the message, its innermost frames as text."""

    @functools.wraps(check)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            check(*args, **kwargs)
            return
        except ConformanceFailure as failure:
            message = str(failure)
            cause = failure.__cause__
            if cause is not None:
                frames = traceback.format_tb(cause.__traceback__)[-CAUSE_FRAMES:]
                message += "\nwhere it raised (innermost frames):\n" + "".join(frames).rstrip()
            del cause
        # raised outside the handler: inside it, the new failure's __context__ would keep the
        # old one, and with it every frame
        raise ConformanceFailure(message)

    return run


@attrs.define
class Env:
    """What every case runs with: the backend under test, the device and the registry."""

    backend: str
    device: torch.device
    registry: Registry
    recorders: dict[str, RecordingBackend]
    #: the case sizes ("quick" or "full"), which a rerun must ask for again
    profile: str = "quick"
    #: what :func:`host_memory_claim` said, asked once (a string: the claim is broken)
    host_memory_problem: str | None = attrs.field(default=None, init=False)
    host_memory_asked: bool = attrs.field(default=False, init=False)

    def received(self) -> list[Received]:
        rec = self.recorders.get(str(self.device))
        return rec.received if rec is not None else []


@attrs.define
class Rig:
    """The pools and indices of one case, with snapshots taken before anything ran."""

    case: Case
    device_pool: DevicePool
    host_pool: HostPool
    host_indices: torch.Tensor  # token indices, int64 on cpu
    device_indices: torch.Tensor  # token indices, int64 on cpu
    host_before: torch.Tensor
    device_before: list[torch.Tensor]

    @property
    def geometry(self) -> Geometry:
        return self.host_pool.geometry


# -- building ---------------------------------------------------------------------------------


def _pages(n: int, total: int, order: str, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct page numbers out of ``total`` in the case's order (pages 0 and n+1.. are
    left as untouched neighbours for the ordered cases)."""
    if order == "ascending":
        return torch.arange(1, n + 1)
    if order == "reversed":
        return torch.arange(n, 0, -1)
    return torch.randperm(total, generator=gen)[:n]


def tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token indices of whole pages."""
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def spare_pages(n: int) -> int:
    return 2 + n // 8


def allocate_host(env: Env, name: str, g: Geometry, dtype: torch.dtype) -> HostPool:
    """A host pool allocated by backend ``name``'s own allocator."""
    backend = env.registry.instance(name, env.device)
    buffer, memory = backend.allocate_host(host_shape(g), dtype)  # type: ignore[attr-defined]
    return HostPool(g, buffer, memory)


def build(env: Env, case: Case, backend: str | None = None,
          device_pages: int | None = None) -> Rig:
    """Random device and host pools and the case's indices (all from the case's seed)."""
    gen = torch.Generator().manual_seed(case.seed)
    n, p = case.n_pages, case.page_size
    total = n + spare_pages(n)
    dev_total = device_pages or total
    dev = DevicePool.allocate(case.kind, case.num_layers, dev_total * p, case.head_num,
                              case.head_dim, case.dtype, env.device, p)
    for t in dev.all_buffers():
        random_fill(t, gen)
    g = Geometry(case.kind, case.layout, case.num_layers, total * p, case.head_num,
                 case.head_dim, p, case.head_group_num)
    host = allocate_host(env, backend or env.backend, g, case.dtype)
    random_fill(host.buffer, gen)  # the sentinel: every byte is checked afterwards
    h = tokens(_pages(n, total, case.order, gen), p)
    d = tokens(torch.randperm(dev_total, generator=gen)[:n], p)
    return Rig(case, dev, host, h, d, host.buffer.clone(),
               [t.clone() for t in dev.all_buffers()])


def twin(env: Env, rig: Rig) -> Rig:
    """A copy of ``rig``'s pools (host memory from the reference) for the oracle to run on."""
    dev = rig.device_pool.clone()
    host = allocate_host(env, REFERENCE, rig.geometry, rig.case.dtype)
    host.buffer.copy_(rig.host_before)
    return attrs.evolve(rig, device_pool=dev, host_pool=host)


def given_indices(env: Env, case: Case, h: torch.Tensor,
                  d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices as a caller hands them in: host on cpu and device on the device, or swapped
    (the plan must move them to where the variant wants them)."""
    hd, dd = (env.device, torch.device("cpu")) if case.swapped else (torch.device("cpu"),
                                                                        env.device)
    return h.to(device=hd, dtype=case.host_index_dtype), d.to(device=dd,
                                                               dtype=case.device_index_dtype)


# -- reporting --------------------------------------------------------------------------------


def _abbrev(values: list[int], head: int = 8, tail: int = 2) -> str:
    if len(values) <= head + tail:
        return str(values)
    shown = ", ".join(map(str, values[:head])) + ", ..., " + ", ".join(map(str, values[-tail:]))
    return f"[{shown}] ({len(values)} pages)"


def reproduction(env: Env, case: Case, rig: Rig | None = None) -> str:
    """The lines a failure ends with: everything needed to rerun the case."""
    lines = [f"reproduction: backend={env.backend} device={env.device} {case.describe()}"]
    if rig is not None:
        p = case.page_size
        lines.append(f"  host_indices pages:   {_abbrev((rig.host_indices[::p] // p).tolist())}")
        lines.append(f"  device_indices pages: {_abbrev((rig.device_indices[::p] // p).tolist())}")
    lines.append(f"  rerun: pytest --kvio-backend {env.backend} --kvio-device {env.device} "
                 f"--kvio-{env.profile} -k '{case.drawn_from or case.id}'")
    if case.drawn_from is not None:
        lines.append("  (a randomised example: the rerun draws the same examples in the same "
                     "order, this one among them)")
    return "\n".join(lines)


def fail(env: Env, case: Case, rig: Rig | None, message: str) -> ConformanceFailure:
    return ConformanceFailure(f"{message}\n{reproduction(env, case, rig)}")


# -- comparing --------------------------------------------------------------------------------


def element_neq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise "any byte differs" (NaN payloads compared as bytes), returned on the cpu.

    Compared where ``a`` lives, so device buffers are compared on the device and only the
    mask crosses to the host."""
    a8 = a.detach().contiguous().view(torch.uint8).view(*a.shape, a.element_size())
    b8 = b.detach().to(a.device).contiguous().view(torch.uint8).view(*b.shape,
                                                                     b.element_size())
    return (a8 != b8).any(-1).cpu()


def _host_written(rig: Rig, layers: range) -> torch.Tensor:
    """(kv, layer, page, token) mask of the host slots this case writes."""
    g, p = rig.geometry, rig.case.page_size
    mask = torch.zeros(g.kv_count, g.num_layers, g.num_pages, p, dtype=torch.bool)
    mask[:, layers.start:layers.stop, rig.host_indices // p, rig.host_indices % p] = True
    return mask


def _describe_host(rig: Rig, where: tuple[int, ...]) -> str:
    kv, layer, page, tok, group, head_in, dim = where
    token = page * rig.case.page_size + tok
    head = group * rig.geometry.heads_per_group + head_in
    name = ("K", "V")[kv] if rig.case.kind is Kind.MHA else "latent"
    return f"{name} layer {layer} host token {token} (page {page}, slot {tok}) head {head} " \
           f"item {dim}"


def check_host(env: Env, rig: Rig, after: torch.Tensor, oracle: torch.Tensor | None,
               layers: range, what: str) -> None:
    """Host bytes: untouched outside the written slots; equal to ``oracle`` everywhere."""
    g = rig.geometry
    changed = canonical_view(element_neq(after, rig.host_before), g)
    written = _host_written(rig, layers)[..., None, None, None]
    outside = changed & ~written
    if outside.any():
        where = tuple(int(x) for x in torch.nonzero(outside)[0])
        count = int(outside.flatten(4).any(-1).sum())
        raise fail(env, rig.case, rig,
                   f"{what} wrote outside its destination (untouched-neighbour check): "
                   f"{_describe_host(rig, where)} changed although that slot is not in "
                   f"host_indices ({count} such slots; is a bound or page-size computation "
                   f"off by one?)")
    if oracle is None:
        return
    wrong = canonical_view(element_neq(after, oracle), g)
    if wrong.any():
        where = tuple(int(x) for x in torch.nonzero(wrong)[0])
        count = int(wrong.sum())
        src = _source_token(rig, where)
        raise fail(env, rig.case, rig,
                   f"{what} differs from the reference at {_describe_host(rig, where)}"
                   f"{src} ({count} items differ; bytes got "
                   f"{_bytes_at(after, g, where)} expected {_bytes_at(oracle, g, where)})")


def _source_token(rig: Rig, where: tuple[int, ...]) -> str:
    token = where[2] * rig.case.page_size + where[3]
    hits = torch.nonzero(rig.host_indices == token).flatten()
    if not hits.numel():
        return ""
    return f", written from device token {int(rig.device_indices[int(hits[0])])}"


def _bytes_at(buffer: torch.Tensor, g: Geometry, where: tuple[int, ...]) -> str:
    item = canonical_view(buffer, g)[where]
    return item.reshape(1).view(torch.uint8).tolist().__str__()


def check_device(env: Env, rig: Rig, pool: DevicePool, oracle: DevicePool | None,
                 layers: range, written: bool, what: str) -> None:
    """Device bytes: untouched outside the written rows; equal to ``oracle`` everywhere."""
    rows = torch.zeros(pool.size, dtype=torch.bool)
    if written:
        rows[rig.device_indices] = True
    for kv in range(rig.geometry.kv_count):
        name = ("K", "V")[kv] if rig.case.kind is Kind.MHA else "latent"
        for layer, t in enumerate(pool.layers(kv)):
            before = rig.device_before[kv * pool.num_layers + layer]
            moved = written and layer in layers
            changed = element_neq(t, before)
            outside = changed & ~(rows[:, None, None] if moved else torch.zeros_like(changed))
            if outside.any():
                tok, head, dim = (int(x) for x in torch.nonzero(outside)[0])
                why = ("that row is not in device_indices" if moved else
                       f"{what} must not write {'this layer' if written else 'the device'}")
                raise fail(env, rig.case, rig,
                           f"{what} wrote outside its destination (untouched-neighbour check): "
                           f"{name} layer {layer} device token {tok} head {head} item {dim} "
                           f"changed, but {why}")
            if oracle is None:
                continue
            wrong = element_neq(t, oracle.layers(kv)[layer])
            if wrong.any():
                tok, head, dim = (int(x) for x in torch.nonzero(wrong)[0])
                hits = torch.nonzero(rig.device_indices == tok).flatten()
                src = (f", loaded from host token {int(rig.host_indices[int(hits[0])])}"
                       if hits.numel() else "")
                raise fail(env, rig.case, rig,
                           f"{what} differs from the reference at {name} layer {layer} device "
                           f"token {tok} head {head} item {dim}{src} "
                           f"({int(wrong.sum())} items differ in this layer)")


def check_placement(env: Env, case: Case, rig: Rig, seen: list[Received],
                    expect_variant: str | None) -> None:
    """Every run() got its indices where the chosen variant declared, of the expected variant."""
    if not seen:
        raise fail(env, case, rig, "the backend's run() was never called for this transfer")
    for r in seen:
        errors = r.placement_errors()
        if errors:
            raise fail(env, case, rig, "index placement disagrees with the declared "
                       "residency: " + "; ".join(errors))
        if expect_variant not in (None, "-") and r.variant != expect_variant:
            raise fail(env, case, rig, f"the plan ran variant {r.variant!r}, the case expected "
                       f"{expect_variant!r} for pages of this size")


# -- running ----------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def resolve(env: Env, case: Case, op: Op, backend: str) -> TransferPlan:
    req = make_request(op, case.kind, case.layout, case.dtype, case.element_bytes, env.device)
    return env.registry.resolve(req, backend)


def transfer(env: Env, case: Case, rig: Rig, op: Op, backend: str, h: torch.Tensor,
             d: torch.Tensor) -> None:
    """Run ``op`` over every layer through the one submit, as the controller issues it, and
    wait for it: a per-layer load goes layer by layer (every call after the first marked
    ``chained``, so a backend that reads early is tested doing so) or, on a ``layer_signals``
    variant, as one call whose signals the current stream then waits on layer by layer."""
    plan = resolve(env, case, op, backend)
    sub = plan.transfer(rig.device_pool, rig.host_pool, h, d)
    stream = current_stream(env.device)
    for layer in sub.layers:  # as a consumer would, layer by layer
        sub.wait_layer(layer, stream)
    synchronize(env.device)
    sub.check()


def run_backend(env: Env, case: Case, rig: Rig, op: Op, h: torch.Tensor,
                d: torch.Tensor) -> list[Received]:
    """Run the backend under test; a raise becomes a failure naming what run() received."""
    seen = env.received()
    start = len(seen)
    try:
        transfer(env, case, rig, op, env.backend, h, d)
    except Exception as exc:  # any raise is the backend's failure, reported
        raise fail(env, case, rig, _raised(op, exc, seen[start:], env.device)) from exc
    return seen[start:]


def _raised(op: Op, exc: Exception, got: list[Received], device: torch.device) -> str:
    """What a failure of the backend under test says: the raise, what run() received, and
    only the hints that can apply."""
    lines = [f"{op.value} raised {type(exc).__name__}: {exc}"]
    if not got:
        lines.append("run() was not reached (the error above says what stopped the call "
                     "first)")
        return "\n  ".join(lines)
    lines.append(got[-1].summary())
    if not isinstance(exc, KVCoreError):
        lines.append(f"run() raised a bare {type(exc).__name__}: the contract asks for a "
                     "kvcore.errors.KVCoreError subclass (KernelError for a kernel that failed, "
                     "InvalidArgument naming the argument for one the backend cannot take; "
                     "docs/writing-a-backend.md, Errors)")
    if torch.device("cpu") != device:  # on the CPU both residencies are the same memory
        lines.append("if the kernel needs its indices elsewhere, the residency its OpSupport "
                     "declares is wrong")
    return "\n  ".join(lines)


def expected_variant(env: Env, case: Case, h: torch.Tensor, d: torch.Tensor) -> str | None:
    """The variant a submit of ``h`` and ``d`` must run: the case's, unless it wants an index
    on the CPU that the caller keeps on the device; then the first variant whose page window
    holds the case's pages and that takes both on the device (a submit never copies device
    indices back to the CPU, which would wait for the device)."""
    if case.variant in (None, "-"):
        return case.variant
    plan = resolve(env, case, case.op, env.backend)
    declared = next((v for v in plan.variants if v.variant == case.variant), None)
    if declared is None or not any(
            t.device.type != "cpu" and spec.residency is Residency.HOST
            for t, spec in ((h, declared.host_index), (d, declared.device_index))):
        return case.variant
    pb = plan_page_bytes(case)
    return next((v.variant for v in plan.variants if v.fits_page(pb)
                 and v.host_index.residency is Residency.DEVICE
                 and v.device_index.residency is Residency.DEVICE), case.variant)


def skip_if_host_memory_is_misdeclared(env: Env) -> None:
    """Skip a transfer case when the backend's allocator contradicts its declared host
    memory: every transfer would be refused at bind for it, so TestHostMemory's one failure
    says it instead of one failure per case."""
    if not env.host_memory_asked:
        env.host_memory_problem = host_memory_claim(env)
        env.host_memory_asked = True
    if env.host_memory_problem is not None:
        pytest.skip(f"not run: the host allocator contradicts the capabilities "
                    f"({env.host_memory_problem}; TestHostMemory fails for it)")


@detached
def check_transfer(env: Env, case: Case) -> None:
    """The differential check of one op: backend vs reference on identical pools."""
    skip_if_host_memory_is_misdeclared(env)
    rig = build(env, case)
    ref = twin(env, rig)
    h, d = given_indices(env, case, rig.host_indices, rig.device_indices)
    seen = run_backend(env, case, rig, case.op, h, d)
    check_placement(env, case, rig, seen, expected_variant(env, case, h, d))
    transfer(env, case, ref, case.op, REFERENCE, h, d)
    layers = range(case.num_layers)
    what = f"{env.backend} {case.op.value}"
    if case.op is Op.WRITE_BACK:
        check_device(env, rig, rig.device_pool, None, layers, False, what)
        check_host(env, rig, rig.host_pool.buffer, ref.host_pool.buffer, layers, what)
        check_host(env, ref, ref.host_pool.buffer, _expected_host(rig), layers,
                   "the reference (oracle self-check)")
    else:
        check_host(env, rig, rig.host_pool.buffer, rig.host_before, range(0), what)
        check_device(env, rig, rig.device_pool, ref.device_pool, layers, True, what)


def _expected_host(rig: Rig) -> torch.Tensor:
    """What a write-back of ``rig`` must leave in the host buffer, computed by the suite."""
    g, p = rig.geometry, rig.case.page_size
    out = rig.host_before.clone()
    view = canonical_view(out, g)
    page, off = rig.host_indices // p, rig.host_indices % p
    for kv in range(g.kv_count):
        src = torch.stack([t[rig.device_indices.to(t.device)].cpu()
                           for t in rig.device_pool.layers(kv)])
        view[kv, :, page, off] = split_heads(src, g)
    return out


@detached
def check_round_trip(env: Env, case: Case) -> None:
    """Write pages back, load them into other device pages, and find the original bytes."""
    assert case.then is not None
    skip_if_host_memory_is_misdeclared(env)
    n, p = case.n_pages, case.page_size
    rig = build(env, case, device_pages=2 * n + 2)
    src = rig.device_indices
    used = set((src[::p] // p).tolist())
    free = [q for q in range(rig.device_pool.size // p) if q not in used]
    gen = torch.Generator().manual_seed(case.seed + 1)
    dst_pages = torch.tensor(free)[torch.randperm(len(free), generator=gen)[:n]]
    dst = tokens(dst_pages, p)
    h0, d0 = given_indices(env, case, rig.host_indices, src)
    run_backend(env, case, rig, Op.WRITE_BACK, h0, d0)
    rig_load = attrs.evolve(rig, device_indices=dst, host_before=rig.host_pool.buffer.clone(),
                            device_before=[t.clone() for t in rig.device_pool.all_buffers()])
    h1, d1 = given_indices(env, case, rig.host_indices, dst)
    run_backend(env, case, rig_load, case.then, h1, d1)
    what = f"{env.backend} round trip ({case.then.value})"
    check_device(env, rig_load, rig.device_pool, None, range(case.num_layers), True, what)
    for kv in range(rig.geometry.kv_count):
        for layer, t in enumerate(rig.device_pool.layers(kv)):
            original = rig.device_before[kv * case.num_layers + layer][src.to(t.device)]
            wrong = element_neq(t[dst.to(t.device)], original)
            if wrong.any():
                i, head, dim = (int(x) for x in torch.nonzero(wrong)[0])
                raise fail(env, case, rig_load,
                           f"{what}: device token {int(dst[i])} layer {layer} head {head} item "
                           f"{dim} does not hold the bytes written back from device token "
                           f"{int(src[i])} via host token {int(rig.host_indices[i])}")


# -- refusals ---------------------------------------------------------------------------------


@attrs.frozen
class Refusal:
    """A bad call and the typed error (and argument) it must be refused with."""

    call: Callable[[], object]
    error: type[KVCoreError]
    argument: str | None


def _bad_call(env: Env, case: Case, rig: Rig) -> Refusal:
    plan = resolve(env, case, case.op, env.backend)
    h, d = rig.host_indices, rig.device_indices.to(env.device)
    # index values are refused before anything runs when they are on the CPU; a device
    # resident one out of range fails its transfer at completion instead (tests/gpu)
    d_cpu = rig.device_indices.cpu()
    layer = 0 if case.op is Op.LOAD_LAYER else None
    size = rig.geometry.size

    def run(hh: object, dd: object, lay: int | None = layer) -> Callable[[], object]:
        return lambda: plan.transfer(rig.device_pool, rig.host_pool, hh, dd,  # type: ignore[arg-type]
                                     layer=lay)

    dup_h = torch.cat([h[: case.page_size], h[: case.page_size]])
    dup_d = torch.cat([d_cpu[: case.page_size], d_cpu[: case.page_size]])
    p = case.page_size
    table: dict[str, Refusal] = {
        "host_out_of_range": Refusal(run(h + size, d), InvalidIndices, "host_indices"),
        "device_out_of_range": Refusal(run(h, d_cpu + rig.device_pool.size), InvalidIndices,
                                       "device_indices"),
        "misaligned_page": Refusal(run((h + 1) % size, d), InvalidIndices, "host_indices"),
        "length_mismatch": Refusal(run(h, d[:-p]), InvalidIndices, "device_indices"),
        "duplicate_destination": (
            Refusal(run(dup_h, d[: 2 * p]), InvalidIndices, "host_indices")
            if case.op is Op.WRITE_BACK else
            Refusal(run(h[: 2 * p], dup_d), InvalidIndices, "device_indices")),
        "float_indices": Refusal(run(h.to(torch.float32), d), TensorMismatch, "host_indices"),
        "two_dim_indices": Refusal(run(h, d.view(-1, p)), TensorMismatch, "device_indices"),
        "layer_out_of_range": Refusal(run(h, d, case.num_layers), InvalidArgument, "layer"),
    }
    return table[case.bad]  # type: ignore[index]


def _controller_call(env: Env, case: Case, rig: Rig) -> tuple[Refusal, HiCacheController]:
    ctl = HiCacheController(rig.device_pool, rig.host_pool, backend=env.backend,
                            registry=env.registry)
    if case.bad == "controller_host_full":
        too_many = tokens(torch.arange(rig.device_pool.size // case.page_size), case.page_size)
        return Refusal(lambda: ctl.write(too_many.to(env.device)), AllocatorError, None), ctl
    # CPU indices: their values are checked before anything is enqueued (device-resident ones
    # fail the write at completion instead, see tests/gpu/test_submit_path.py)
    bad = rig.device_indices.cpu() + rig.device_pool.size
    return Refusal(lambda: ctl.write(bad), InvalidIndices, "device_indices"), ctl


@detached
def check_refusal(env: Env, case: Case) -> None:
    """A bad call is refused with the typed error, before the backend runs, changing nothing."""
    rig = build(env, case, device_pages=case.n_pages + spare_pages(case.n_pages) + 2)
    allocator_before = None
    if case.bad is not None and case.bad.startswith("controller"):
        refusal, ctl = _controller_call(env, case, rig)
        allocator_before = ctl.allocator.state()
    else:
        refusal, ctl = _bad_call(env, case, rig), None
    seen = env.received()
    start = len(seen)
    try:
        refusal.call()
    except KVCoreError as exc:
        if not isinstance(exc, refusal.error):
            raise fail(env, case, rig, f"{case.bad}: refused with {type(exc).__name__}, "
                       f"expected {refusal.error.__name__}: {exc}") from exc
        argument = getattr(exc, "argument", None)
        if refusal.argument is not None and argument != refusal.argument:
            raise fail(env, case, rig, f"{case.bad}: the error names {argument!r}, expected "
                       f"{refusal.argument!r}: {exc}") from exc
    except Exception as exc:  # an untyped error is the failure being tested
        raise fail(env, case, rig, f"{case.bad}: raised untyped {type(exc).__name__}: {exc}; "
                   f"expected {refusal.error.__name__} (a KVCoreError)") from exc
    else:
        synchronize(env.device)
        raise fail(env, case, rig, f"{case.bad}: the call was accepted; expected "
                   f"{refusal.error.__name__}")
    synchronize(env.device)
    if len(seen) > start:
        raise fail(env, case, rig, f"{case.bad}: the backend's run() was called although the "
                   "call was refused")
    what = f"refused {case.bad}"
    check_host(env, rig, rig.host_pool.buffer, rig.host_before, range(0), what)
    check_device(env, rig, rig.device_pool, None, range(0), False, what)
    if ctl is not None and ctl.allocator.state() != allocator_before:
        raise fail(env, case, rig, f"{case.bad}: the host slot allocator changed although the "
                   "write was refused (host pages leaked)")


def host_memory_claim(env: Env) -> str | None:
    """Why the backend's allocator contradicts its declared host memory, or None."""
    caps = env.registry.get(env.backend).spec.capabilities
    backend = env.registry.instance(env.backend, env.device)
    buffer, memory = backend.allocate_host((4, 16), torch.bfloat16)  # type: ignore[attr-defined]
    if buffer.device.type != "cpu":
        return f"allocate_host returned a tensor on {buffer.device}, not host memory"
    if memory is HostMemory.PINNED and not buffer.is_pinned():
        return "allocate_host says the buffer is pinned, but torch reports it is not"
    if caps.host_memory is HostMemory.PINNED and memory is not HostMemory.PINNED:
        return (f"capabilities declare host_memory pinned, allocate_host returned "
                f"{memory.value} memory")
    return None


def plan_page_bytes(case: Case) -> int:
    return page_bytes(case.op, case.page_size, case.element_bytes, case.num_layers)
