"""Runs cut short still report what they measured; several runs' JSON merge into one report."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import jsonschema
import pytest
import torch

from kvcore.bench import report
from kvcore.bench.merge import load, merge
from kvcore.bench.row import OK
from kvcore.bench.runner import Bench
from kvcore.cli import main
from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Op
from kvcore.registry import REFERENCE, default_registry

from .helpers import case

CPU = torch.device("cpu")
SMALL = ["--through", "kernel",
         "--page-size", "4", "--batch-pages", "2", "--total-pages", "4", "--element-dim", "128",
         "--warmup", "1", "--repeat", "2", "--layout", "page_first", "--backend", REFERENCE]


def validate(doc: dict) -> None:
    jsonschema.validate(doc, report.schema(), cls=jsonschema.Draft202012Validator)


def three_cases() -> list:
    return [case(op, Kind.MHA, layers=2, elem=128, page=4, batch=2, total=4) for op in Op]


def test_an_interrupt_between_rows_keeps_the_rows_measured_so_far() -> None:
    calls = []

    def advance(label: str) -> None:
        calls.append(label)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what SIGTERM becomes under `kvio bench`

    result = Bench(default_registry(), CPU, three_cases(), backends=[REFERENCE], warmup=0,
                   repeat=1).run(advance)
    assert [r.case.op for r in result.rows] == [Op.WRITE_BACK]
    assert result.rows[0].status == OK and result.rows[0].ceiling is not None
    assert result.not_run == 2
    assert [c.op for c in result.not_run_cases] == [Op.LOAD_LAYER, Op.LOAD_ALL]
    doc = json.loads(report.to_json(result, "kvio bench"))
    validate(doc)
    assert doc["not_run"] == 2
    assert [c["op"] for c in doc["not_run_cases"]] == ["load_layer", "load_all"]
    assert "INCOMPLETE: stopped early, 2 case(s) not run" in report.text_table(result)


def test_a_time_limit_stops_before_the_next_case() -> None:
    result = Bench(default_registry(), CPU, three_cases(), backends=[REFERENCE], warmup=0,
                   repeat=1, time_limit_s=0.0).run()
    assert result.rows == [] and result.not_run == 3
    full = Bench(default_registry(), CPU, three_cases(), backends=[REFERENCE], warmup=0,
                 repeat=1, time_limit_s=3600.0).run()
    assert len(full.rows) == 3 and full.not_run == 0


def test_cli_time_limit_reports_and_exits_nonzero(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "b.json"
    assert main(["bench", *SMALL, "--time-limit", "1e-9", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "stopped early" in captured.err and "INCOMPLETE" in captured.out
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["rows"] == [] and doc["not_run"] > 0 and "--time-limit 1e-09" in doc["command"]


def test_sigterm_during_the_run_becomes_an_incomplete_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "b.json"
    real_run = Bench.run

    def run_then_terminate(self: Bench, advance: object = None) -> object:
        seen = []

        def advance_and_signal(label: str) -> None:  # a case is reported once complete
            seen.append(label)
            if len(seen) == 2:
                signal.raise_signal(signal.SIGTERM)

        return real_run(self, advance_and_signal)

    monkeypatch.setattr(Bench, "run", run_then_terminate)
    assert main(["bench", *SMALL, "--quiet", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 1 and doc["not_run"] > 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored afterwards


CONTROLLER = ["--through", "controller", "--queue-pages", "1,4", "--kind", "mha",
              "--num-layers", "2", "--warmup", "1", "--repeat", "2", "--backend", REFERENCE]


def test_sigterm_during_the_controller_queues_keeps_every_row_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """README: a run stopped early still writes every report. The queues run after the
    kernel rows; a signal there lost both."""
    from kvcore.bench import queue

    out, md = tmp_path / "b.json", tmp_path / "b.md"
    real = queue.run_queue
    calls = []

    def run_then_terminate(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(queue, "run_queue", run_then_terminate)
    assert main(["bench", *CONTROLLER, "--quiet", "--json", str(out),
                 "--markdown", str(md)]) == 1
    assert "stopped early, 3 of 4 controller queues not run" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    validate(doc)
    assert len(doc["controller_rows"]) == 1 and doc["controller_not_run"] == 3
    assert "INCOMPLETE: stopped early, 3 controller queue(s) not run" in md.read_text()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_time_limit_covers_the_controller_queues(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert main(["bench", *CONTROLLER, "--quiet", "--time-limit", "1e-9",
                 "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["controller_rows"] == [] and doc["controller_not_run"] == 4


def test_progress_lines_on_stderr_when_not_a_terminal(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", *SMALL, "--op", "write_back", "--kind", "mla",
                 "--num-layers", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[1/1 ")
    assert err[0].endswith("reference write_back mla/page_first L2 e128")


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    path = tmp_path / f"{name}.json"
    assert main(["bench", *SMALL, "--quiet", "--json", str(path), *extra]) == 0
    return path


def test_merge_joins_runs_into_one_report(tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    a = _run(tmp_path, "a", "--kind", "mla", "--num-layers", "2")
    b = _run(tmp_path, "b", "--kind", "mha", "--num-layers", "2,3")
    md, out = tmp_path / "m.md", tmp_path / "m.json"
    assert main(["bench", "--merge", str(a), str(b), "--markdown", str(md),
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert len(doc["rows"]) == 3 + 6 and doc["settings"]["runs"] == 2
    assert {(r["kind"], r["num_layers"]) for r in doc["rows"]} == {
        ("mla", 2), ("mha", 2), ("mha", 3)}
    by_file = {json.dumps(r, sort_keys=True) for p in (a, b)
               for r in json.loads(p.read_text())["rows"]}
    assert {json.dumps(r, sort_keys=True) for r in doc["rows"]} == by_file  # rows unchanged
    text = md.read_text()
    assert "--kind mla" in text and "--kind mha" in text  # both commands are quoted
    assert f"kvio bench --merge {a} {b}" in text  # and what was merged
    assert "ratio" in capsys.readouterr().out


def test_merge_refuses_options_it_would_ignore_and_a_run_given_twice(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import shutil

    a = _run(tmp_path, "a", "--kind", "mla", "--num-layers", "2")
    copy = tmp_path / "copy.json"
    shutil.copy(a, copy)
    for argv, needle in ((["--kind", "mha"], "--kind"), (["--repeat", "3"], "--repeat"),
                         ([str(a)], "each file once"), ([str(copy)], "each run once")):
        assert main(["bench", "--merge", str(a), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvio bench: InvalidArgument: --merge: expected ") and needle in err


def test_merge_keeps_the_later_run_of_a_repeated_case(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", "--kind", "mla", "--num-layers", "2")
    b = _run(tmp_path, "b", "--kind", "mla", "--num-layers", "2", "--seed", "5")
    first, second = load(str(a))[0], load(str(b))[0]
    merged = merge([first, second])
    assert len(merged.rows) == 3
    assert [r.timing for r in merged.rows] == [r.timing for r in second.rows]


def test_merge_keeps_each_host_speed_step_s_slowest_and_says_so(tmp_path: Path) -> None:
    """Merged rows' CPU times come from every run: the header shows the slowest host; a run
    recorded before hosts were timed adds nothing."""
    from kvcore.bench.report import header_lines

    a = _run(tmp_path, "a", "--kind", "mla", "--num-layers", "2")
    b = _run(tmp_path, "b", "--kind", "mha", "--num-layers", "2")
    c = _run(tmp_path, "c", "--kind", "mha", "--num-layers", "3")
    first, second, old = load(str(a))[0], load(str(b))[0], load(str(c))[0]
    first.machine["host_speed_ns"] = {"python_call": 30.0, "tensor_attributes": 200.0}
    second.machine["host_speed_ns"] = {"python_call": 45.0, "tensor_attributes": 150.0}
    del old.machine["host_speed_ns"]
    merged = merge([first, second, old])
    assert merged.machine["host_speed_ns"] == {"python_call": 45.0, "tensor_attributes": 200.0}
    assert first.machine["host_speed_ns"]["python_call"] == 30.0  # the runs stay as they were
    (line,) = [ln for ln in header_lines(merged) if ln.startswith("host speed")]
    assert line.startswith("host speed (the slowest of 3 runs): a Python call 45 ns")
    assert "host_speed_ns" not in merge([old]).machine


def test_merge_refuses_runs_of_different_machines_and_foreign_files(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", "--kind", "mla", "--num-layers", "2")
    first = load(str(a))[0]
    other = load(str(a))[0]
    other.machine = {**other.machine, "gpu": "Some Other GPU"}
    with pytest.raises(InvalidArgument, match="same gpu"):
        merge([first, other])
    other = load(str(a))[0]
    other.settings = {**other.settings, "warmup": 3}
    with pytest.raises(InvalidArgument, match=r"timed the same way \(same warmup\)"):
        merge([first, other])
    older = load(str(a))[0]  # a run from before warm-up counted rounds over the index sets
    del older.settings["warmup_per"]
    with pytest.raises(InvalidArgument, match="same warmup_per"):
        merge([first, older])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(InvalidArgument, match=r"kvcore\.bench/1"):
        load(str(bad))
    truncated = json.loads(a.read_text())
    del truncated["rows"][0]["timing"]
    bad.write_text(json.dumps(truncated))
    with pytest.raises(InvalidArgument, match="missing or malformed 'timing'"):
        load(str(bad))
    with pytest.raises(InvalidArgument, match="readable"):
        load(str(tmp_path / "missing.json"))


def _cut_short(tmp_path: Path, name: str, *extra: str) -> Path:
    """A run of SMALL (+ extra) whose time limit stops it before its first case."""
    path = tmp_path / f"{name}.json"
    assert main(["bench", *SMALL, "--quiet", "--time-limit", "1e-9", "--json", str(path),
                 *extra]) == 1
    return path


def test_merge_counts_a_case_as_not_run_only_if_no_run_measured_it(tmp_path: Path) -> None:
    cut = _cut_short(tmp_path, "cut", "--kind", "mla", "--num-layers", "2")
    doc = json.loads(cut.read_text())
    validate(doc)
    assert doc["not_run"] == 3 and len(doc["not_run_cases"]) == 3 and doc["rows"] == []
    rest = _run(tmp_path, "rest", "--kind", "mla", "--num-layers", "2", "--op",
                "load_layer,load_all")
    merged = merge([load(str(cut))[0], load(str(rest))[0]])
    assert merged.not_run == 1  # write_back: measured by neither run
    assert [c.op for c in merged.not_run_cases] == [Op.WRITE_BACK]
    whole = _run(tmp_path, "whole", "--kind", "mla", "--num-layers", "2")
    assert main(["bench", "--merge", str(cut), str(whole), "--quiet"]) == 0


def test_merge_names_the_missing_cases_of_a_file_that_only_counted_them(
        tmp_path: Path) -> None:
    cut = _cut_short(tmp_path, "cut", "--kind", "mla", "--num-layers", "2")
    older = json.loads(cut.read_text())
    del older["not_run_cases"]  # as kvio bench wrote it before it listed them
    cut.write_text(json.dumps(older))
    assert load(str(cut))[0].not_run_unnamed == 3
    whole = _run(tmp_path, "whole", "--kind", "mla", "--num-layers", "2")
    out = tmp_path / "m.json"
    assert main(["bench", "--merge", str(cut), str(whole), "--quiet", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["not_run"] == 0  # named from its command, then covered
    older["command"] = "kvio bench --no-such-option"  # unreadable: the count stays
    cut.write_text(json.dumps(older))
    assert main(["bench", "--merge", str(cut), str(whole), "--quiet", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["not_run"] == 3


def test_page_unified_rows_with_head_groups_run_validate_and_merge(tmp_path: Path) -> None:
    """`kvio bench --layout page_unified --head-group-num 1,2,4`: one case per head group count
    the element allows (256 = 2 heads of 128: 1 and 2), in the JSON and back through merge."""
    from kvcore.bench.sweep import PRESETS, expand, override

    sweep = override(PRESETS["seed"], layouts=["page_unified"], head_group_nums=["1", "2", "4"],
                     kinds=["mha", "mla"], element_dims=["256"], num_layers=["16"])
    assert sorted({(c.kind.value, c.head_group_num) for c in expand(sweep)}) == [
        ("mha", 1), ("mha", 2), ("mla", 1)]
    out = tmp_path / "unified.json"
    small = [{"page_first": "page_unified", "128": "256"}.get(a, a) for a in SMALL]
    assert main(["bench", *small, "--head-group-num", "1,2", "--kind", "mha", "--op",
                 "write_back,load_layer", "--num-layers", "2", "--quiet", "--json",
                 str(out)]) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert sorted((r["layout"], r["head_group_num"], r["status"]) for r in doc["rows"]) == [
        ("page_unified", 1, "ok"), ("page_unified", 1, "ok"),
        ("page_unified", 2, "ok"), ("page_unified", 2, "ok")]
    merged = merge([load(out)[0]])
    assert sorted(r.case.head_group_num for r in merged.rows) == [1, 1, 2, 2]
    assert "page_unified g2" in report.text_table(merged)


def test_the_schema_names_every_layout() -> None:
    """The JSON schema lists layout names; a new layout record needs its name there too."""
    from kvcore.layout import Layout

    defs = report.schema()["$defs"]
    for where in ("case", "row"):
        assert defs[where]["properties"]["layout"]["enum"] == [lay.value for lay in Layout]
