"""``kvio replay`` on the CPU with the reference backend: at least 10,000 page transfers and
no error; corrupted or failed transfers make it report errors and exit nonzero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcore.cli import main
from kvcore.controller import WritePolicy
from kvcore.layout import Kind, Layout, Op
from kvcore.replay import ReplayConfig, WorkloadConfig, run_replay
from kvcore.replay.prefix_index import PrefixIndex
from kvcore.replay.workload import Workload, chain_key
from kvcore.testing.faults import Fault, FaultInjector, FaultMode

SMALL = dict(num_layers=2, head_num=2, head_dim=16, page_size=4)
SMALL_ARGS = ["--device", "cpu", "--layers", "2", "--heads", "2", "--head-dim", "16",
              "--page-size", "4", "--no-progress"]


def test_replay_cpu_ten_thousand_transfers_without_error(clean_env: pytest.MonkeyPatch,
                                                          ) -> None:
    stats = run_replay(ReplayConfig(**SMALL, min_transfers=10_000))
    assert stats.errors == 0, stats.error_messages
    assert stats.transfers >= 10_000
    assert stats.stopped_by == "min_transfers"
    # the workload exercised what it claims: prefix hits in both tiers, evictions in both
    assert stats.device_hits > 0 and stats.host_hits > 0 and stats.misses > 0
    assert stats.pages_loaded > 0 and stats.pages_written > 0
    assert stats.device_evicted > 0 and stats.host_evicted > 0
    assert stats.backend == "reference"


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH_SELECTIVE,
                                    WritePolicy.WRITE_BACK])
@pytest.mark.parametrize(("kind", "layout"), [(Kind.MHA, Layout.PAGE_HEAD),
                                              (Kind.MLA, Layout.LAYER_FIRST)])
def test_replay_every_policy_and_kind(clean_env: pytest.MonkeyPatch, policy: WritePolicy,
                                      kind: Kind, layout: Layout) -> None:
    cfg = ReplayConfig(**{**SMALL, "head_num": 1 if kind is Kind.MLA else 2},
                       kind=kind, layout=layout, write_policy=policy, min_transfers=1500)
    stats = run_replay(cfg)
    assert stats.errors == 0, stats.error_messages
    assert stats.pages_loaded > 0 and stats.pages_written > 0 and stats.device_evicted > 0


def test_cli_exit_zero_and_json_log(clean_env: pytest.MonkeyPatch, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "replay.json"
    rc = main(["replay", *SMALL_ARGS, "--min-transfers", "1000", "--json", "--log", str(log)])
    assert rc == 0
    facts = json.loads(log.read_text())
    assert facts == json.loads(capsys.readouterr().out)
    assert facts["errors"] == 0 and facts["transfers"] >= 1000
    assert facts["bytes_device_to_host"] == facts["pages_written"] * facts["page_bytes"]


@pytest.mark.parametrize("op", [Op.LOAD_LAYER, Op.WRITE_BACK])
def test_cli_exits_nonzero_on_checksum_mismatch(faults: FaultInjector, tmp_path: Path,
                                                op: Op) -> None:
    faults.arm(Fault(op, nth=3, mode=FaultMode.CORRUPT, repeat=True))
    log = tmp_path / "replay.json"
    rc = main(["replay", *SMALL_ARGS, "--backend", faults.name, "--min-transfers", "4000",
               "--log", str(log)])
    facts = json.loads(log.read_text())
    assert rc == 1
    assert facts["checksum_mismatches"] > 0 and facts["transfer_errors"] == 0


def test_cli_exits_nonzero_on_failed_transfer(faults: FaultInjector, tmp_path: Path) -> None:
    faults.arm(Fault(Op.WRITE_BACK, nth=4, mode=FaultMode.ASYNC))
    log = tmp_path / "replay.json"
    rc = main(["replay", *SMALL_ARGS, "--backend", faults.name, "--min-transfers", "4000",
               "--log", str(log)])
    facts = json.loads(log.read_text())
    assert rc == 1
    assert facts["transfer_errors"] == 1 and facts["stopped_by"] == "error"
    assert "TransferFailed" in facts["error_messages"][0]


def test_workload_shares_prompts_and_grows_sessions() -> None:
    w = Workload(WorkloadConfig(system_prompts=2, prompt_pages=3, live_sessions=4,
                                concurrency=4, max_turns=3, seed=7))
    first = {r.session: r for r in w.wave()}
    second = {r.session: r for r in w.wave()}
    prompts = {r.keys[:3] for r in first.values()}
    assert 1 <= len(prompts) <= 2  # every session starts from one of the shared prompts
    for sid, r in second.items():
        if sid in first:  # the next turn extends the previous prompt
            assert r.keys[:len(first[sid].keys)] == first[sid].keys
            assert len(r.keys) == len(first[sid].keys) + r.new_pages


def test_chained_keys_depend_on_the_whole_prefix() -> None:
    assert chain_key(1, 5) == chain_key(1, 5)
    assert chain_key(1, 5) != chain_key(2, 5) != chain_key(1, 6)
    assert 0 <= chain_key(2**63 - 1, 2**64 - 1) < 2**63


def test_prefix_index_evicts_least_recently_used_unpinned() -> None:
    idx = PrefixIndex()
    a, b, c = (idx.lookup(k) for k in (1, 2, 3))
    for page, e in enumerate((a, b, c)):
        idx.place_on_device(e, page)
    idx.touch(a)
    assert [e.key for e in idx.device_victims(pinned={2})] == [3, 1]
    assert idx.leave_device(c) == 2 and 3 not in idx.entries  # resident nowhere: forgotten
