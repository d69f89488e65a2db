"""Rewrite ``kvio bench --json`` files as gzip-compressed JSON lines, losslessly.

    python scripts/compact_bench_json.py docs/benchmarks/*/*.json

Each kvcore.bench/1 document FILE.json becomes FILE.jsonl.gz: its first line is the document
without its rows, then one compact line per row, every value as it was (``kvio bench --merge``
reads it as it reads the original; ``zcat FILE.jsonl.gz`` shows a row per line). The original
is removed once the copy reads back equal. Other JSON files are left alone.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path


def compact(path: Path) -> Path | None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or doc.get("schema") != "kvcore.bench/1":
        return None
    head = {k: v for k, v in doc.items() if k != "rows"}
    lines = [json.dumps(obj, separators=(",", ":")) for obj in (head, *doc["rows"])]
    out = path.with_name(path.name.removesuffix(".json") + ".jsonl.gz")
    out.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0))
    back = [json.loads(line) for line in gzip.decompress(out.read_bytes()).decode().splitlines()]
    if {**back[0], "rows": back[1:]} != doc:
        out.unlink()
        raise SystemExit(f"{out} does not read back equal to {path}; left {path} alone")
    path.unlink()
    return out


def main(argv: list[str]) -> int:
    for name in argv:
        out = compact(Path(name))
        print(f"{name} -> {out}" if out else f"{name}: not a kvio bench file, left alone")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
