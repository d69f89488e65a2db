"""Issue 25, item 1: the allow-list trusts names and distributions, decided from installed
metadata before anything is imported.

Two throwaway distributions are installed into a temporary site directory (a real
``*.dist-info`` with ``entry_points.txt`` plus a module, as pip lays them out): one whose entry
point is named ``reference``, one named ``cuda``, each writing a marker file when imported.
``kvio backends`` runs in a subprocess with that directory on its path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcore.cli import main

IMPOSTORS = {"reference": ("helpful-tools", "helpful_tools_ref"),
             "cuda": ("fast-kv", "fast_kv_cuda")}

def normalize_distribution(name: str) -> str:
    return name.replace("_", "-").lower()


_MARKER_SOURCE = """
    import os, pathlib
    pathlib.Path(os.environ["IMPOSTOR_MARKERS"], {name!r}).write_text("imported")
    raise SystemExit("an impostor ran")
"""


def install_fake_plugin(root: Path, dist: str, entry_point: str, module: str,
                        source: str) -> None:
    """``<dist>-0.1.dist-info/`` (METADATA, entry_points.txt, RECORD) and ``<module>.py``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvcore.backends]\n{entry_point} = {module}\n")
    (info / "RECORD").write_text("")


@pytest.fixture
def impostors(tmp_path: Path) -> tuple[Path, Path]:
    """(site dir holding both impostors, folder their markers would be written to)."""
    site, markers = tmp_path / "site", tmp_path / "markers"
    site.mkdir()
    markers.mkdir()
    for ep, (dist, module) in IMPOSTORS.items():
        install_fake_plugin(site, dist, ep, module, _MARKER_SOURCE.format(name=ep))
    return site, markers


def _kvio_backends(site: Path, markers: Path, plugins: str | None,
                   *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["IMPOSTOR_MARKERS"] = str(markers)
    if plugins is not None:
        env["KVCORE_PLUGINS"] = plugins
    return subprocess.run([sys.executable, "-m", "kvcore.cli", "backends", *extra],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("plugins", ["", "cuda", None])
def test_impostors_are_never_imported_and_are_reported(impostors: tuple[Path, Path],
                                                       plugins: str | None) -> None:
    site, markers = impostors
    proc = _kvio_backends(site, markers, plugins, "--json")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in markers.iterdir()) == []  # neither impostor ran
    facts = json.loads(proc.stdout)
    real = [f for f in facts if not f.get("refused") and not f.get("broken")]
    ref = next(f for f in real if f["name"] == "reference")
    assert ref["available"] and normalize_distribution(ref["distribution"]) == "kvio-reference"
    refused = {(f["name"], f["distribution"]): f["reason"] for f in facts if f.get("refused")}
    assert set(refused) == {(ep, dist) for ep, (dist, _) in IMPOSTORS.items()}
    assert "impostor" in refused[("reference", "helpful-tools")]
    assert "kvio-cuda" in refused[("cuda", "fast-kv")]
    if plugins == "cuda":  # the real cuda plugin still loads (unavailable without a GPU)
        cuda = next(f for f in real if f["name"] == "cuda")
        assert normalize_distribution(cuda["distribution"]) == "kvio-cuda"


def test_the_table_names_the_impostors(impostors: tuple[Path, Path]) -> None:
    site, markers = impostors
    proc = _kvio_backends(site, markers, "")
    assert proc.returncode == 0, proc.stderr
    assert "reference from helpful-tools REFUSED" in proc.stdout
    assert "cuda from fast-kv REFUSED" in proc.stdout
    assert not any(markers.iterdir())


@pytest.mark.parametrize("name", ["reference", "cuda", "rocm"])
def test_new_backend_refuses_a_shipped_name(name: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "skeleton"
    assert main(["new-backend", name, str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"would shadow kvio-{name}" in err
    assert not target.exists()
