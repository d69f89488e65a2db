"""`kvio new-backend` writes a skeleton that installs from its folder into a fresh virtual
environment, is discovered by `kvio backends`, and passes `kvio check`."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kvcore.cli import main
from kvcore.cli.new_backend import write_skeleton

KVIO = "import sys; from kvcore.cli import main; sys.exit(main())"


def _fresh_venv(where: Path) -> Path:
    """A venv on top of this interpreter that also sees this environment's packages."""
    # no pip of its own: pip and setuptools come from this environment, like torch and kvcore
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(where)
    python = where / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                              "'purelib'))"], capture_output=True, text=True, check=True)
    # a venv made from a venv sees the base interpreter's site-packages, not ours: add ours
    # (addsitedir also runs their .pth files, which editable installs rely on)
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n"
    Path(purelib.stdout.strip(), "_parent_env.pth").write_text(line)
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    return subprocess.run([python, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


@pytest.mark.slow
def test_skeleton_installs_is_discovered_and_passes(tmp_path: Path) -> None:
    skeleton = tmp_path / "kvio-scaffolded"
    assert main(["new-backend", "scaffolded", str(skeleton)]) == 0
    python = _fresh_venv(tmp_path / "venv")
    install = _run(python, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                   "--no-index", str(skeleton), cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr

    listed = _run(python, "-c", KVIO, "backends", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    facts = {f["name"]: f for f in json.loads(listed.stdout)}
    assert facts["scaffolded"]["available"], facts["scaffolded"]
    assert facts["scaffolded"]["distribution"] == "kvio-scaffolded"
    assert facts["scaffolded"]["source"] == "scaffolded"

    check = _run(python, "-c", KVIO, "check", "scaffolded", "--device", "cpu", cwd=tmp_path)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-2000:]
    total = next(line for line in check.stdout.splitlines() if line.startswith("total"))
    passed, failed = (int(x) for x in total.split()[1:3])
    assert passed > 100 and failed == 0, check.stdout[-3000:]

    # this interpreter's environment never saw the skeleton
    assert "kvio_scaffolded" not in sys.modules


def test_skeleton_refuses_a_bad_name_and_a_full_directory(tmp_path: Path) -> None:
    from kvcore.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="NAME"):
        write_skeleton("Bad-Name", tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("x")
    with pytest.raises(InvalidArgument, match="not empty"):
        write_skeleton("fine", tmp_path / "b")


def test_skeleton_files(tmp_path: Path) -> None:
    written = write_skeleton("demo_x", tmp_path / "s")
    names = sorted(str(p.relative_to(tmp_path / "s")) for p in written)
    assert names == ["README.md", "kvio_demo_x/__init__.py", "kvio_demo_x/backend.py",
                     "pyproject.toml", "tests/test_conformance.py"]
    text = (tmp_path / "s" / "pyproject.toml").read_text()
    assert 'demo_x = "kvio_demo_x"' in text and 'name = "kvio-demo-x"' in text
    assert "class DemoXBackend" in (tmp_path / "s" / "kvio_demo_x" / "backend.py").read_text()
