"""kvcore installs and runs without SGLang: neither the core nor the hook bodies import it.

These run whether or not sglang is installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_kvcore_has_no_sglang_import() -> None:
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "kvcore").rglob("*.py"))
                 if any(n.split(".")[0] == "sglang" for n in _imported_modules(p))]
    assert offenders == []


def test_hook_bodies_import_no_sglang() -> None:
    code = ("import sys, kvcore, kvcore_sglang.hooks\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'sglang')\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_one_function_calls_kvcore_transfer() -> None:
    """Every transfer goes through kvcore_sglang.hooks._transfer (the switch to
    plan.bind/submit is one function)."""
    src = ROOT / "integrations" / "kvcore_sglang" / "kvcore_sglang"
    callers = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in {"transfer", "submit", "run", "run_layers"}):
                    callers.append(f"{path.name}:{fn.name}")
    assert callers == ["hooks.py:_transfer"]
