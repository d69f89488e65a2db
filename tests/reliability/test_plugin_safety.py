"""Plugins: a backend built for another API version is refused with a message naming it, and
KVCORE_PLUGINS keeps installed packages that are not allowed from being imported at all."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import attrs
import pytest

import kvcore
import kvcore.registry as registry_module
from kvcore.capabilities import API_VERSION, BackendSpec
from kvcore.errors import ApiVersionMismatch, PluginLoadError
from kvcore.registry import ENTRY_POINT_GROUP, REFERENCE, Registry, metadata

OLD = "kvio_test_old_api"
UNTRUSTED = "kvio_test_untrusted"


def _spec_with_api(registry: Registry, name: str, version: str, api: int) -> BackendSpec:
    ref = registry.get(REFERENCE).spec
    caps = attrs.evolve(ref.capabilities, name=name, version=version, api_version=api)
    return BackendSpec(capabilities=caps, factory=ref.factory)


@pytest.fixture
def extra_entry_points(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Two more installed plugins: one built for API version API_VERSION + 1, and one whose
    import records that it happened (standing in for an untrusted package)."""
    imported: list[str] = []
    real_entry_points = metadata.entry_points

    old = types.ModuleType(OLD)

    @kvcore.hookimpl
    def kvcore_register_backends(register) -> None:
        register(_spec_with_api(Registry({"KVCORE_PLUGINS": ""}), "oldapi", "3.2.1",
                                API_VERSION + 1))

    old.kvcore_register_backends = kvcore_register_backends  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, OLD, old)

    class Untrusted(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            imported.append(name)
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, UNTRUSTED, Untrusted(UNTRUSTED))

    def entry_points(**kw: object) -> list[metadata.EntryPoint]:
        eps = list(real_entry_points(**kw))
        if kw.get("group") == ENTRY_POINT_GROUP:
            eps += [metadata.EntryPoint("oldapi", OLD, ENTRY_POINT_GROUP),
                    metadata.EntryPoint("untrusted", f"{UNTRUSTED}:plugin", ENTRY_POINT_GROUP)]
        return eps

    monkeypatch.setattr(registry_module.metadata, "entry_points", entry_points)
    yield imported


def test_register_refuses_another_api_version_naming_the_plugin() -> None:
    reg = Registry({"KVCORE_PLUGINS": ""})
    with pytest.raises(ApiVersionMismatch) as info:
        reg.register(_spec_with_api(reg, "oldapi", "3.2.1", API_VERSION + 1))
    msg = str(info.value)
    assert "'oldapi'" in msg and "3.2.1" in msg
    assert f"declares kvcore API version {API_VERSION + 1}" in msg
    assert f"expected API version {API_VERSION}" in msg
    assert "api_version=kvcore.API_VERSION" in msg  # (what its author writes)
    assert "oldapi" not in [r.name for r in reg.backends()]


def test_discovery_reports_an_api_mismatch_and_skips_the_plugin(extra_entry_points: list[str],
                                                                ) -> None:
    reg = Registry({})
    assert "oldapi" not in [r.name for r in reg.backends()]
    broken = {b.name: b for b in reg.broken()}
    assert isinstance(broken["oldapi"].error, ApiVersionMismatch)
    assert "3.2.1" in broken["oldapi"].reason
    assert f"expected API version {API_VERSION}" in broken["oldapi"].reason
    assert REFERENCE in [r.name for r in reg.backends()]  # the rest still loads


def test_strict_mode_makes_an_api_mismatch_fatal(extra_entry_points: list[str]) -> None:
    with pytest.raises(PluginLoadError, match="expected API version"):
        Registry({"KVCORE_STRICT": "1", "KVCORE_PLUGINS": "oldapi"}).discover()


@pytest.mark.parametrize(("allow", "loaded"), [(None, True), ("", False),
                                               ("oldapi", False), ("untrusted", True)])
def test_kvcore_plugins_keeps_unlisted_packages_from_being_imported(
        extra_entry_points: list[str], allow: str | None, loaded: bool) -> None:
    reg = Registry({} if allow is None else {"KVCORE_PLUGINS": allow})
    reg.discover()
    assert bool(extra_entry_points) is loaded  # the module was touched only when allowed
    assert ("untrusted" in {b.name for b in reg.broken()}) is loaded
    assert REFERENCE in [r.name for r in reg.backends()]  # always allowed
