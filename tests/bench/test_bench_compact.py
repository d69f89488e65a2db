"""Issue 25, item 11: benchmark records are kept compactly, and every reader reads every form.

The committed runs under docs/benchmarks hold their raw samples as gzip-compressed JSON lines;
``kvio bench --json`` writes that form on request and ``--merge`` reads every form it writes.
"""

from __future__ import annotations

import gzip
import json
import re
import shlex
from pathlib import Path

import pytest

from kvcore.bench.merge import load, merge
from kvcore.cli import main
from kvcore.registry import REFERENCE

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks"
SMALL = ["--through", "kernel", "--page-size", "4", "--batch-pages", "2", "--total-pages", "4",
         "--element-dim", "128",
         "--warmup", "1", "--repeat", "2", "--layout", "page_first", "--backend", REFERENCE,
         "--kind", "mla", "--num-layers", "2", "--quiet"]
FORMS = ["run.jsonl", "run.jsonl.gz", "run.json.gz"]


def _samples(path: Path) -> list[tuple[float, ...] | None]:
    result, _ = load(str(path))
    return [r.timing.samples_ms if r.timing else None for r in result.rows]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run, written as .json, then rewritten by --merge into each compact form."""
    folder = tmp_path_factory.mktemp("forms")
    original = folder / "run.json"
    assert main(["bench", *SMALL, "--json", str(original)]) == 0
    out = {"run.json": original}
    for name in FORMS:
        assert main(["bench", "--merge", str(original), "--quiet", "--json",
                     str(folder / name)]) == 0
        out[name] = folder / name
    return out


def test_json_lines_put_one_row_on_each_line(written: dict[str, Path]) -> None:
    lines = written["run.jsonl"].read_text().splitlines()
    head, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    assert head["schema"] == "kvcore.bench/1" and "rows" not in head
    assert len(rows) == 3 and all("samples_ms" in r["timing"] for r in rows)
    zipped = gzip.decompress(written["run.jsonl.gz"].read_bytes()).decode()
    assert zipped == written["run.jsonl"].read_text()


@pytest.mark.parametrize("name", FORMS)
def test_merge_reads_every_form(written: dict[str, Path], name: str,
                                tmp_path: Path) -> None:
    assert _samples(written[name]) == _samples(written["run.json"])
    md = tmp_path / "t.md"
    assert main(["bench", "--merge", str(written[name]), "--quiet", "--markdown", str(md)]) == 0
    assert md.read_text().count("| reference |") == 3


@pytest.mark.parametrize("name", FORMS)
def test_a_truncated_compact_file_is_one_line(written: dict[str, Path], name: str,
                                              tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    raw = written[name].read_bytes()
    if name.endswith(".gz"):
        raw = gzip.compress(gzip.decompress(raw)[:-40])  # a file cut inside its last row
    else:
        raw = raw[:-40]
    cut = tmp_path / name
    cut.write_bytes(raw)
    assert main(["bench", "--merge", str(cut)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvio bench: InvalidArgument: --merge")


def test_committed_records_are_compact() -> None:
    bench_json = [p for p in BENCHMARKS.rglob("*.json")
                  if '"kvcore.bench/1"' in p.read_text()]
    assert bench_json == []  # every kvio bench record is stored as .jsonl.gz
    text_lines = sum(len(p.read_text().splitlines())
                     for pattern in ("*.json", "*.jsonl") for p in BENCHMARKS.rglob(pattern))
    assert text_lines < 5_000  # was ~380,000 lines of indented JSON


def test_every_committed_record_loads() -> None:
    files = sorted(BENCHMARKS.rglob("*.jsonl.gz"))
    assert len(files) >= 20
    for path in files:
        result, command = load(str(path))
        assert result.rows or result.controller_rows, path
        assert command.startswith("kvio bench"), path


def _merge_commands() -> list[tuple[Path, list[str]]]:
    found = []
    for readme in BENCHMARKS.rglob("README.md"):
        text = readme.read_text().replace("\\\n", " ")
        for line in re.findall(r"kvio bench --merge [^\n`]*", text):
            words = shlex.split(line)[3:]
            found.append((readme.parent, [w for w in words[:words.index("--markdown")]]
                          if "--markdown" in words else words))
    assert len(found) >= 5
    return found


@pytest.mark.parametrize(("folder", "files"), _merge_commands(),
                         ids=lambda v: v.name if isinstance(v, Path) else None)
def test_the_merge_commands_of_the_committed_readmes_still_read_their_files(
        folder: Path, files: list[str]) -> None:
    results = [load(str(folder / name))[0] for name in files]
    merged = merge(results)
    assert merged.rows or merged.controller_rows  # (a merge of controller rows only has no rows)
