"""The suite fails deliberately wrong backends, with messages that point at the cause."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore.registry import default_registry
from kvcore.testing.runner import run_suite

from .bad_backends import register_bad

#: enough cases to show the failures (every row, two page counts) and that refusals still hold
#: what each bad backend's failures must say; an extra token that lands in another written
#: page shows as a difference from the reference, one that lands in a free page as a write
#: outside the destination
CAUSES = {
    "flipped_byte": ("differs from the reference",),
    "wrong_residency": ("residency",),
    "no_bound_check": ("wrote outside its destination", "differs from the reference"),
    "forgets_signals": ("declares layer_signals",),
}

CASES = "TestPageCounts and (p1 or p4) or TestBadInputs and out_of_range"


@pytest.fixture(scope="module")
def bad_backends() -> Iterator[None]:
    registry = default_registry()
    with registry.isolated():
        register_bad(registry)
        yield


@pytest.mark.parametrize("name", sorted(CAUSES))
def test_suite_fails_with_the_cause(bad_backends: None, name: str) -> None:
    result = run_suite(name, "cpu", quick=True, extra=["-q", "--tb=short", "-k", CASES])
    assert not result.ok
    transfers = [f for f in result.failures if "TestPageCounts" in f.nodeid]
    assert transfers, f"no transfer case failed for {name}"
    causes = [c for c in CAUSES[name] if c in transfers[0].message]
    for failure in transfers:
        assert any(c in failure.message for c in CAUSES[name]), failure.message
        assert f"reproduction: backend={name} device=cpu" in failure.message
        # the rerun asks for the same case sizes (the cpu default is quick, not full)
        assert f"rerun: pytest --kvio-backend {name} --kvio-device cpu --kvio-quick -k '" \
            in failure.message
        assert "seed=" in failure.message and "host_indices pages:" in failure.message
    assert any(CAUSES[name][0] in f.message for f in transfers), causes
    refusals = [f for f in result.failures if "TestBadInputs" in f.nodeid]
    assert not refusals, "bad inputs are refused before any backend runs"
    assert all(c["failed"] == 0 for row, c in result.counts.items() if "bad_input" in row)


def test_a_bare_raise_is_named_as_one_with_the_backends_own_frames(bad_backends: None) -> None:
    result = run_suite("raises_bare", "cpu", quick=True,
                       extra=["-q", "--tb=short", "-k", "TestPageCounts and p4 and write_back"])
    assert result.failures
    for failure in result.failures:
        message = failure.message
        assert "write_back raised ValueError: too many tokens" in message
        assert "run() raised a bare ValueError: the contract asks for a " \
               "kvcore.errors.KVCoreError subclass" in message
        assert "where it raised (innermost frames):" in message and "bad_backends.py" in message
        # on the cpu both residencies are the same memory: no hint about them
        assert "the residency its OpSupport declares is wrong" not in message


def test_a_failing_randomised_case_keeps_no_pool_alive(bad_backends: None) -> None:
    """Hypothesis keeps every failing example's exception while it shrinks: a failure must
    not hold the frames that hold the case's pools (full-size cases kept gigabytes)."""
    import gc

    from kvcore.testing.harness import Rig

    result = run_suite("raises_bare", "cpu", quick=True,
                       extra=["-q", "--tb=short", "-k",
                              "TestRandomised and write_back and mha and page_first"])
    assert result.failures
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Rig]


def test_reference_passes_the_same_selection() -> None:
    result = run_suite("reference", "cpu", quick=True, extra=["-q", "-k", CASES])
    assert result.ok, [f.message for f in result.failures]
    assert result.totals()["passed"] > 50


def test_a_per_layer_load_submitted_as_one_job_passes_the_same_selection(
        bad_backends: None) -> None:
    result = run_suite("signaled", "cpu", quick=True, extra=["-q", "-k", CASES])
    assert result.ok, [f.message for f in result.failures]
    assert result.totals()["passed"] > 50


def test_known_failures_can_be_marked_expected(bad_backends: None) -> None:
    """kvio_xfail patterns turn a backend's known failures into xfail rows in the matrix."""
    result = run_suite("flipped_byte", "cpu", quick=True, extra=[
        "-q", "-k", "TestPageCounts and write_back",
        "-o", "kvio_xfail=write_back-*: flips a bit, fixed in 0.2"])
    assert result.ok, [f.message for f in result.failures]
    totals = result.totals()
    assert totals["xfail"] > 0 and totals["failed"] == 0 and totals["passed"] == 0


def test_matrix_reports_unclaimed_rows(bad_backends: None) -> None:
    """A backend that claims only write-back shows every load row as not claimed."""
    from kvcore.testing.runner import matrix

    result = run_suite("write_only", "cpu", quick=True, extra=["-q", "-k", "TestPageCounts"])
    assert result.ok, [f.message for f in result.failures]
    for row, counts in result.counts.items():
        if row.startswith("write_back"):
            assert counts["passed"] > 0 and counts["not claimed"] == 0, row
        else:
            assert counts["not claimed"] > 0 and counts["passed"] == 0, row
    assert "not claimed" in matrix(result)


def test_kvio_check_from_a_plugins_folder_honours_its_kvio_xfail(
        bad_backends: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.cli import main

    argv = ["check", "raises_bare", "--device", "cpu", "-k",
            "TestPageCounts and p4 and write_back"]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1  # no configuration here: the failures count
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "kvio-raises-bare"\n\n[tool.pytest.ini_options]\n'
        'kvio_xfail = ["write_back-*-p4-*: more than 3 pages land in 0.2"]\n')
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"pytest configuration {tmp_path / 'pyproject.toml'}" in out
    from kvcore.testing.runner import OUTCOMES

    total = dict(zip(OUTCOMES, map(int, out.split("\ntotal")[1].split()), strict=True))
    assert total["failed"] == 0 and total["xfail"] > 0, out


def test_kvio_check_fails_when_its_selection_matches_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.cli import main

    assert main(["check", "reference", "--device", "cpu", "-k", "typo_xyz"]) == 1
    assert "reference: no case matches -k 'typo_xyz'" in capsys.readouterr().out


def test_kvio_check_fails_a_selection_whose_cases_are_all_unclaimed(
        bad_backends: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A -k that matches only cases the backend does not claim ran nothing: exit status 1,
    not a green matrix of "not claimed" rows; a -k whose cases run still passes."""
    from kvcore.cli import main

    assert main(["check", "write_only", "--device", "cpu", "-k",
                 "TestPageCounts and load_layer"]) == 1
    out = capsys.readouterr().out
    assert ("write_only: no case matching -k 'TestPageCounts and load_layer' ran (" in out
            and "not claimed): its capabilities claim none of them" in out), out
    assert main(["check", "write_only", "--device", "cpu", "-k",
                 "TestPageCounts and write_back and p4"]) == 0


def test_kvio_check_fails_a_backend_that_claims_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    import attrs

    from kvcore import BackendSpec
    from kvcore.cli import main

    registry = default_registry()
    with registry.isolated():
        ref = registry.get("reference").spec
        registry.register(BackendSpec(
            capabilities=attrs.evolve(ref.capabilities, name="claims_nothing", ops=(),
                                      priority=-100),
            factory=ref.factory))
        assert main(["check", "claims_nothing", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "claims_nothing: ran no case: its capabilities claim nothing the suite covers" in out


def test_a_randomised_failure_s_rerun_selects_its_test(bad_backends: None) -> None:
    """The rerun line of a randomised example names the pytest case it was drawn from (the
    example's own id selects nothing), and running it fails that case again."""
    keyword = "TestRandomised and write_back and mla and page_first"
    result = run_suite("flipped_byte", "cpu", quick=True, extra=["-q", "--tb=short", "-k",
                                                                 keyword])
    [failure, *_] = result.failures
    rerun = next(line for line in failure.message.splitlines() if "rerun: pytest" in line)
    selected = rerun.split(" -k ")[1].strip("'")
    assert failure.nodeid.endswith(f"[{selected}]"), (failure.nodeid, rerun)
    again = run_suite("flipped_byte", "cpu", quick=True, extra=["-q", "--tb=short", "-k",
                                                                selected])
    assert [f.nodeid for f in again.failures] == [failure.nodeid]


def test_a_misdeclared_host_memory_is_one_failure_not_one_per_case(bad_backends: None) -> None:
    """Capabilities that say pinned over an allocator that gives plain memory: TestHostMemory
    fails and says so; the transfer cases, which bind would refuse each, are skipped."""
    result = run_suite("claims_pinned", "cpu", quick=True, extra=[
        "-q", "--tb=short", "-k", "TestHostMemory or TestPageCounts and p1"])
    assert [f.nodeid.split("::")[1] for f in result.failures] == ["TestHostMemory"]
    assert "declare host_memory pinned, allocate_host returned plain memory" \
        in result.failures[0].message
    totals = result.totals()
    assert totals["skipped"] > 0 and totals["passed"] == 0, totals
