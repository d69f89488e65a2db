"""Discovery through real installed entry points: installed plugins, broken ones, strict mode."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from kvcore.capabilities import API_VERSION
from kvcore.errors import ApiVersionMismatch, KVCoreError, NoBackend, PluginLoadError
from kvcore.registry import ENTRY_POINT_GROUP, Registry, make_request, metadata

from .helpers import BROKEN_PLUGIN_SOURCE, fake_spec, good_plugin_source

FakePlugin = Callable[[str], tuple[str, str]]


def _request():
    return make_request("write_back", "mha", "page_first", torch.bfloat16, 256, "cpu")


def _normal(name: str | None) -> str | None:
    return None if name is None else name.replace("_", "-").lower()


def test_installed_plugins_are_discovered_from_metadata() -> None:
    reg = Registry(environ={})
    eps = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert {"reference", "cuda", "rocm"} <= eps
    loaded = {r.source for r in reg.backends()} | {b.name for b in reg.broken()}
    assert {"reference", "cuda", "rocm"} <= loaded
    ref = reg.get("reference")
    assert ref.source == "reference"
    assert _normal(ref.distribution) == "kvio-reference"


def test_a_fake_installed_plugin_is_discovered(fake_plugin: FakePlugin) -> None:
    ep, dist = fake_plugin(good_plugin_source("fakeok"))
    reg = Registry(environ={})
    rec = reg.get("fakeok")
    assert (rec.source, _normal(rec.distribution)) == (ep, dist)
    assert reg.broken() == [] or all(b.name != ep for b in reg.broken())


def test_broken_plugin_is_reported_and_skipped(fake_plugin: FakePlugin) -> None:
    ep, dist = fake_plugin(BROKEN_PLUGIN_SOURCE)
    reg = Registry(environ={})
    [broken] = [b for b in reg.broken() if b.name == ep]
    assert _normal(broken.distribution) == dist
    assert isinstance(broken.error, RuntimeError)
    assert "fake plugin exploded on import" in str(broken.error)
    assert ep in broken.reason and "RuntimeError" in broken.reason
    assert "exploded" in broken.traceback
    # everything else still loads and resolves
    assert reg.get("reference").name == "reference"
    plan = reg.resolve(_request())
    assert plan.backend_name == "reference"
    assert reg.explain(_request()).reasons[f"plugin:{ep}"] == broken.reason


def test_strict_makes_a_broken_plugin_fatal(fake_plugin: FakePlugin) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    reg = Registry(environ={"KVCORE_STRICT": "1"})
    with pytest.raises(PluginLoadError, match=rf"'{ep}'.*exploded.*KVCORE_STRICT") as info:
        reg.discover()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(PluginLoadError, match=ep):  # stays fatal, is not forgotten
        reg.backends()


def test_strict_zero_is_not_strict(fake_plugin: FakePlugin) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    reg = Registry(environ={"KVCORE_STRICT": "0"})
    assert ep in {b.name for b in reg.broken()}


def test_asking_for_a_broken_plugin_by_name_raises_its_import_error(
        fake_plugin: FakePlugin) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    reg = Registry(environ={})
    with pytest.raises(PluginLoadError, match=r"exploded") as info:
        reg.get(ep)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(PluginLoadError, match=r"exploded"):
        reg.resolve(_request(), backend=ep)
    with pytest.raises(PluginLoadError, match=r"exploded"):
        Registry(environ={"KVCORE_BACKEND": ep}).resolve(_request())


def test_plugin_built_for_another_api_version_is_refused(fake_plugin: FakePlugin) -> None:
    ep, _ = fake_plugin(good_plugin_source("future", api_offset=1))
    reg = Registry(environ={})
    [broken] = [b for b in reg.broken() if b.name == ep]
    assert isinstance(broken.error, ApiVersionMismatch)
    message = str(broken.error)
    assert "'future'" in message and "0.3" in message
    assert f"API version {API_VERSION + 1}" in message
    assert f"expected API version {API_VERSION}" in message
    assert "future" not in {r.name for r in reg.backends()}
    with pytest.raises(PluginLoadError, match=r"expected API version"):
        reg.get(ep)


def test_in_process_registration_refuses_another_api_version() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    with pytest.raises(ApiVersionMismatch, match=rf"expected API version {API_VERSION}"):
        reg.register(fake_spec("old", api_version=API_VERSION - 1))
    assert "old" not in {r.name for r in reg.backends()}


def test_duplicate_backend_name_is_refused() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    with reg.isolated(), pytest.raises(PluginLoadError, match=r"already registered"):
        reg.register(fake_spec("reference"))
    assert reg.get("reference").source == "reference"


def test_isolated_restores_the_registry() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    with reg.isolated():
        reg.register(fake_spec("temp"))
        assert reg.get("temp").source == "in-process"
    with pytest.raises(NoBackend, match=r"temp"):
        reg.get("temp")


def test_unknown_backend_name_raises_no_backend() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    with pytest.raises(NoBackend, match=r"(?s)'nosuch'.*registered: reference") as info:
        reg.get("nosuch")
    assert isinstance(info.value, KVCoreError)


def test_disallowed_plugins_are_not_imported(fake_plugin: FakePlugin) -> None:
    ep, _ = fake_plugin(good_plugin_source("notimported"))
    module = ep.replace("fake", "kvio_fake_")
    reg = Registry(environ={"KVCORE_PLUGINS": "cuda"})
    assert {r.source for r in reg.backends()} == {"reference", "cuda"}
    assert module not in sys.modules


# -- what a plugin's hook registers is checked before any of it is ----------------------------

NO_HOOK_SOURCE = """
    import kvcore

    def kvcore_register_backend(register):  # (misspelled, and not a hookimpl)
        raise AssertionError("never called")
"""

REGISTERS_NOTHING_SOURCE = """
    import kvcore

    @kvcore.hookimpl
    def kvcore_register_backends(register):
        pass
"""


def _broken(reg: Registry, ep: str) -> str:
    [broken] = [b for b in reg.broken() if b.name == ep]
    return str(broken.error)


def test_a_plugin_may_not_register_a_shipped_backend_s_name(fake_plugin: FakePlugin) -> None:
    """A plugin whose capabilities say "reference" is refused, and the real reference (the
    conformance suite's oracle) stays the shipped one, whichever entry point loads first."""
    ep, dist = fake_plugin(good_plugin_source("reference"))
    reg = Registry(environ={})
    assert "the name of the shipped distribution kvio-reference's backend (an impostor)" \
        in _broken(reg, ep)
    assert _normal(reg.get("reference").distribution) == "kvio-reference"
    assert dist not in {_normal(r.distribution) for r in reg.backends()}


@pytest.mark.parametrize(("source", "says"), [
    (NO_HOOK_SOURCE, "registered no backend: it has no kvcore_register_backends hook"),
    (REGISTERS_NOTHING_SOURCE, "called register() for no backend"),
    (good_plugin_source("twice").replace("register(BackendSpec(capabilities=CAPS, "
                                         "factory=_factory))",
                                         "register(BackendSpec(capabilities=CAPS, "
                                         "factory=_factory)); register(BackendSpec("
                                         "capabilities=CAPS, factory=_factory))"),
     "registered backend 'twice' twice"),
    (good_plugin_source("caps").replace("register(BackendSpec(capabilities=CAPS, "
                                        "factory=_factory))", "register(CAPS)"),
     "register() expects a kvcore.BackendSpec, got Capabilities"),
    (good_plugin_source("strver").replace("api_version=API_VERSION + 0",
                                          "api_version=str(API_VERSION)"),
     f"api_version: expected the int {API_VERSION} (kvcore.API_VERSION), got '{API_VERSION}'"),
], ids=["no-hook", "registers-nothing", "twice", "capabilities", "api-version-str"])
def test_a_plugin_that_registers_wrongly_is_listed_broken_with_why(
        fake_plugin: FakePlugin, source: str, says: str) -> None:
    ep, _ = fake_plugin(source)
    reg = Registry(environ={})
    assert says in _broken(reg, ep)
    assert all(r.source != ep for r in reg.backends())  # none of it half-registered
