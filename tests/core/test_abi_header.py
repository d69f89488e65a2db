"""kvcore/include/kvio_abi.h, the ABI's one C header, against kvcore's ctypes mirror of it
(kvcore/native_abi.py): every struct field at the same offset and size, every function with
the same parameters. A change to one side alone fails here.

The struct layout is read back from a C program built with the header (cc, gcc or clang;
skipped without one, failed without one under KVIO_REQUIRE_CODEGEN as in CI)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcore.native_abi import (
    ABI_HEADER,
    ABI_VERSION,
    INCLUDE_DIR,
    INLINE_INDEX_PAGES,
    INLINE_INDEX_TOKENS,
    OPTIONAL_PROTOTYPES,
    PROTOTYPES,
    KvioBounds,
    KvioLayout,
    KvioReport,
)

STRUCTS = {"kvio_layout": KvioLayout, "kvio_report": KvioReport, "kvio_bounds": KvioBounds}

#: C parameter type (as the header spells it, const dropped) -> the ctypes type mirroring it
C_TO_CTYPES = {
    "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
    "uint32_t": ctypes.c_uint32, "kvio_layout": KvioLayout,
    "kvio_bounds*": ctypes.POINTER(KvioBounds), "char*": ctypes.c_char_p,
    "int32_t*": ctypes.POINTER(ctypes.c_int32), "void**": ctypes.POINTER(ctypes.c_void_p),
    "void": None,  # a function returning nothing
}


def _c_compiler() -> str:
    for name in ("cc", "gcc", "clang", "clang-19"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("KVIO_REQUIRE_CODEGEN"):
        pytest.fail("no C compiler (cc, gcc, clang) to build against kvio_abi.h")
    pytest.skip("no C compiler (cc, gcc, clang) to build against kvio_abi.h")


def _c_layout(tmp_path: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """struct -> field -> (offset, size) as a C compiler lays them out from the header
    (plus "" -> (0, sizeof struct))."""
    lines = []
    for struct, mirror in STRUCTS.items():
        lines.append(f'printf("{struct}  %zu %zu\\n", (size_t)0, sizeof({struct}));')
        for field, _ in mirror._fields_:
            lines.append(f'printf("{struct} {field} %zu %zu\\n", offsetof({struct}, {field}), '
                         f'sizeof((({struct}*)0)->{field}));')
    src = tmp_path / "layout.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"kvio_abi.h\"\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    proc = subprocess.run([_c_compiler(), "-std=c11", "-Wall", "-Werror", f"-I{INCLUDE_DIR}",
                           str(src), "-o", str(exe)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        struct, field, offset, size = line.split(" ")
        out.setdefault(struct, {})[field] = (int(offset), int(size))
    return out


def test_the_header_and_the_ctypes_mirror_lay_every_struct_out_alike(tmp_path: Path) -> None:
    c = _c_layout(tmp_path)
    for struct, mirror in STRUCTS.items():
        assert c[struct].pop("") == (0, ctypes.sizeof(mirror)), struct
        assert c[struct] == {name: (getattr(mirror, name).offset, getattr(mirror, name).size)
                             for name, _ in mirror._fields_}, struct


def _prototypes() -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types) of every KVIO_API declaration of the header."""
    text = re.sub(r"/\*.*?\*/", "", ABI_HEADER.read_text(), flags=re.S)
    found = {}
    for ret, name, params in re.findall(r"KVIO_API\s+([\w\s\*]+?)\s*\b(kvio_\w+)\s*\(([^)]*)\)",
                                        text):
        types = []
        for param in params.split(","):
            param = param.replace("const ", "").strip()
            if param in ("void", ""):
                continue
            ctype = re.sub(r"\s*\b\w+$", "", param).replace(" ", "")  # drop the name
            types.append(ctype)
        found[name] = (ret.replace("const ", "").replace(" ", ""), types)
    return found


def _mirrors(c_type: str, ctype: object) -> bool:
    if c_type.endswith("*") and c_type not in C_TO_CTYPES:
        return ctype is ctypes.c_void_p  # any other pointer travels as an address
    return C_TO_CTYPES[c_type] is ctype


def test_every_function_of_the_header_is_in_the_mirror_with_the_same_parameters() -> None:
    header = _prototypes()
    mirror = {**PROTOTYPES, **OPTIONAL_PROTOTYPES}
    assert sorted(header) == sorted(mirror)
    for name, (ret, params) in header.items():
        restype, argtypes = mirror[name]
        assert _mirrors(ret, restype), (name, ret)
        assert len(params) == len(argtypes), name
        for i, (c_type, ctype) in enumerate(zip(params, argtypes, strict=True)):
            assert _mirrors(c_type, ctype), (name, i, c_type, ctype)


def test_the_header_states_the_abi_version_of_the_binding() -> None:
    assert re.search(rf"#define KVIO_ABI_VERSION {ABI_VERSION}\b", ABI_HEADER.read_text())


def test_the_header_states_the_inline_index_limits_of_the_binding() -> None:
    """kvcore passes the _inline functions at most this many host indices, or pages."""
    header = ABI_HEADER.read_text()
    assert re.search(rf"#define KVIO_INLINE_INDEX_TOKENS {INLINE_INDEX_TOKENS}\b", header)
    assert re.search(rf"#define KVIO_INLINE_INDEX_PAGES {INLINE_INDEX_PAGES}\b", header)
