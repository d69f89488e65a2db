"""Discovery, loading and selection of backends.

Plugins are found through the ``kvcore.backends`` entry-point group and registered with
pluggy. Environment variables, read at discovery:

``KVCORE_PLUGINS``
    Comma-separated allow-list of plugins to import, each ``NAME`` (the entry point) or
    ``NAME@DISTRIBUTION`` (that entry point of that distribution only). Unset: all installed
    plugins. Empty string: none besides ``reference``. This is how to keep untrusted
    installed packages from being imported at all: the decision is made from the installed
    metadata (entry point and distribution names), before anything is imported.
``KVCORE_BACKEND``
    Force one backend by name for every request (same as the ``backend=`` argument).
``KVCORE_STRICT``
    ``1``: a plugin that fails to import or register is fatal instead of reported and
    skipped. Meant for plugin authors and CI.

Names are claimed, never raced for: the shipped plugins' entry-point names (``reference``,
``cuda``, ``rocm``) are trusted only from their own distributions (:data:`SHIPPED`), and
another distribution claiming one of them is an impostor, refused without being imported.
Any other name claimed by two distributions is refused for both (pin one with
``NAME@DISTRIBUTION``), never resolved by import order. Refusals are listed by
:meth:`Registry.refused` and ``kvio backends``.

Selection (:meth:`Registry.resolve`): an explicit name wins; otherwise the available backend
of highest priority whose capabilities cover the request, ties broken by name. When nothing
fits, :class:`~kvcore.errors.NoBackend` lists every candidate and why it was refused,
including import errors.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import attrs
import pluggy
import torch

from kvcore import hookspecs
from kvcore.capabilities import (
    API_VERSION,
    Availability,
    BackendSpec,
    OpSupport,
    Unavailable,
    safe_probe,
)
from kvcore.errors import (
    NO_PLUGIN_HINT,
    ApiVersionMismatch,
    BackendUnavailable,
    BuildError,
    InvalidArgument,
    KVCoreError,
    NoBackend,
    PluginLoadError,
)
from kvcore.layout import (
    Geometry,
    Kind,
    Layout,
    Op,
    byte_strides,
    check_combination,
    host_shape,
    parse_enum,
)
from kvcore.plan import TransferPlan, TransferRequest
from kvcore.pools import HostPool
from kvcore.streams import resolve_device
from kvcore.validate import check_instance, check_positive_int

try:  # the backport is a declared dependency; the stdlib module serves where it is absent
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    import importlib.metadata as metadata  # type: ignore[no-redef]

ENTRY_POINT_GROUP = "kvcore.backends"
REFERENCE = "reference"

#: entry-point name -> the (normalized) distribution that ships it; no other may claim it
SHIPPED = {"reference": "kvio-reference", "cuda": "kvio-cuda", "rocm": "kvio-rocm"}


def normalize_distribution(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503): ``Kvio_Reference`` gives
    ``kvio-reference``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class RefusedPlugin:
    """An installed entry point that was not imported because its name is not its own."""

    name: str
    distribution: str | None
    reason: str


@attrs.frozen
class BrokenPlugin:
    """A plugin that could not be imported or registered."""

    name: str
    distribution: str | None
    error: BaseException = attrs.field(eq=False)
    traceback: str = attrs.field(eq=False, repr=False)

    @property
    def reason(self) -> str:
        return f"plugin {self.name!r} failed to load: {type(self.error).__name__}: {self.error}"


@attrs.frozen
class Registered:
    """A backend known to the registry and where it came from."""

    spec: BackendSpec
    source: str  # entry-point name, or "in-process"
    distribution: str | None = None

    @property
    def name(self) -> str:
        return self.spec.capabilities.name


@attrs.frozen
class Resolution:
    """How a request was (or was not) resolved: the winner and why each other lost."""

    request: TransferRequest
    chosen: Registered | None
    variants: tuple[OpSupport, ...]
    reasons: dict[str, str]
    order: tuple[str, ...]
    forced: str | None = None  # the backend asked for by name (argument or KVCORE_BACKEND)


def _strict(environ: dict[str, str] | os._Environ[str]) -> bool:
    return environ.get("KVCORE_STRICT", "").strip() not in ("", "0")


class Registry:
    """Backends known to this process. Most code uses :func:`default_registry`."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._backends: dict[str, Registered] = {}
        self._broken: dict[str, BrokenPlugin] = {}
        self._refused: dict[tuple[str, str | None], RefusedPlugin] = {}
        self._availability: dict[str, Availability] = {}
        self._instances: dict[tuple[str, str], object] = {}
        self._discovered = False
        self._lock = threading.RLock()

    # -- discovery -------------------------------------------------------------------------

    def allowed_plugins(self) -> set[str] | None:
        """The entry-point names of the KVCORE_PLUGINS allow-list (None when unset:
        everything is allowed); see :meth:`allow_list` for the distributions."""
        allow = self.allow_list()
        return None if allow is None else set(allow)

    def allow_list(self) -> dict[str, frozenset[str]] | None:
        """KVCORE_PLUGINS as entry-point name -> the normalized distributions it is trusted
        from (empty: whichever one distribution claims it). None when unset. ``reference``
        is always in it."""
        raw = self._environ.get("KVCORE_PLUGINS")
        if raw is None:
            return None
        allow: dict[str, set[str]] = {REFERENCE: set()}
        for item in (p.strip() for p in raw.split(",")):
            if not item:
                continue
            name, _, dist = (part.strip() for part in item.partition("@"))
            pins = allow.setdefault(name, set())
            if dist:
                pins.add(normalize_distribution(dist))
        return {name: frozenset(pins) for name, pins in allow.items()}

    def discover(self) -> None:
        """Import allowed entry points and register their backends (once; idempotent).

        Which entry points are imported is decided from the installed metadata alone (see
        the module's docstring); refused ones are recorded in :meth:`refused`.
        """
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            self._refused = {}
            claimed = self._claims()
            for name, claims in claimed.items():
                chosen = self._trusted_claim(name, claims)
                if chosen is not None:
                    self._load_entry_point(*chosen)
            for name in sorted(set(self.allow_list() or ()) - set(claimed) - {REFERENCE}):
                # a typo in the allow-list would otherwise leave its plugin out unsaid
                self._refuse(name, None, f"KVCORE_PLUGINS names {name!r}, but no installed "
                                         "distribution has that entry point (installed: "
                                         f"{', '.join(sorted(claimed)) or 'none'})")

    def _claims(self) -> dict[str, list[tuple[metadata.EntryPoint, str | None]]]:
        """Installed entry points by name, each with its distribution (one per distribution)."""
        claims: dict[str, list[tuple[metadata.EntryPoint, str | None]]] = {}
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            same = claims.setdefault(ep.name, [])
            if not any(_same_dist(dist, d) for _, d in same):
                same.append((ep, dist))
        return claims

    def _trusted_claim(self, name: str, claims: list[tuple[metadata.EntryPoint, str | None]],
                       ) -> tuple[metadata.EntryPoint, str | None] | None:
        """The one claim of ``name`` to import, or None; refusals are recorded."""
        owner = SHIPPED.get(name)
        if owner is not None:
            for _, dist in claims:
                if not _same_dist(dist, owner):
                    self._refuse(name, dist, f"entry point {name!r} belongs to the shipped "
                                             f"distribution {owner}, not to {dist or 'unknown'}"
                                             f" (an impostor); not imported")
            claims = [c for c in claims if _same_dist(c[1], owner)]
        allow = self.allow_list()
        if allow is not None:
            if name not in allow:
                return None
            pins = allow[name]
            if pins:
                for _, dist in claims:
                    if dist is None or normalize_distribution(dist) not in pins:
                        self._refuse(name, dist, f"KVCORE_PLUGINS trusts {name!r} only from "
                                                 f"{', '.join(sorted(pins))}; not imported")
                claims = [c for c in claims
                          if c[1] is not None and normalize_distribution(c[1]) in pins]
        if len(claims) > 1:
            dists = ", ".join(str(d) for _, d in claims)
            for _, dist in claims:
                self._refuse(name, dist, f"entry point {name!r} is claimed by {len(claims)} "
                                         f"distributions ({dists}); none imported. Trust one "
                                         f"with KVCORE_PLUGINS={name}@DISTRIBUTION")
            return None
        return claims[0] if claims else None

    def _refuse(self, name: str, dist: str | None, reason: str) -> None:
        self._refused[(name, dist)] = RefusedPlugin(name, dist, reason)

    def _load_entry_point(self, ep: metadata.EntryPoint, dist: str | None) -> None:
        try:
            module = ep.load()
            if self._pm.is_registered(module):
                return
            self._pm.register(module, name=ep.name)
            impls = [i for i in self._pm.hook.kvcore_register_backends.get_hookimpls()
                     if i.plugin_name == ep.name]
            staged: list[BackendSpec] = []
            for impl in impls:
                impl.function(register=staged.append)
            self._check_staged(ep, dist, impls, staged)
            for spec in staged:
                self.register(spec, source=ep.name, distribution=dist)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._pm.unregister(name=ep.name)
            broken = BrokenPlugin(ep.name, dist, exc, traceback.format_exc())
            self._broken[ep.name] = broken
            if _strict(self._environ):
                self._discovered = False  # stay fatal on the next query, not half-discovered
                raise PluginLoadError(broken.reason + " (KVCORE_STRICT=1)",
                                      plugin_traceback=broken.traceback) from exc

    @staticmethod
    def _check_staged(ep: metadata.EntryPoint, dist: str | None, impls: list[Any],
                      staged: list[Any]) -> None:
        """What an entry point's hook registered, before any of it is: at least one
        BackendSpec, each name once, and a shipped backend's name only from its own
        distribution (else another plugin could stand in for the reference oracle)."""
        where = f"entry point {ep.name!r} ({dist or 'unknown distribution'})"
        if not impls:
            raise PluginLoadError(
                f"{where} imported {ep.value.split(':')[0]} but registered no backend: it has "
                "no kvcore_register_backends hook (missing @kvcore.hookimpl, or a misspelled "
                "hook name?)")
        if not staged:
            raise PluginLoadError(f"{where}: its kvcore_register_backends hook called "
                                  "register() for no backend")
        names: list[str] = []
        for spec in staged:
            if not isinstance(spec, BackendSpec):
                raise PluginLoadError(f"{where}: register() expects a kvcore.BackendSpec, "
                                      f"got {type(spec).__name__}")
            name = spec.capabilities.name
            if name in names:
                raise PluginLoadError(f"{where} registered backend {name!r} twice")
            names.append(name)
            owner = SHIPPED.get(name)
            if owner is not None and not _same_dist(dist, owner):
                raise PluginLoadError(
                    f"{where} registered a backend named {name!r}, the name of the shipped "
                    f"distribution {owner}'s backend (an impostor); refused")

    def register(self, spec: BackendSpec, source: str = "in-process",
                 distribution: str | None = None) -> None:
        """Register a backend directly (tests, embedding). Refuses API mismatches and dupes."""
        caps = spec.capabilities
        if type(caps.api_version) is not int:
            raise PluginLoadError(f"backend {caps.name!r}: api_version: expected the int "
                                  f"{API_VERSION} (kvcore.API_VERSION), got "
                                  f"{caps.api_version!r} ({type(caps.api_version).__name__})")
        if caps.api_version != API_VERSION:
            raise ApiVersionMismatch(caps.name, caps.version, caps.api_version, API_VERSION)
        with self._lock:
            if caps.name in self._backends:
                other = self._backends[caps.name].source
                raise PluginLoadError(
                    f"backend name {caps.name!r} from {source} is already registered by {other}")
            self._backends[caps.name] = Registered(spec, source, distribution)

    def unregister(self, name: str) -> None:
        """Remove backend ``name`` (tests and :meth:`isolated` scopes); an unknown name is
        ignored."""
        with self._lock:
            self._backends.pop(name, None)
            self._availability.pop(name, None)
            self._instances = {k: v for k, v in self._instances.items() if k[0] != name}

    @contextlib.contextmanager
    def isolated(self) -> Iterator[Registry]:
        """Snapshot the registry and restore it on exit, so tests do not leak registrations."""
        self.discover()
        with self._lock:
            saved = (dict(self._backends), dict(self._broken), dict(self._availability),
                     dict(self._instances))
        try:
            yield self
        finally:
            with self._lock:
                self._backends, self._broken, self._availability, self._instances = (
                    dict(saved[0]), dict(saved[1]), dict(saved[2]), dict(saved[3]))

    # -- queries ---------------------------------------------------------------------------

    def backends(self) -> list[Registered]:
        """Every registered backend, by descending priority, then name."""
        self.discover()
        return sorted(self._backends.values(),
                      key=lambda r: (-r.spec.capabilities.priority, r.name))

    def runnable(self, device: torch.device) -> list[str]:
        """The names of the backends that are available and run on ``device``'s type, in
        :meth:`backends` order."""
        return [r.name for r in self.backends()
                if r.spec.capabilities.supports_device(device) and self.availability(r.name)]

    def broken(self) -> list[BrokenPlugin]:
        """The plugins that failed to import or register, with why."""
        self.discover()
        return sorted(self._broken.values(), key=lambda b: b.name)

    def refused(self) -> list[RefusedPlugin]:
        """Installed entry points refused without being imported (impostors of a shipped
        name, names claimed twice, distributions KVCORE_PLUGINS does not trust)."""
        self.discover()
        return sorted(self._refused.values(), key=lambda r: (r.name, r.distribution or ""))

    def availability(self, name: str) -> Availability:
        """The (cached) result of the backend's availability probe."""
        rec = self.get(name)
        with self._lock:
            if name not in self._availability:
                self._availability[name] = safe_probe(rec.spec.capabilities)
            return self._availability[name]

    def get(self, name: str) -> Registered:
        """The registered backend ``name``; a broken or unknown name raises with the cause."""
        self.discover()
        if name in self._backends:
            return self._backends[name]
        for broken in self._broken.values():
            if broken.name == name:
                raise PluginLoadError(broken.reason,
                                      plugin_traceback=broken.traceback) from broken.error
        refusals = [r.reason for r in self._refused.values() if r.name == name]
        if refusals and name not in self._backends:
            raise PluginLoadError(f"plugin {name!r} was not imported: " + "; ".join(refusals))
        known = ", ".join(sorted(self._backends)) or f"none; {NO_PLUGIN_HINT}"
        raise NoBackend(f"backend {name!r}", {name: f"not registered (registered: {known})"})

    def instance(self, name: str, device: torch.device) -> object:
        """The backend object for ``device``, built on first use and then shared."""
        device = resolve_device(device)
        key = (name, str(device))
        with self._lock:
            if key not in self._instances:
                avail = self.availability(name)
                if not avail:
                    raise BackendUnavailable(f"backend {name!r} is unavailable: "
                                             f"{avail.reason}")  # type: ignore[union-attr]
                try:
                    self._instances[key] = self.get(name).spec.factory(device)
                except KVCoreError:
                    raise
                except Exception as exc:
                    hint = (" (kvcore calls the spec's factory as factory(device), with a "
                            "torch.device)" if isinstance(exc, TypeError) else "")
                    raise BuildError(f"backend {name!r} could not be created for {device}: "
                                     f"{type(exc).__name__}: {exc}{hint}") from exc
            return self._instances[key]

    # -- resolution ------------------------------------------------------------------------

    def explain(self, request: TransferRequest, backend: str | None = None) -> Resolution:
        """Resolve ``request`` and report every candidate's outcome (never raises NoBackend)."""
        if not isinstance(request, TransferRequest):
            raise InvalidArgument("request", "a TransferRequest (see make_request)",
                                  type(request).__name__)
        if not isinstance(backend, (str, type(None))):
            raise InvalidArgument("backend", "a backend name or None", type(backend).__name__)
        check_combination(request.op, request.kind, request.layout)
        forced = backend or self._environ.get("KVCORE_BACKEND") or None
        if forced is not None:
            self.get(forced)  # raises with the import error if the plugin is broken
        reasons: dict[str, str] = {}
        chosen: Registered | None = None
        variants: tuple[OpSupport, ...] = ()
        order = []
        for rec in self.backends():
            order.append(rec.name)
            if chosen is not None:
                reasons[rec.name] = f"lower in order than {chosen.name}"
                continue
            if forced is not None and rec.name != forced:
                reasons[rec.name] = f"not the requested backend {forced!r}"
                continue
            why, fits = self._refusal(rec, request)
            if why is not None:
                reasons[rec.name] = why
                continue
            chosen, variants = rec, fits
        for broken in self.broken():
            reasons[f"plugin:{broken.name}"] = broken.reason
        for refused in self.refused():
            reasons[f"plugin:{refused.name}@{refused.distribution}"] = refused.reason
        return Resolution(request, chosen, variants, reasons, tuple(order), forced)

    def _refusal(self, rec: Registered,
                 request: TransferRequest) -> tuple[str | None, tuple[OpSupport, ...]]:
        caps = rec.spec.capabilities
        if not caps.supports_device(request.device):
            types = ", ".join(sorted(caps.device_types or ()))
            return f"runs on {types} devices, not {request.device.type}", ()
        avail = self.availability(rec.name)
        if isinstance(avail, Unavailable):
            return f"unavailable: {avail.reason}", ()
        covering = caps.variants(request.op, request.kind, request.layout)
        if not covering:
            return (f"does not implement {request.op.value} for "
                    f"{request.kind.value}/{request.layout.value}"), ()
        fits = tuple(v for v in covering if v.refusal(request.dtype, request.element_bytes) is None)
        if not fits:
            why = covering[0].refusal(request.dtype, request.element_bytes)
            return f"{request.op.value} {request.kind.value}/{request.layout.value}: {why}", ()
        return None, fits

    def resolve(self, request: TransferRequest, backend: str | None = None) -> TransferPlan:
        """The plan for ``request``: explicit backend > KVCORE_BACKEND > priority order."""
        res = self.explain(request, backend)
        if res.chosen is None:
            if res.forced:
                avail = self.availability(res.forced)
                if not avail:
                    raise BackendUnavailable(
                        f"backend {res.forced!r} was requested for {request} but is "
                        f"unavailable: {avail.reason}")  # type: ignore[union-attr]
            raise NoBackend(str(request), res.reasons,
                            without_reference=REFERENCE not in self._backends)
        name = res.chosen.name
        caps = res.chosen.spec.capabilities
        return TransferPlan(request=request, backend_name=name, backend_version=caps.version,
                            host_memory=caps.host_memory, variants=res.variants,
                            instance=lambda: self.instance(name, request.device))


def _same_dist(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    return normalize_distribution(a) == normalize_distribution(b)


def undeclared_plugins(name: str | None = None) -> list[str]:
    """Installed distributions that look like a kvcore plugin (of backend ``name``, or of
    any backend for None) but declare no ``kvcore.backends`` entry point, each with the
    entry-point groups it does declare: a misspelt group leaves a plugin unseen, with no
    error of its own. A distribution looks like one where it is a ``kvio-*`` distribution or
    has a group that mentions kvcore or kvio; like ``name``'s where, besides, an entry point
    of such a group is named ``name`` or ``name`` is in its own name. Read from metadata only;
    for messages (it walks every distribution)."""
    wanted = None if name is None else normalize_distribution(name)
    if wanted == "":
        return []
    found = []
    for dist in metadata.distributions():
        dist_name = normalize_distribution(dist.metadata.get("Name") or "")
        eps = list(dist.entry_points)
        groups = sorted({ep.group for ep in eps})
        if ENTRY_POINT_GROUP in groups:
            continue
        near = [ep for ep in eps if "kvcore" in ep.group or "kvio" in ep.group]
        if not (near or dist_name.startswith("kvio-")):
            continue
        if wanted is None or any(ep.name == name for ep in near) or wanted in dist_name:
            found.append(f"{dist_name} (entry-point groups: {', '.join(groups) or 'none'})")
    return sorted(set(found))


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Registry()
        return _default


def reset_default_registry() -> None:
    """Forget the process-wide registry (the next use re-reads the environment)."""
    global _default
    with _default_lock:
        _default = None


def allocate_host_pool(kind: Kind | str, layout: Layout | str, num_layers: int, size: int,
                       head_num: int, head_dim: int, dtype: torch.dtype, page_size: int,
                       device: torch.device | str, backend: str | None = None,
                       registry: Registry | None = None, head_group_num: int = 1) -> HostPool:
    """A new host pool whose buffer comes from the backend that write-back on ``device``
    resolves to (``backend`` forces one): memory its kernels can dereference, pinned where
    the platform has it, plain on the CPU. The allocator is the backend's choice."""
    k = parse_enum(Kind, kind, "kind")
    lay = parse_enum(Layout, layout, "layout")
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument("dtype", "a torch.dtype", repr(dtype))
    check_instance("registry", registry, (Registry, type(None)), "a Registry or None")
    g = Geometry(k, lay, num_layers, size, head_num, head_dim, page_size,
                 head_group_num)
    byte_strides(g, dtype.itemsize)  # refuses what this dtype cannot lay out, before allocating
    req = make_request(Op.WRITE_BACK, k, lay, dtype, head_num * head_dim * dtype.itemsize,
                       device)
    plan = (registry or default_registry()).resolve(req, backend)
    backend_instance = plan.instance()
    try:
        buffer, memory = backend_instance.allocate_host(host_shape(g), dtype)
    except KVCoreError:
        raise
    except (RuntimeError, AssertionError) as exc:  # e.g. pinned memory this torch cannot make
        raise BackendUnavailable(
            f"backend {plan.backend_name!r} could not allocate a host pool for {req.device}: "
            f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
    return HostPool(g, buffer, memory)


def make_request(op: Op | str, kind: Kind | str, layout: Layout | str, dtype: torch.dtype,
                 element_bytes: int, device: torch.device | str) -> TransferRequest:
    """Build a request from loose values, raising InvalidArgument / UnsupportedCombination."""
    parsed = (parse_enum(Op, op, "op"), parse_enum(Kind, kind, "kind"),
              parse_enum(Layout, layout, "layout"))
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument("dtype", "a torch.dtype", repr(dtype))
    check_positive_int("element_bytes", element_bytes)
    req = TransferRequest(op=parsed[0], kind=parsed[1], layout=parsed[2], dtype=dtype,
                          element_bytes=int(element_bytes), device=_device("device", device))
    check_combination(req.op, req.kind, req.layout)
    return req


def _device(name: str, device: object) -> torch.device:
    """``device`` parsed and indexed (:func:`~kvcore.streams.resolve_device`), or
    InvalidArgument naming ``name``."""
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgument(name, "a torch.device or a device string", repr(device))
    try:
        return resolve_device(device)
    except (RuntimeError, ValueError) as exc:
        raise InvalidArgument(name, "a torch.device or a device string", repr(device)) from exc
