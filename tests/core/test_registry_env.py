"""KVCORE_PLUGINS and KVCORE_BACKEND, as documented in kvcore/registry.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcore.capabilities import Unavailable
from kvcore.errors import BackendUnavailable, NoBackend, PluginLoadError
from kvcore.layout import Layout
from kvcore.registry import Registry, default_registry, make_request

from .helpers import (
    BROKEN_PLUGIN_SOURCE,
    all_ops,
    fake_spec,
    good_plugin_source,
    install_fake_plugin,
)

FakePlugin = Callable[[str], tuple[str, str]]
INSTALLED = {"reference", "cuda", "rocm"}


def _loaded(reg: Registry) -> set[str]:
    """Entry points that were imported (registered a backend, or failed trying)."""
    return {r.source for r in reg.backends()} | {b.name for b in reg.broken()}


def _request(layout: str = "page_first"):
    return make_request("write_back", "mha", layout, torch.bfloat16, 256, "cpu")


def test_plugins_unset_loads_every_installed_plugin(fake_plugin: FakePlugin) -> None:
    ok, _ = fake_plugin(good_plugin_source("extra"))
    bad, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    assert _loaded(Registry(environ={})) == INSTALLED | {ok, bad}


def test_plugins_empty_means_reference_only(fake_plugin: FakePlugin) -> None:
    fake_plugin(good_plugin_source("extra"))
    fake_plugin(BROKEN_PLUGIN_SOURCE)
    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    assert _loaded(reg) == {"reference"}
    assert reg.broken() == []


@pytest.mark.parametrize("value", ["cuda", " cuda , ", "cuda,nosuch", "nosuch,cuda,"])
def test_plugins_allow_list_adds_reference_and_ignores_unknown(value: str) -> None:
    assert _loaded(Registry(environ={"KVCORE_PLUGINS": value})) == {"reference", "cuda"}


def test_an_allow_list_name_no_plugin_has_is_reported_not_ignored() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "cuda,nosuch"})
    assert _loaded(reg) == {"reference", "cuda"}
    (refusal,) = [r for r in reg.refused() if r.name == "nosuch"]
    assert refusal.distribution is None
    assert refusal.reason.startswith("KVCORE_PLUGINS names 'nosuch', but no installed "
                                     "distribution has that entry point (installed: ")
    assert "cuda" in refusal.reason and "rocm" in refusal.reason
    assert not [r for r in reg.refused() if r.name in INSTALLED]


def test_plugins_allow_list_names_a_fake_installed_plugin(fake_plugin: FakePlugin) -> None:
    ok, _ = fake_plugin(good_plugin_source("extra"))
    fake_plugin(BROKEN_PLUGIN_SOURCE)
    reg = Registry(environ={"KVCORE_PLUGINS": ok})
    assert _loaded(reg) == {"reference", ok}
    assert reg.get("extra").source == ok


def test_default_registry_reads_the_process_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVCORE_PLUGINS", "")
    assert _loaded(default_registry()) == {"reference"}


def test_backend_env_forces_a_backend() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "", "KVCORE_BACKEND": "reference"})
    with reg.isolated():
        reg.register(fake_spec("fast", priority=50))
        assert reg.resolve(_request()).backend_name == "reference"
        res = reg.explain(_request())
        assert res.reasons["fast"] == "not the requested backend 'reference'"
        # an explicit argument wins over the variable
        assert reg.resolve(_request(), backend="fast").backend_name == "fast"


def test_without_backend_env_priority_decides() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": ""})
    with reg.isolated():
        reg.register(fake_spec("fast", priority=50))
        assert reg.resolve(_request()).backend_name == "fast"


def test_forcing_an_installed_unavailable_backend_gives_its_reason() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "cuda", "KVCORE_BACKEND": "cuda"})
    avail = reg.availability("cuda")  # CI has no GPU: the cuda plugin must say why
    assert isinstance(avail, Unavailable) and avail.reason
    with pytest.raises(BackendUnavailable, match=r"'cuda'") as info:
        reg.resolve(_request())
    assert avail.reason in str(info.value)


def test_forcing_an_unavailable_backend_raises_backend_unavailable() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "", "KVCORE_BACKEND": "gone"})
    with reg.isolated():
        reg.register(fake_spec("gone", priority=50,
                               probe=lambda: Unavailable("no widget found (needs widget 3)")))
        with pytest.raises(BackendUnavailable, match=r"'gone'.*no widget found \(needs"):
            reg.resolve(_request())


def test_forcing_an_unknown_backend_raises_no_backend() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "", "KVCORE_BACKEND": "nosuch"})
    with pytest.raises(NoBackend, match=r"nosuch") as info:
        reg.resolve(_request())
    assert "not registered" in info.value.reasons["nosuch"]


def test_forcing_a_backend_without_the_layout_raises_no_backend() -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "", "KVCORE_BACKEND": "narrow"})
    with reg.isolated():
        reg.register(fake_spec("narrow", ops=all_ops(layouts=[Layout.PAGE_FIRST])))
        assert reg.resolve(_request()).backend_name == "narrow"
        with pytest.raises(NoBackend) as info:
            reg.resolve(_request("layer_first"))
    assert info.value.reasons["narrow"] == "does not implement write_back for mha/layer_first"
    assert info.value.reasons["reference"] == "not the requested backend 'narrow'"


@pytest.fixture
def twins(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Entry point ``twin`` claimed by two installed distributions, kvio-twin-a and
    kvio-twin-b, each registering backend ``twin_a`` / ``twin_b``."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    for suffix in ("a", "b"):
        install_fake_plugin(tmp_path, f"kvio-twin-{suffix}", "twin", f"kvio_twin_{suffix}",
                            good_plugin_source(f"twin_{suffix}"))
    importlib.invalidate_caches()
    yield
    for suffix in ("a", "b"):
        sys.modules.pop(f"kvio_twin_{suffix}", None)


@pytest.mark.parametrize("plugins", [None, "twin"])
def test_a_name_claimed_by_two_distributions_is_refused_not_raced(twins, plugins) -> None:
    reg = Registry(environ={} if plugins is None else {"KVCORE_PLUGINS": plugins})
    names = {r.name for r in reg.backends()}
    assert not names & {"twin_a", "twin_b"}  # neither wins by import order
    refused = {r.distribution: r.reason for r in reg.refused()}
    assert set(refused) == {"kvio-twin-a", "kvio-twin-b"}
    assert all("claimed by 2 distributions" in why for why in refused.values())
    with pytest.raises(PluginLoadError, match="claimed by 2 distributions"):
        reg.get("twin")


def test_name_at_distribution_pins_one_claim(twins) -> None:
    reg = Registry(environ={"KVCORE_PLUGINS": "twin@kvio_twin_b"})
    assert "twin_b" in {r.name for r in reg.backends()}
    assert "twin_a" not in {r.name for r in reg.backends()}
    assert [r.distribution for r in reg.refused()] == ["kvio-twin-a"]
    assert "only from kvio-twin-b" in reg.refused()[0].reason
