"""``kvio backends``: availability with concrete reasons, --json, --explain, broken plugins."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from kvcore.cli import main

from .helpers import BROKEN_PLUGIN_SOURCE

FakePlugin = Callable[[str], tuple[str, str]]


@pytest.fixture(autouse=True)
def _env(clean_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return clean_env


def _kvio(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["backends", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _facts(capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
    rc, out, _ = _kvio(capsys, "--json")
    assert rc == 0
    facts = json.loads(out)
    assert isinstance(facts, list)
    return {f["name"]: f for f in facts}


def test_table_lists_reference_available_and_gpu_backends_with_a_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _kvio(capsys)
    assert rc == 0
    lines = out.splitlines()
    heads = {line.split()[0]: line for line in lines if line and not line.startswith(" ")}
    assert heads["reference"].endswith(" available")
    for name in ("cuda", "rocm"):
        assert heads[name].endswith("UNAVAILABLE")
        why = lines[lines.index(heads[name]) + 1].strip()
        assert why.startswith("why: ") and len(why) > len("why: ") + 10


def test_table_shows_each_variants_page_window(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.cli.backends import _window

    _, out, _ = _kvio(capsys)
    lines = out.splitlines()
    cuda = lines.index(next(line for line in lines if line.startswith("cuda ")))
    staged_load = next(i for i in range(cuda, len(lines))
                       if lines[i].split()[:2] == ["load_all", "staged"])
    assert lines[staged_load + 1].endswith("staging 64 MiB, pages >= 64 KiB")
    direct = next(i for i in range(cuda, len(lines))
                  if lines[i].split()[:2] == ["load_all", "direct"])
    assert "pages" not in lines[direct + 1]  # serves every page size
    assert _window(0, 1 << 20) == ", pages < 1 MiB"
    assert _window(4096, 3 << 20) == ", pages 4 KiB to < 3 MiB"
    assert _window(100, None) == ", pages >= 100 B"


def test_a_variants_element_dtypes_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    """A narrow dtype claim is visible, not only as "not claimed" rows of kvio check."""
    import attrs

    from kvcore import BackendSpec, default_registry

    registry = default_registry()
    with registry.isolated():
        ref = registry.get("reference").spec
        ops = tuple(attrs.evolve(o, dtypes=("bfloat16", "float16")) for o in
                    ref.capabilities.ops)
        registry.register(BackendSpec(capabilities=attrs.evolve(
            ref.capabilities, name="narrow", priority=-100, ops=ops), factory=ref.factory))
        facts = _facts(capsys)
        _, out, _ = _kvio(capsys)
    assert {tuple(op["dtypes"]) for op in facts["narrow"]["ops"]} == {("bfloat16", "float16")}
    assert all(op["dtypes"] is None for op in facts["reference"]["ops"])  # any dtype
    lines = out.splitlines()
    narrow = lines.index(next(line for line in lines if line.startswith("narrow ")))
    assert lines[narrow + 3].endswith("dtypes bfloat16/float16"), lines[narrow:narrow + 4]


def test_json_parses_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    facts = _facts(capsys)
    ref = facts["reference"]
    assert ref["available"] is True
    assert ref["api_version"] == 1 and ref["priority"] == 0
    assert {op["op"] for op in ref["ops"]} == {"write_back", "load_layer", "load_all"}
    assert all(op["host_index"]["residency"] == "host" for op in ref["ops"])
    for name in ("cuda", "rocm"):
        assert facts[name]["available"] is False
        assert isinstance(facts[name]["reason"], str) and facts[name]["reason"].strip()


def test_broken_plugin_is_listed(capsys: pytest.CaptureFixture[str],
                                 fake_plugin: FakePlugin) -> None:
    ep, dist = fake_plugin(BROKEN_PLUGIN_SOURCE)
    broken = _facts(capsys)[ep]
    assert broken["broken"] is True and broken["available"] is False
    assert "RuntimeError: fake plugin exploded on import" in broken["reason"]
    assert broken["distribution"] == dist
    rc, out, _ = _kvio(capsys)
    assert rc == 0 and f"{ep} ? [?, priority -] UNAVAILABLE" in out
    assert "exploded" in out


def test_broken_plugin_under_strict_fails_the_command(capsys: pytest.CaptureFixture[str],
                                                      fake_plugin: FakePlugin,
                                                      clean_env: pytest.MonkeyPatch) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    clean_env.setenv("KVCORE_STRICT", "1")
    rc, out, err = _kvio(capsys)
    assert rc == 2 and out == ""
    assert "PluginLoadError" in err and ep in err


def test_plugins_env_reaches_the_command(capsys: pytest.CaptureFixture[str],
                                         clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVCORE_PLUGINS", "")
    assert set(_facts(capsys)) == {"reference"}


def test_explain_chooses_reference_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _kvio(capsys, "--explain", "--device", "cpu", "--layout", "page_head")
    assert rc == 0
    assert "request: write_back mha/page_head bfloat16 element 1024 B on cpu" in out
    assert "chosen:  reference (variants: default)" in out
    assert "  cuda: " in out


def test_explain_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _kvio(capsys, "--explain", "--json", "--device", "cpu", "--op", "load_layer",
                       "--kind", "mla", "--dtype", "float16", "--element-bytes", "144")
    assert rc == 0
    result = json.loads(out)
    assert result["chosen"] == "reference"
    assert result["request"] == "load_layer mla/page_first float16 element 144 B on cpu"
    assert {"reference", "cuda", "rocm"} <= set(result["candidates_in_order"])
    assert result["candidates_in_order"][-1] == "reference"  # lowest priority
    assert result["refused"]["cuda"] and result["refused"]["rocm"]


def test_explain_forced_unknown_backend_fails_cleanly(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _kvio(capsys, "--explain", "--device", "cpu", "--backend", "nosuch")
    assert rc == 2 and out == ""
    assert err.startswith("kvio backends: InvalidArgument: --backend: expected the name of "
                          "an installed backend") and "'nosuch'" in err


def test_a_plugin_under_a_misspelt_entry_point_group_is_named(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed with ``[project.entry-points."kvcore.backend"]``, a plugin is simply not
    seen; asked for by name, the refusal says which distribution and which groups it has."""
    import kvcore.registry as registry_module

    class Toy(registry_module.metadata.Distribution):
        def read_text(self, filename: str) -> str | None:
            return {"METADATA": "Metadata-Version: 2.1\nName: kvio-toy\nVersion: 0.1\n",
                    "entry_points.txt": "[kvcore.backend]\ntoy = kvio_toy\n"}.get(filename)

        def locate_file(self, path: object) -> object:
            return path

    real = registry_module.metadata.distributions
    monkeypatch.setattr(registry_module.metadata, "distributions",
                        lambda **kw: [*real(**kw), Toy()])
    rc, _, err = _kvio(capsys, "--explain", "--device", "cpu", "--backend", "toy")
    assert rc == 2
    assert ("--backend: expected the name of an installed backend" in err
            and "got 'toy'; installed but not declared under the 'kvcore.backends' entry-point "
                "group: kvio-toy (entry-point groups: kvcore.backend)" in err), err
    assert registry_module.undeclared_plugins("reference") == []  # declared: not listed
    rc, out, err = _kvio(capsys)  # the listing says so too, and still lists the rest
    assert rc == 0 and "reference" in out
    assert ("kvio backends: kvio-toy (entry-point groups: kvcore.backend) looks like a kvcore "
            "plugin but declares no 'kvcore.backends' entry point, so it is not listed") in err


def test_explain_unsupported_combination_fails_cleanly(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _kvio(capsys, "--explain", "--device", "cpu", "--kind", "mla", "--layout",
                       "page_head")
    assert rc == 2
    assert "UnsupportedCombination" in err and "page_head" in err
