"""Plan agreement and acknowledgements across gloo ranks spawned by the tests themselves.

Starting a rank costs seconds (it imports torch), so one group per world size plays every
scenario that leaves all ranks alive, in turn: that also shows that a failed construction
leaves nothing behind that disturbs the next one. A rank that dies gets a group of its own.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import socket
import time

import pytest

from kvcore.distributed import describe_mismatch

from .rank_worker import ACK_SCHEDULE, ACK_TIMEOUT_S, PAGE, TWIN, WRITES, run_rank

JOIN_S = 90.0  # a generous bound on a whole group: a rank still running after it hung
PLAYS = [("agree", -1, 30.0), ("backend", -1, 30.0), ("residency", 0, 30.0),
         ("raise", 1, 30.0), ("acks", -1, 30.0), ("failed_ack", -1, 30.0),
         ("agree_again", -1, 30.0)]
DEATH_TIMEOUT_S = 3.0

Outcomes = dict[str, dict[int, tuple]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, plays: list[tuple[str, int, float]]) -> Outcomes:
    """Play ``plays`` on ``world`` fresh ranks; return scenario -> rank -> outcome.

    Fails if any rank is still running after JOIN_S (the stragglers are killed).
    """
    ctx = mp.get_context("spawn")
    results, joined = ctx.Queue(), ctx.Barrier(world)
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, plays, results, joined),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes: Outcomes = {name: {} for name, _, _ in plays}
    deadline = time.monotonic() + JOIN_S
    while time.monotonic() < deadline:
        try:
            scenario, rank, outcome = results.get(timeout=0.2)
            outcomes[scenario][rank] = outcome
        except queue_module.Empty:
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not stuck, f"ranks {stuck} hung; outcomes: {outcomes}"
    return outcomes


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def played(request: pytest.FixtureRequest) -> tuple[int, Outcomes]:
    odd = request.param - 1
    plays = [(name, odd if rank == -1 else rank, t) for name, rank, t in PLAYS]
    return request.param, spawn(request.param, plays)


def raised(outcome: tuple) -> tuple[str, str]:
    assert outcome[0] == "raised", outcome
    return outcome[1], outcome[2]


def test_ranks_agree_on_identical_plans(played: tuple[int, Outcomes]) -> None:
    world, out = played
    for scenario in ("agree", "agree_again"):
        assert sorted(out[scenario]) == list(range(world))
        facts = [out[scenario][r] for r in range(world)]
        assert all(f[0] == "ok" for f in facts), facts
        assert all(f[1] == facts[0][1] for f in facts)
        assert {p["backend"] for p in facts[0][1]} == {"reference"}


def test_a_rank_on_another_backend_fails_every_rank(played: tuple[int, Outcomes]) -> None:
    world, out = played
    odd = world - 1
    assert sorted(out["backend"]) == list(range(world))
    errors = {raised(o) for o in out["backend"].values()}
    assert len(errors) == 1, f"every rank raises the same error: {errors}"
    name, message = errors.pop()
    assert name == "PlanMismatch"
    assert message.startswith("plan mismatch across ranks:\n")
    assert f"rank {odd} differs from rank 0 in member 0 load_all: backend '{TWIN}' vs " \
           "'reference'" in message
    for op in ("load_layer", "write_back"):
        assert f"; member 0 {op}: backend '{TWIN}' vs 'reference'" in message
    assert message.count("differ") == 1, "only the odd rank is named"


def test_a_rank_with_other_index_residency_fails_every_rank(
        played: tuple[int, Outcomes]) -> None:
    world, out = played
    errors = {raised(o) for o in out["residency"].values()}
    assert len(errors) == 1 and len(out["residency"]) == world
    name, message = errors.pop()
    assert name == "PlanMismatch"
    others = ", ".join(map(str, range(1, world)))
    who = "rank 1 differs" if world == 2 else f"ranks {others} differ"
    assert f"{who} from rank 0 in member 0 load_all: variants[0].host_index 'host:int64' " \
           "vs 'device:int64'" in message
    assert "backend " not in message, "only the field that differs is named"


def test_a_rank_that_raises_before_the_exchange_fails_its_peers(
        played: tuple[int, Outcomes]) -> None:
    world, out = played
    assert sorted(out["raise"]) == list(range(world))
    assert raised(out["raise"][1])[0] == "NoBackend"
    for r in set(range(world)) - {1}:
        name, message = raised(out["raise"][r])
        assert name == "RanksFailed"
        assert message.startswith(
            f"plan agreement failed on rank {r} of {world}: rank 1 failed before the plan "
            "exchange: NoBackend: no backend can serve")


def test_acks_advance_by_the_minimum_completed_across_ranks(
        played: tuple[int, Outcomes]) -> None:
    world, out = played
    expected, acked = [], 0
    for done in [*ACK_SCHEDULE[world], [WRITES] * world]:
        expected.append((list(range(acked, min(done))), WRITES - min(done)))
        acked = min(done)
    assert sorted(out["acks"]) == list(range(world))
    for r in range(world):
        assert out["acks"][r][0] == "ok", out["acks"][r]
        polls = [(ids, pending) for ids, pending in out["acks"][r][1]["polls"]]
        assert polls == expected, f"rank {r}"
        assert out["acks"][r][1]["completed"] == WRITES


def test_a_write_that_fails_on_one_rank_is_acknowledged_on_none_and_the_rest_on_all(
        played: tuple[int, Outcomes]) -> None:
    """Acks agree by write, not by count: the failed write (the 2nd of 3 on the odd rank) is
    reported failed on every rank and acknowledged on none; the 1st and 3rd are acknowledged
    on every rank, the 3rd too (a count would have acked the failed one and never the last)."""
    world, out = played
    odd = world - 1
    assert sorted(out["failed_ack"]) == list(range(world)), "every rank returned"
    for r in range(world):
        assert out["failed_ack"][r][0] == "ok", out["failed_ack"][r]
        got = out["failed_ack"][r][1]
        (first, message), second = got["polls"]
        assert first == "TransferFailed"
        assert message.startswith(f"write-back 1 failed at completion on rank {odd} (this is "
                                  f"rank {r}); it is acknowledged on no rank and its host "
                                  "slots were released")
        assert second == ("acked", [0, 2])
        assert (got["pending"], got["completed"]) == (0, 2)
        assert got["held"] == 2 * PAGE, "the failed write's slots were released, the others kept"


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_dies_before_the_exchange_fails_its_peers_in_time(world: int) -> None:
    out = spawn(world, [("die", world - 1, DEATH_TIMEOUT_S)])["die"]
    assert sorted(out) == list(range(world - 1)), "every surviving rank reported"
    for outcome in out.values():
        name, message = raised(outcome)
        assert name == "RanksFailed"
        assert message.endswith("no answer within 3 s, dead or stuck before the exchange: "
                                f"rank {world - 1}")
        assert outcome[-1] >= DEATH_TIMEOUT_S, "it waited for the deadline, not less"


def test_when_the_rank_hosting_the_store_dies_its_peers_fail_at_once() -> None:
    out = spawn(2, [("die", 0, 30.0)])["die"]
    assert list(out) == [1]
    name, message = raised(out[1])
    assert name == "RanksFailed"
    assert message.startswith("plan agreement failed on rank 1 of 2: the store became "
                              "unreachable (")
    assert message.endswith("has probably exited; no word from rank 0")
    assert out[1][-1] < 30.0, "it did not wait for the deadline"


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_stops_polling_is_named_within_the_ack_timeout(world: int) -> None:
    odd = world - 1
    out = spawn(world, [("frozen_acks", odd, 30.0)])["frozen_acks"]
    assert sorted(out) == list(range(world))
    assert out[odd][:2] == ("ok", "stopped"), out[odd]  # (an error shows its message)
    for r in range(odd):
        assert out[r][0] == "ok", out[r]
        got = out[r][1]
        assert got["missing"] == [odd]
        assert f"rank {odd} did not take part within {ACK_TIMEOUT_S:g} s" in got["error"]
        assert "every rank must call poll_acks() or wait_acks() in step" in got["error"]
        assert ACK_TIMEOUT_S <= got["seconds"] < ACK_TIMEOUT_S + 3, "bounded, not the 30-s " \
            "process-group timeout"
        assert "acknowledgement round 1 failed" in got["second"]
        assert got["leaked"] == 0, "the unacknowledged write's host slots were released"


def test_a_rank_that_dies_is_named_by_the_next_ack_round() -> None:
    out = spawn(2, [("dead_acks", 1, 30.0)])["dead_acks"]
    assert list(out) == [0]
    assert out[0][0] == "ok", out[0]
    got = out[0][1]
    assert got["missing"] == [1]
    assert "rank 1 did not take part" in got["error"]
    assert got["seconds"] < ACK_TIMEOUT_S + 3
    assert got["leaked"] == 0


def test_describe_mismatch_groups_ranks_and_names_missing_plans() -> None:
    plan = {"member": 0, "op": "write_back", "backend": "reference", "variants": [
        {"host_index": "host:int64"}]}
    other = {**plan, "variants": [{"host_index": "device:int64"}]}
    extra = {**plan, "member": 1}
    assert describe_mismatch({0: [plan], 1: [plan]}) is None
    message, diffs = describe_mismatch({0: [plan], 1: [other], 2: [other], 3: [other, extra]})
    assert message == (
        "plan mismatch across ranks:"
        "\n  ranks 1, 2 differ from rank 0 in member 0 write_back: "
        "variants[0].host_index 'device:int64' vs 'host:int64'"
        "\n  rank 3 differs from rank 0 in member 0 write_back: "
        "variants[0].host_index 'device:int64' vs 'host:int64'; "
        "member 1 write_back: plan {'member': 1, 'op': 'write_back', 'backend': 'reference', "
        "'variants': [{'host_index': 'host:int64'}]} vs <absent>")
    assert [(d["rank"], d["field"]) for d in diffs] == [
        (1, "variants[0].host_index"), (2, "variants[0].host_index"),
        (3, "variants[0].host_index"), (3, "plan")]
