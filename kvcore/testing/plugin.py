"""The pytest plugin: ``pytest --kvio-backend NAME`` runs the conformance suite against NAME.

Registered through the ``pytest11`` entry point (name ``kvcore.testing.plugin``), so it is
active wherever kvcore is installed; ``-p kvcore.testing.plugin`` loads it explicitly.

Options:

``--kvio-backend NAME``
    The backend under test (default: the ini option ``kvio_backend``, else ``reference``).
    Given without test paths, pytest collects exactly the suite shipped in
    :mod:`kvcore.testing.suite`; name paths to collect your own files instead (for example
    one that subclasses the suite's classes).
``--kvio-device DEVICE``
    The torch device (default: the accelerator if torch has one, else ``cpu``).
``--kvio-quick`` / ``--kvio-full``
    Case sizes: ``quick`` (small pages and counts; the default on ``cpu``) or ``full``
    (page size 64, page counts 1..129 and around staging budgets; the default elsewhere).

Which cases apply comes from the backend's declared capabilities: a case it does not claim is
skipped with a reason starting ``not claimed:``; one it claims and fails is a failure. Cases
can be marked expected-to-fail without code through the ini option ``kvio_xfail``: lines of
``PATTERN: reason``, where PATTERN is an ``fnmatch`` pattern over the case id, for example::

    [tool.pytest.ini_options]
    kvio_xfail = ["load_all-mla-*: MLA prefetch lands in 0.3"]
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from kvcore.capabilities import Capabilities
from kvcore.errors import KVCoreError
from kvcore.registry import default_registry
from kvcore.testing.cases import FULL, PROFILES, QUICK, Case, Profile, generate
from kvcore.testing.harness import Env
from kvcore.testing.recording import recorded

#: the suite module pytest collects when --kvio-backend is given without paths
SUITE_PATH = Path(__file__).with_name("suite.py")
DEFAULT_BACKEND = "reference"


@attrs.frozen
class Settings:
    """The plugin's options, resolved once per session."""

    backend: str
    device: torch.device
    profile: Profile


_settings_key = pytest.StashKey[Settings]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvio", "kvcore backend conformance suite")
    group.addoption("--kvio-backend", default=None, metavar="NAME",
                    help="run the kvcore conformance suite against backend NAME "
                         f"(default {DEFAULT_BACKEND})")
    group.addoption("--kvio-device", default=None, metavar="DEVICE",
                    help="torch device for the suite (default: the accelerator, else cpu)")
    group.addoption("--kvio-quick", action="store_true",
                    help="small cases (the default on cpu)")
    group.addoption("--kvio-full", action="store_true",
                    help="full-size cases: page size 64, page counts 1..129 (default off cpu)")
    parser.addini("kvio_backend", default="",
                  help="the backend under test when --kvio-backend is not given")
    parser.addini("kvio_xfail", type="linelist", default=[],
                  help="'PATTERN: reason' lines marking conformance cases expected to fail")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvio(family): a conformance test over the cases of "
                                       "one family (kvcore.testing.cases.generate)")
    if (config.getoption("kvio_backend") is not None
            and config.args_source is not pytest.Config.ArgsSource.ARGS):
        config.args = [str(SUITE_PATH)]
    if config.getoption("kvio_device") is not None:
        settings(config)  # a device this machine lacks is one usage error, not one per case


def settings(config: pytest.Config) -> Settings:
    """The session's backend, device and profile."""
    if _settings_key not in config.stash:
        from kvcore.cli.common import default_device, parse_device

        name = (config.getoption("kvio_backend") or config.getini("kvio_backend")
                or DEFAULT_BACKEND)
        raw = config.getoption("kvio_device")
        try:  # (once, not as a failure of every case)
            device = parse_device(raw, "--kvio-device") if raw else default_device()
        except KVCoreError as exc:
            raise pytest.UsageError(str(exc)) from exc
        if config.getoption("kvio_quick"):
            profile = QUICK
        elif config.getoption("kvio_full"):
            profile = FULL
        else:
            profile = QUICK if device.type == "cpu" else FULL
        config.stash[_settings_key] = Settings(name, device, profile)
    return config.stash[_settings_key]


def capabilities(name: str) -> Capabilities:
    """The static capabilities of ``name`` (a usage error if it is not registered)."""
    try:
        return default_registry().get(name).spec.capabilities
    except KVCoreError as exc:
        raise pytest.UsageError(f"--kvio-backend {name}: {exc}") from exc


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvio_case" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("kvio")
    if marker is None:
        raise pytest.UsageError(f"{metafunc.definition.nodeid} uses kvio_case without a "
                                "@pytest.mark.kvio(family) marker")
    s = settings(metafunc.config)
    cases = generate(marker.args[0], capabilities(s.backend), s.profile)
    metafunc.parametrize("kvio_case", cases, ids=[c.id for c in cases])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rules = []
    for line in config.getini("kvio_xfail"):
        pattern, _, reason = line.partition(":")
        rules.append((pattern.strip(), reason.strip() or "marked in kvio_xfail"))
    backend = settings(config).backend
    for item in items:
        case = getattr(getattr(item, "callspec", None), "params", {}).get("kvio_case")
        if not isinstance(case, Case):
            marker = item.get_closest_marker("kvio")
            if marker is not None:
                item.user_properties.append(("kvio_row", f"{marker.args[0]} {backend}"))
            continue
        item.user_properties.append(("kvio_row", case.row))
        if case.unclaimed:
            item.add_marker(pytest.mark.skip(reason=case.unclaimed))
            continue
        for pattern, reason in rules:
            if fnmatch.fnmatchcase(case.id, pattern):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
                break


@pytest.fixture(scope="session")
def kvio_settings(pytestconfig: pytest.Config) -> Settings:
    """The backend, device and profile this session tests."""
    return settings(pytestconfig)


@pytest.fixture(scope="session")
def kvio_env(kvio_settings: Settings) -> Iterator[Env]:
    """The backend under test, wrapped so placement can be checked, in an isolated registry.

    Skips every case (with the reason) when the backend cannot run on the chosen device.
    """
    registry = default_registry()
    name, device = kvio_settings.backend, kvio_settings.device
    caps = registry.get(name).spec.capabilities
    if not caps.supports_device(device):
        types = ", ".join(sorted(caps.device_types or ()))
        pytest.skip(f"unavailable: {name} runs on {types} devices, not {device.type}")
    avail = registry.availability(name)
    if not avail:
        pytest.skip(f"unavailable: {avail.reason}")  # type: ignore[union-attr]
    with recorded(registry, name) as recorders:
        yield Env(name, device, registry, recorders, kvio_settings.profile.name)


@pytest.fixture(scope="session")
def kvio_profile(kvio_settings: Settings) -> Profile:
    return kvio_settings.profile


__all__ = ["DEFAULT_BACKEND", "PROFILES", "SUITE_PATH", "Settings", "settings"]
