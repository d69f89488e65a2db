"""Issue 25, item 10: the first hour of a new user (install, README, kvio without plugins)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvcore.registry as registry_module
from kvcore.cli import main
from kvcore.errors import NoBackend
from kvcore.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _python_block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block after {heading!r}"
    return match.group(1)


def test_the_readme_controller_example_runs_on_a_cpu(tmp_path: Path) -> None:
    script = tmp_path / "controller_example.py"
    script.write_text(_python_block_after("## Use the controller") + "\nprint('example ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a CPU-only machine, even where a GPU is present
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("example ok")


def test_the_readme_says_how_to_get_kvio_on_path() -> None:
    text = README.read_text()
    assert "source .venv/bin/activate" in text
    assert ".venv/bin/kvio" in text


def _pyprojects() -> list[Path]:
    found = [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml")),
             *sorted(ROOT.glob("examples/*/pyproject.toml"))]
    assert len(found) >= 5
    return found


@pytest.mark.parametrize("pyproject", _pyprojects(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pyproject_metadata_gives_setuptools_no_license_warning(
        pyproject: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip("setuptools < 77 predates SPDX license strings")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(pyproject.parent)  # readme and package paths are relative to it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), str(pyproject))
    messages = [str(w.message) for w in caught if "licen" in str(w.message).lower()]
    assert messages == []
    text = pyproject.read_text()
    assert "License ::" not in text  # classifiers would repeat (and contradict) the SPDX field


def test_the_install_script_reports_each_step() -> None:
    script = (ROOT / "scripts" / "install.sh").read_text()
    steps = re.findall(r'^\s*step \d+/\d+ ', script, re.M)
    assert len(steps) >= 5  # 4 for the venv, 1 for KVCORE_PYTHON_ENV=system
    # the big installs are not silenced: no `pip install -q` but for upgrading pip itself
    quiet = [line for line in script.splitlines()
             if re.search(r"pip install\b.*\s-q\b", line) and "--upgrade pip" not in line]
    assert quiet == []
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "install.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def no_plugins(monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch) -> None:
    """kvcore installed alone: no distribution declares a kvcore.backends entry point."""
    real = registry_module.metadata.entry_points

    def entry_points(**kw: object) -> list:
        if kw.get("group") == registry_module.ENTRY_POINT_GROUP:
            return []
        return list(real(**kw))

    monkeypatch.setattr(registry_module.metadata, "entry_points", entry_points)


def test_kvio_backends_without_plugins_says_which_to_install(
        no_plugins: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["backends"])
    out, err = capsys.readouterr()
    assert rc == 1
    said = out + err
    for dist in ("kvio-reference", "kvio-cuda", "kvio-rocm"):
        assert dist in said


@pytest.fixture
def gpu_plugins_only(monkeypatch: pytest.MonkeyPatch, clean_env: pytest.MonkeyPatch) -> None:
    """kvio-cuda and kvio-rocm installed, kvio-reference not (a GPU plugin on a machine
    without its GPU: nothing can run)."""
    real = registry_module.metadata.entry_points

    def entry_points(**kw: object) -> list:
        found = list(real(**kw))
        if kw.get("group") == registry_module.ENTRY_POINT_GROUP:
            return [ep for ep in found if ep.name in ("cuda", "rocm")]
        return found

    monkeypatch.setattr(registry_module.metadata, "entry_points", entry_points)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine where "
                    "kvio-cuda cannot run")
def test_gpu_plugins_that_cannot_run_here_point_at_the_reference(
        gpu_plugins_only: None, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from kvcore.registry import make_request

    rc = main(["backends"])
    out, err = capsys.readouterr()
    assert rc == 1 and "UNAVAILABLE" in out, out
    assert "none of the installed backends can run on this machine" in err
    assert "kvio-reference, the pure-torch backend for any device, is not installed" in err
    with pytest.raises(NoBackend, match=r"kvio-reference, the pure-torch backend for any "
                                        r"device, is not installed: install it"):
        Registry(environ={}).resolve(make_request("write_back", "mha", "page_first",
                                                  torch.bfloat16, 256, "cpu"))


def test_no_backend_points_at_the_reference_only_where_it_is_missing(
        clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(NoBackend) as info:
        Registry(environ={}).get("nosuch")
    assert "kvio-reference" not in str(info.value)  # installed here


def test_resolving_without_plugins_says_which_to_install(no_plugins: None) -> None:
    import torch

    from kvcore.registry import make_request

    with pytest.raises(NoBackend, match="kvio-reference") as info:
        Registry(environ={}).resolve(make_request("write_back", "mha", "page_first",
                                                  torch.bfloat16, 256, "cpu"))
    assert "kvio-cuda" in str(info.value) and "kvio-rocm" in str(info.value)
