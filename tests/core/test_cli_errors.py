"""Issue 25, item 8: every mistake on the ``kvio`` command line is one typed line and exit 2.

Each case goes through the CLI entry (``kvcore.cli.main``, or a subprocess where the process
itself must differ), and each is refused before any work: no sweep, no allocation, no file.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcore.cli import main

from .helpers import BROKEN_PLUGIN_SOURCE, good_plugin_source

FakePlugin = Callable[[str], tuple[str, str]]

SMALL = ["--page-size", "4", "--batch-pages", "2", "--total-pages", "4", "--element-dim", "128",
         "--warmup", "1", "--repeat", "2", "--layout", "page_first", "--backend", "reference",
         "--op", "write_back", "--kind", "mla", "--num-layers", "2"]
REPLAY_SMALL = ["--device", "cpu", "--layers", "2", "--heads", "2", "--head-dim", "16",
                "--page-size", "4", "--min-transfers", "20", "--no-progress"]


@pytest.fixture(autouse=True)
def _env(clean_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return clean_env


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], error: str,
            *needles: str) -> str:
    """Run ``kvio argv``; assert exit 2 and one stderr line naming ``error``; return it."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvio {argv[0]}: {error}: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ malformed --merge files

@pytest.fixture(scope="module")
def bench_json(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "run.json"
    assert main(["bench", *SMALL, "--quiet", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _write(path: Path, doc: dict) -> str:
    path.write_text(json.dumps(doc))  # NaN is written as NaN, as Python's json reads it
    return str(path)


def test_merge_of_a_truncated_file(tmp_path: Path, bench_json: dict,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    text = json.dumps(bench_json)
    bad = tmp_path / "cut.json"
    bad.write_text(text[: len(text) // 2])
    refused(capsys, ["bench", "--merge", str(bad)], "InvalidArgument", "--merge", str(bad))


def test_merge_of_a_file_of_another_schema(tmp_path: Path, bench_json: dict,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path / "other.json", {**bench_json, "schema": "kvcore.bench/0"})
    refused(capsys, ["bench", "--merge", bad], "InvalidArgument", "kvcore.bench/1")
    bad = _write(tmp_path / "list.json", [bench_json])  # type: ignore[arg-type]
    refused(capsys, ["bench", "--merge", bad], "InvalidArgument", "kvcore.bench/1")


@pytest.mark.parametrize("value", [math.nan, -1.5, math.inf])
@pytest.mark.parametrize("where", ["timing", "ceiling"])
def test_merge_of_nan_or_negative_timings(tmp_path: Path, bench_json: dict, value: float,
                                          where: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(json.dumps(bench_json))
    doc["rows"][0][where]["samples_ms"][0] = value
    bad = _write(tmp_path / "bad.json", doc)
    out = tmp_path / "merged.md"
    refused(capsys, ["bench", "--merge", bad, "--markdown", str(out)], "InvalidArgument",
            "samples_ms", repr(value))
    assert not out.exists()


# ------------------------------------------------------- report paths into a missing folder

@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_bench_report_into_a_missing_folder_fails_before_the_sweep(
        tmp_path: Path, option: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore.bench.runner import Bench

    def no_sweep(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep started")

    monkeypatch.setattr(Bench, "run", no_sweep)
    target = tmp_path / "no" / "such" / "folder" / "report.out"
    refused(capsys, ["bench", *SMALL, option, str(target)], "InvalidArgument", option,
            "no folder")


@pytest.mark.parametrize("pages", ["0", "x", "-1", "1,0"])
def test_bench_queue_pages_must_be_positive_integers(
        pages: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore.bench.runner import Bench

    def no_sweep(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep started")

    monkeypatch.setattr(Bench, "run", no_sweep)
    refused(capsys, ["bench", *SMALL, "--through", "both", "--queue-pages", pages],
            "InvalidArgument", "--queue-pages", "positive integers", repr(pages))


@pytest.mark.parametrize(("axes", "option", "needle"), [
    (["--kind", "mla", "--layout", "page_head"], "--layout", "page_head (for mha only)"),
    (["--kind", "mla", "--layout", "page_first,page_head"], "--layout", "page_head"),
    (["--through", "controller", "--kind", "mla", "--layout", "page_head"], "--layout",
     "page_head"),
    (["--layout", "page_unified", "--head-group-num", "3"], "--head-group-num",
     "no case is left"),
])
def test_bench_refuses_a_sweep_with_asked_for_parts_that_cannot_exist(
        axes: list[str], option: str, needle: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout asked for that no kind asked for has was dropped without a word (or its
    controller rows failed, exit 0)."""
    from kvcore.bench.runner import Bench

    def no_sweep(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep started")

    monkeypatch.setattr(Bench, "run", no_sweep)
    small = list(SMALL)
    i = small.index("--kind")
    del small[i:i + 2]
    i = small.index("--layout")
    del small[i:i + 2]
    refused(capsys, ["bench", *small, *axes], "InvalidArgument", option, needle)


def test_bench_plot_without_matplotlib_fails_before_the_sweep(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore.bench.runner import Bench

    def no_sweep(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep started")

    monkeypatch.setattr(Bench, "run", no_sweep)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    refused(capsys, ["bench", *SMALL, "--plot", str(tmp_path / "b.png")], "PlotUnavailable",
            "pip install 'kvcore[plot]'")


def test_merge_report_into_a_missing_folder(tmp_path: Path, bench_json: dict,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "good.json", bench_json)
    refused(capsys, ["bench", "--merge", good, "--markdown", str(tmp_path / "no" / "t.md")],
            "InvalidArgument", "--markdown")


def test_replay_log_into_a_missing_folder_fails_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcore.cli.replay as replay_cli

    monkeypatch.setattr(replay_cli, "run_replay", lambda *a, **k: pytest.fail("it ran"))
    refused(capsys, ["replay", *REPLAY_SMALL, "--log", str(tmp_path / "no" / "log.json")],
            "InvalidArgument", "--log")


# ------------------------------------------------------------------- devices

COMMANDS = {
    "bench": ["bench", *SMALL, "--quiet"],
    "replay": ["replay", *[a for a in REPLAY_SMALL if a not in ("--device", "cpu")]],
    "check": ["check", "reference"],
    "backends": ["backends", "--explain"],
    "build": ["build"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"backends"}))
def test_cuda_device_on_a_cpu_machine(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, [*COMMANDS[command], "--device", "cuda:0"], "InvalidArgument", "--device",
            "'cuda:0'", "no cuda device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_explain_answers_for_a_device_this_machine_lacks(
        capsys: pytest.CaptureFixture[str]) -> None:
    """README's and writing-a-backend.md's --explain commands name cuda:0: asked from a CPU
    box they say why cuda would not be chosen here, rather than refusing the device."""
    rc = main(["backends", "--explain", "--op", "write_back", "--kind", "mha", "--layout",
               "page_first", "--device", "cuda:0"])
    out = capsys.readouterr().out
    assert out.startswith("request: write_back mha/page_first bfloat16 element ")
    assert " on cuda:0\n" in out and "  cuda: unavailable: " in out
    assert rc == (0 if "chosen:  reference" in out else 1)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unknown_device(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, [*COMMANDS[command], "--device", "gpu7"], "InvalidArgument", "--device",
            "'gpu7'")


# ------------------------------------------------------------------- sizes that cannot fit

def test_bench_sizes_beyond_memory_are_refused_before_allocating(
        capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    refused(capsys, ["bench", "--backend", "reference", "--op", "write_back", "--kind", "mha",
                     "--layout", "page_first", "--page-size", "64", "--batch-pages", "1",
                     "--total-pages", str(1 << 40), "--element-dim", "4096", "--num-layers",
                     "80", "--quiet", "--device", "cpu"],
            "InvalidArgument", "--total-pages", "fit in host memory")
    assert time.perf_counter() - start < 30


def test_replay_sizes_beyond_memory_are_refused_before_allocating(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcore.cli.replay as replay_cli

    monkeypatch.setattr(replay_cli, "run_replay", lambda *a, **k: pytest.fail("it ran"))
    refused(capsys, ["replay", *REPLAY_SMALL, "--host-pages", str(1 << 44)],
            "InvalidArgument", "--host-pages", "fit in host memory")


# ------------------------------------------------------------------- kvio check

def test_check_of_an_unavailable_backend_fails(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("cuda is available here")
    refused(capsys, ["check", "cuda", "--device", "cpu"], "BackendUnavailable", "'cuda'")


def test_check_of_an_unknown_backend_fails(capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["check", "nosuch", "--device", "cpu"], "InvalidArgument", "NAME", "nosuch")


def test_check_without_pytest(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['pytest'] = None\n"
            "from kvcore.cli import main; sys.exit(main(['check', 'reference', '--device', "
            "'cpu']))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvio check: MissingDependency: "), lines
    assert "pytest" in lines[0] and "kvcore[test]" in lines[0]


# ------------------------------------------------------------------- kvio new-backend

def test_new_backend_into_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "a-file"
    target.write_text("mine")
    refused(capsys, ["new-backend", "mine", str(target)], "InvalidArgument", "DIR", "a file")
    assert target.read_text() == "mine"


def test_new_backend_into_a_path_under_a_file(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("mine")
    refused(capsys, ["new-backend", "mine", str(tmp_path / "a-file" / "sub")],
            "InvalidArgument", "DIR")


def test_new_backend_into_an_unwritable_path(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    if os.getuid() == 0:  # root writes anywhere a mode allows nothing; /proc refuses root too
        target = Path("/proc/kvio-new-backend-test")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "skeleton"
    refused(capsys, ["new-backend", "mine", str(target)], "InvalidArgument", "DIR",
            "a directory you can create and write")
    assert not target.exists()


# ------------------------------------------------------------------- KVCORE_BACKEND

@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_kvcore_backend_naming_no_backend(command: str, clean_env: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("KVCORE_BACKEND", "nosuch")
    argv = [a for a in COMMANDS[command] if a != "--backend"]
    if command == "bench":
        argv = [a for a in argv if a != "reference"]
    refused(capsys, argv, "InvalidArgument", "KVCORE_BACKEND", "'nosuch'", "reference")


# ------------------------------------------------------------------- KVCORE_STRICT

def test_strict_backends_shows_the_plugins_traceback(fake_plugin: FakePlugin,
                                                     clean_env: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    clean_env.setenv("KVCORE_STRICT", "1")
    assert main(["backends"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvio backends: PluginLoadError: ") and ep in err[0]
    assert err[1] == "Traceback (most recent call last):"
    assert err[-1] == "RuntimeError: fake plugin exploded on import"


def test_without_strict_a_broken_backend_by_name_is_one_line(
        fake_plugin: FakePlugin, clean_env: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    clean_env.setenv("KVCORE_BACKEND", ep)
    refused(capsys, ["backends"], "PluginLoadError", "exploded")


# ------------------------------------------------------------------- page_size

@pytest.mark.parametrize(("argv", "option"), [
    (["--page-size", "0"], "--page-size"), (["--warmup", "-1"], "--warmup"),
    (["--layout", "nope"], "--layout"), (["--total-pages", "0"], "--total-pages"),
    (["--head-group-num", "0"], "--head-group-num"),
    (["--reference-repeat", "0"], "--reference-repeat")])
def test_bench_errors_name_the_option(argv: list[str], option: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    small = [a for a in SMALL if a not in ("--layout", "page_first")] if "--layout" in argv \
        else SMALL
    args = dict(zip(small[::2], small[1::2], strict=True))
    args.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    refused(capsys, ["bench", *[w for kv in args.items() for w in kv]], "InvalidArgument",
            f"InvalidArgument: {option}: expected")


@pytest.mark.parametrize("option", ["--layers", "--heads", "--host-pages", "--device-pages",
                                    "--concurrency", "--max-requests"])
def test_replay_sizes_must_be_positive(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["replay", *REPLAY_SMALL, option, "0"], "InvalidArgument",
            f"InvalidArgument: {option}: expected a positive integer, got 0")


@pytest.mark.parametrize(("option", "value"), [("--time-limit", "0"), ("--time-limit", "-1"),
                                               ("--time-limit", "nan"),
                                               ("--min-transfers", "-5")])
def test_replay_bounds_that_mean_nothing_are_refused(option: str, value: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["replay", *REPLAY_SMALL, option, value], "InvalidArgument",
            f"InvalidArgument: {option}: expected ")


@pytest.mark.parametrize(("argv", "line"), [
    (["--sessions", "10"], "--concurrency: expected at most --sessions (10), got 32"),
    (["--host-pages", "10"], "--host-pages: expected at least "),
    (["--kind", "mla", "--heads", "8"], "--heads: expected 1 or unset for --kind mla"),
])
def test_replay_errors_name_the_options(argv: list[str], line: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["replay", *REPLAY_SMALL, *argv], "InvalidArgument", line)


def test_replay_interrupted_reports_what_it_replayed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--min-transfers 0 and no other bound runs until stopped: Ctrl-C (or SIGTERM) ends it
    with the report and the --log file, not a traceback."""
    import signal

    from kvcore.replay.runner import Replay

    real = Replay._wave
    waves = []

    def wave_then_terminate(self: Replay, requests: object) -> None:
        waves.append(1)
        if len(waves) == 3:
            signal.raise_signal(signal.SIGTERM)
        real(self, requests)  # type: ignore[arg-type]

    monkeypatch.setattr(Replay, "_wave", wave_then_terminate)
    log = tmp_path / "replay.json"
    argv = [a for a in REPLAY_SMALL if a not in ("--min-transfers", "20")]
    assert main(["replay", *argv, "--min-transfers", "0", "--log", str(log)]) == 0
    assert "(stopped by interrupted)" in capsys.readouterr().out
    facts = json.loads(log.read_text())
    assert facts["stopped_by"] == "interrupted" and facts["requests"] > 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("page_size", ["0", "1"])
def test_replay_page_size_error_names_page_size(page_size: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--device", "cpu", "--layers", "2", "--heads", "1", "--head-dim", "1",
            "--page-size", page_size, "--min-transfers", "20", "--no-progress"]
    refused(capsys, argv, "InvalidArgument", "InvalidArgument: page_size: ")


# ------------------------------------------------------------------- what a run leaves out

WITHOUT_BACKEND = [a for a in SMALL if a not in ("--backend", "reference")]


def test_bench_of_a_backend_unavailable_here_is_refused_before_the_sweep(
        capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("cuda is available here")
    refused(capsys, ["bench", *WITHOUT_BACKEND, "--backend", "cuda"], "InvalidArgument",
            "--backend", "'cuda'", "available on this machine")


def test_merge_refuses_to_write_over_one_of_its_inputs(tmp_path: Path, bench_json: dict,
                                                       capsys: pytest.CaptureFixture[str],
                                                       ) -> None:
    good = _write(tmp_path / "good.json", bench_json)
    before = Path(good).read_bytes()
    for option in ("--markdown", "--json"):
        refused(capsys, ["bench", "--merge", good, option, good], "InvalidArgument", option)
    assert Path(good).read_bytes() == before


def test_bench_says_which_plugin_it_could_not_load(fake_plugin: FakePlugin,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    assert main(["bench", *WITHOUT_BACKEND, "--quiet"]) == 0  # the others are measured
    err = capsys.readouterr().err
    assert f"kvio bench: plugin {ep!r} failed to load" in err and "not measured" in err


def test_bench_fails_a_backend_that_cannot_be_created(fake_plugin: FakePlugin,
                                                      capsys: pytest.CaptureFixture[str],
                                                      ) -> None:
    source = good_plugin_source("unmade").replace(
        "from kvio_reference.backend import ReferenceBackend",
        "raise ModuleNotFoundError(\"No module named 'kvio_missing_dep'\")")
    fake_plugin(source)
    assert main(["bench", *WITHOUT_BACKEND, "--backend", "unmade", "--through", "kernel",
                 "--quiet", "--json", "-"]) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    mine = [r for r in rows if r["backend"] == "unmade"]
    assert mine and all(r["status"] == "failed" and "kvio_missing_dep" in r["reason"]
                        for r in mine)


def test_check_of_every_backend_names_a_plugin_that_did_not_load(
        fake_plugin: FakePlugin, capsys: pytest.CaptureFixture[str]) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    assert main(["check", "--device", "cpu", "-k", "no_case_has_this_name"]) == 1
    out = capsys.readouterr().out
    assert f"== {ep}: not run, plugin {ep!r} failed to load: RuntimeError: fake plugin " \
           "exploded on import" in out


def test_new_backend_with_a_name_too_long_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["new-backend", "a" * 300, str(tmp_path / "nb")], "InvalidArgument",
            "NAME", "at most 64 characters")
    assert not (tmp_path / "nb").exists()


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvcore.cli", "backends", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before it writes: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141), err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("limit", ["0", "-5", "nan"])
def test_bench_time_limit_must_be_positive(limit: str, capsys: pytest.CaptureFixture[str],
                                           ) -> None:
    refused(capsys, ["bench", *SMALL, "--time-limit", limit], "InvalidArgument",
            "--time-limit", "a positive number of seconds")


@pytest.mark.parametrize(("device", "says"), [
    ("cuda", "torch sees no cuda device here"), ("bogus", "a torch device such as cpu")])
def test_the_suite_refuses_a_device_once_as_a_usage_error(device: str, says: str,
                                                          tmp_path: Path) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("cuda is available here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "kvcore.testing.plugin",
                           "--kvio-backend", "reference", "--kvio-device", device],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert "--kvio-device: expected" in proc.stderr and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "failed" not in proc.stdout


@pytest.mark.parametrize("argv", [["build", "--backend", "nope"],
                                  ["replay", *REPLAY_SMALL, "--backend", "nope"],
                                  ["backends", "--explain", "--backend", "nope"]])
def test_an_unknown_backend_name_is_one_usage_error_everywhere(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, argv, "InvalidArgument", "--backend", "expected the name of an installed "
            "backend", "'nope'")


@pytest.mark.parametrize("argv", [["--backend", "reference"], ["--op", "load_all"],
                                  ["--element-bytes", "64"]])
def test_backends_refuses_request_options_without_explain(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["backends", *argv], "InvalidArgument", argv[0], "--explain with it")
