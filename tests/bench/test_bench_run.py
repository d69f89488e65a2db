"""Running the benchmark: checked rows are timed, wrong backends fail untimed, JSON validates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from kvcore.bench import report
from kvcore.bench.queue import QueueRow
from kvcore.bench.row import FAILED, OK, UNSUPPORTED
from kvcore.bench.runner import Bench
from kvcore.cli import main
from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout, Op
from kvcore.registry import REFERENCE, default_registry

from .helpers import case, register

CPU = torch.device("cpu")
SMALL = ["--through", "kernel",
         "--page-size", "4", "--batch-pages", "2", "--total-pages", "4", "--num-layers", "2",
         "--element-dim", "128", "--warmup", "1", "--repeat", "2"]


def cases() -> list:
    return [case(op, kind, layers=2, elem=128, page=4, batch=2, total=4)
            for op in Op for kind in Kind]


def validate(doc: dict) -> None:
    jsonschema.validate(doc, report.schema(), cls=jsonschema.Draft202012Validator)


def test_reference_rows_are_timed_with_ceiling_and_speedup() -> None:
    result = Bench(default_registry(), CPU, cases(), backends=[REFERENCE], warmup=1,
                   repeat=3).run()
    assert len(result.rows) == 6
    for row in result.rows:
        assert row.status == OK, row.reason
        assert len(row.timing.samples_ms) == 3
        assert row.ceiling is not None and row.ceiling_kind == "memcpy"
        assert row.ratio == pytest.approx(row.ceiling.median_ms / row.timing.median_ms)
        assert row.speedup == pytest.approx(1.0)
    by_size = {}
    for row in result.rows:  # one yardstick per (direction, bytes): the fastest copy
        by_size.setdefault((row.case.direction, row.case.bytes_moved), row.ceiling)
        assert row.ceiling is by_size[(row.case.direction, row.case.bytes_moved)]
    assert result.machine["pinned"] is False and result.machine["cpu_count"] >= 1
    validate(json.loads(report.to_json(result, "kvio bench")))


def test_the_report_says_how_fast_the_host_ran_python_beside_the_cpu_times() -> None:
    """CPU rows of two runs compare only beside the host's speed: the machine facts carry
    it, the header names it, and a document without it (older runs) still reads."""
    result = Bench(default_registry(), CPU, cases()[:1], backends=[REFERENCE], warmup=1,
                   repeat=2).run()
    speed = result.machine["host_speed_ns"]
    assert set(speed) == {"python_call", "tensor_attributes", "sum_range_1000"}
    assert all(v > 0 for v in speed.values())
    # sum(range(1000)) is a thousand additions, far more than one call
    assert speed["sum_range_1000"] > 10 * speed["python_call"]
    (line,) = [ln for ln in report.header_lines(result) if ln.startswith("host speed:")]
    assert f"a Python call {speed['python_call']:.0f} ns" in line
    assert f"sum(range(1000)) {speed['sum_range_1000'] / 1e3:.1f} us" in line
    validate(json.loads(report.to_json(result, "kvio bench")))
    del result.machine["host_speed_ns"]
    assert not any(ln.startswith("host speed:") for ln in report.header_lines(result))
    validate(json.loads(report.to_json(result, "kvio bench")))
    result.machine["host_speed_ns"] = {"python_call": -1.0}
    with pytest.raises(jsonschema.ValidationError):
        validate(json.loads(report.to_json(result, "kvio bench")))


@pytest.mark.parametrize("after", ["corrupt", "raise"])
def test_a_wrong_backend_is_marked_failed_and_never_timed(after: str) -> None:
    with default_registry().isolated() as reg:
        instances = register(reg, "wrong", after)
        result = Bench(reg, CPU, cases(), backends=[REFERENCE, "wrong"], warmup=1,
                       repeat=3).run()
    wrong = [r for r in result.rows if r.backend == "wrong"]
    assert len(wrong) == 6
    for row in wrong:
        assert row.status == FAILED
        assert row.timing is None and row.ratio is None and row.speedup is None
        expected = "differs from the reference" if after == "corrupt" else "deliberate failure"
        assert expected in row.reason
    # one run per row for the check (one per layer for per-layer load), none for timing
    layer_calls = 2 if after == "corrupt" else 1
    assert instances["cpu"].runs == 4 + 2 * layer_calls
    assert all(r.status == OK for r in result.rows if r.backend == REFERENCE)
    doc = json.loads(report.to_json(result, "kvio bench"))
    validate(doc)
    assert "not timed:" in report.text_table(result)


def test_a_backend_without_the_op_is_unsupported() -> None:
    with default_registry().isolated() as reg:
        register(reg, "partial", "none", ops=(Op.WRITE_BACK,))
        result = Bench(reg, CPU, cases(), backends=["partial"], warmup=0, repeat=1).run()
    status = {r.case.op: r.status for r in result.rows}
    assert status == {Op.WRITE_BACK: OK, Op.LOAD_LAYER: UNSUPPORTED, Op.LOAD_ALL: UNSUPPORTED}
    assert all(r.speedup is None for r in result.rows)  # the reference was not among them


def test_default_backends_are_the_available_ones_reference_first() -> None:
    with default_registry().isolated() as reg:
        register(reg, "aaa", "none")
        names = Bench(reg, CPU, []).backend_names()
    assert names[0] == REFERENCE and "aaa" in names


def test_cli_writes_json_markdown_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, md, png = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "b.png"
    argv = ["bench", *SMALL, "--op", "write_back,load_layer", "--layout", "layer_first",
            "--json", str(out), "--markdown", str(md)]
    if _has_matplotlib():
        argv += ["--plot", str(png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "ratio" in text and "reference" in text
    doc = json.loads(out.read_text())
    validate(doc)
    assert {r["op"] for r in doc["rows"]} == {"write_back", "load_layer"}
    assert {r["layout"] for r in doc["rows"]} == {Layout.LAYER_FIRST.value}
    assert all(r["status"] == "ok" and r["ratio"] > 0 for r in doc["rows"])
    assert "| backend |" in md.read_text() and "--markdown" in md.read_text()
    if _has_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_names_the_environment_that_changes_what_is_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    argv = ["bench", *SMALL, "--op", "load_all", "--quiet", "--json", str(out), "--markdown",
            str(md)]
    from kvcore.bench.machine import MEASURED_ENVIRONMENT

    for name in MEASURED_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert main(argv) == 0
    assert "environment:" not in md.read_text()
    monkeypatch.setenv("KVCORE_ASYNC_WRITE_BACK", "0")
    monkeypatch.setenv("KVIO_CUDA_TUNE", "UNROLL=8")
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path))  # a path: not a measured setting
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["settings"]["environment"] == {"KVCORE_ASYNC_WRITE_BACK": "0",
                                              "KVIO_CUDA_TUNE": "UNROLL=8"}
    assert "environment: KVCORE_ASYNC_WRITE_BACK=0 KVIO_CUDA_TUNE=UNROLL=8" in \
        md.read_text()


def test_cli_json_to_stdout(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", *SMALL, "--op", "load_all", "--kind", "mla", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate(doc)
    assert [r["bytes"] for r in doc["rows"]] == [1 * 2 * 2 * 4 * 128 * 2] * 2


def test_schema_rejects_a_failed_row_with_timings() -> None:
    with default_registry().isolated() as reg:
        register(reg, "wrong", "corrupt")
        result = Bench(reg, CPU, cases()[:1], backends=["wrong"], warmup=0, repeat=1).run()
    doc = json.loads(report.to_json(result, "kvio bench"))
    validate(doc)
    doc["rows"][0]["timing"] = {"median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0,
                                "spread_pct": 0.0, "samples_ms": [1.0]}
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_reference_rows_can_be_timed_with_fewer_repetitions() -> None:
    with default_registry().isolated() as reg:
        instances = register(reg, "other", "none", ops=(Op.WRITE_BACK,))
        result = Bench(reg, CPU, cases()[:1], backends=[REFERENCE, "other"], warmup=2,
                       repeat=4, reference_repeat=1).run()
    samples = {r.backend: len(r.timing.samples_ms) for r in result.rows}
    assert samples == {REFERENCE: 1, "other": 4}
    sets = cases()[0].index_sets  # the other backend keeps check, warm-up rounds, repeat
    assert instances["cpu"].runs == 1 + 2 * sets + 4
    assert result.settings["reference_repeat"] == 1
    assert "reference: repeat 1 from its oracle call, no warm-up" in report.text_table(result)
    validate(json.loads(report.to_json(result, "kvio bench")))
    with pytest.raises(InvalidArgument, match="reference_repeat"):
        Bench(default_registry(), CPU, [], reference_repeat=0)



def test_the_reference_row_is_its_oracle_run_timed_after_the_other_backends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore.bench import runner

    allocated: list[str] = []
    real_allocate = runner.allocate_host_pool

    def counting(*args: object, **kwargs: object) -> object:
        allocated.append(str(kwargs.get("backend")))
        return real_allocate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "allocate_host_pool", counting)
    with default_registry().isolated() as reg:
        instances = register(reg, "other", "none", ops=(Op.WRITE_BACK,))
        reference = reg.instance(REFERENCE, CPU)
        runs = []
        real_run = reference.run
        monkeypatch.setattr(reference, "run", lambda job: (runs.append(job), real_run(job))[1])
        labels: list[str] = []
        result = Bench(reg, CPU, cases()[:1], backends=[REFERENCE, "other"], warmup=1,
                       repeat=2).run(lambda label: labels.append(label.split()[0]))
    sets = cases()[0].index_sets
    assert [r.backend for r in result.rows] == [REFERENCE, "other"]
    assert all(r.status == OK and r.timing is not None for r in result.rows)
    assert labels == ["other", REFERENCE]  # timed last: its timed calls change its result
    other = instances["cpu"].runs  # "other" runs through the reference too
    assert other == 1 + sets + 2  # its check, a warm-up round, the timed calls
    assert len(runs) == other + 1 + sets + 2  # the oracle call is the reference's check
    assert sorted(allocated) == ["other", REFERENCE, REFERENCE]  # initial, expected, other's


@pytest.mark.parametrize("repeat", [1, 3])
def test_with_reference_repeat_the_oracle_call_is_the_first_timed_call(
        monkeypatch: pytest.MonkeyPatch, repeat: int) -> None:
    with default_registry().isolated() as reg:
        instances = register(reg, "other", "none", ops=(Op.WRITE_BACK,))
        reference = reg.instance(REFERENCE, CPU)
        runs: list[object] = []
        real_run = reference.run
        monkeypatch.setattr(reference, "run", lambda job: (runs.append(job), real_run(job))[1])
        result = Bench(reg, CPU, cases()[:1], backends=[REFERENCE, "other"], warmup=1,
                       repeat=2, reference_repeat=repeat).run()
    assert all(r.status == OK for r in result.rows)
    ref = next(r for r in result.rows if r.backend == REFERENCE)
    assert len(ref.timing.samples_ms) == repeat
    other = instances["cpu"].runs
    assert len(runs) == other + repeat  # no call of its own besides the timed ones


def test_controller_rows_time_queues_of_controller_calls(tmp_path: Path) -> None:
    """--through controller: writes + acks and loads + wait_layer, through the controller."""
    out = tmp_path / "queue.json"
    md = tmp_path / "queue.md"
    assert main(["bench", "--through", "controller", "--queue-pages", "1,2", "--kind", "mla",
                 "--num-layers", "2", "--quiet", "--json", str(out), "--markdown",
                 str(md)]) == 0
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, report.schema())
    assert doc["rows"] == []
    rows = doc["controller_rows"]
    assert sorted((r["op"], r["pages"]) for r in rows) == [
        ("load", 1), ("load", 2), ("write", 1), ("write", 2)]
    for r in rows:
        assert r["error"] is None and r["backend"] == "reference"
        assert r["ratio"] > 0 and r["cpu_us"] > 0 and r["cpu_idle_us"] > 0 and r["calls"] >= 4
        assert r["bytes_per_call"] == r["pages"] * 64 * 2 * 576 * 2  # 64-token pages, 2 layers
        assert (r["wait_us"] is None) == (r["op"] == "write")
    text = md.read_text()
    assert "Through the controller" in text and "CPU us/call, device idle" in text
    # the run's facts count the queues: their time, and their host pools' memory
    assert doc["machine"]["host_memory"] == "plain" and not doc["machine"]["pinned"]
    assert doc["elapsed_s"] > 0
    assert "host memory: plain (pinned: no)" in text
    assert re.search(r"elapsed \d+\.\d s", text) and "elapsed 0.0 s" not in text
    table = [line for line in text.splitlines() if line.startswith("| reference |")]
    assert len(table) == 4 and all(line.count("|") == 18 for line in table)
    # each row times the host's Python call just before its queues, and shows it
    head = next(line for line in text.splitlines() if "host ns/Python call" in line)
    col = [c.strip() for c in head.split("|")].index("host ns/Python call")
    for line, r in zip(sorted(table), sorted(rows, key=lambda r: (r["op"], r["pages"])),
                       strict=True):
        assert r["host_call_ns"] > 0
        assert QueueRow.from_facts(r).host_call_ns == r["host_call_ns"]
        assert line.split("|")[col].strip() == f"{r['host_call_ns']:.0f}"
    # caller busy: the CPU inside the calls over the wall time per call (on the CPU reference
    # backend every call runs its copy itself, so the caller is busy nearly all the time)
    head = next(line for line in text.splitlines() if "caller busy" in line)
    col = [c.strip() for c in head.split("|")].index("caller busy")
    for line, r in zip(sorted(table), sorted(rows, key=lambda r: (r["op"], r["pages"])),
                       strict=True):
        # (from the fastest queue alone: a repeat another process slowed cannot lift it)
        share = r["busy_us"] / (1e3 * r["ms_per_call"])
        assert QueueRow.from_facts(r).caller_share == pytest.approx(share)
        assert line.split("|")[col].strip() == f"{share:.0%}" and 0 < share < 1.25
