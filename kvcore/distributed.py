"""Tensor-parallel agreement: every rank must resolve the same plans and ack the same pages.

Two pieces, both used by :class:`~kvcore.controller.HiCacheController` when it is given a
``torch.distributed`` process group:

* :func:`agree_on_plans` runs once at construction. Each rank publishes its resolved plans
  (or the error that stopped it from resolving them) in the group's key-value store under
  ``kvcore/plan/<generation>/<rank>`` and reads every peer's entry before a deadline. It uses
  the store, not a collective, so a rank that failed or died can never leave its peers
  blocked: a failed peer is read as a failure, a dead one is noticed when the deadline
  passes (at once when it hosted the store). Every rank then raises: the same
  :class:`~kvcore.errors.PlanMismatch` when plans differ, or
  :class:`~kvcore.errors.RanksFailed` naming a peer that failed (and its error) or never
  arrived. :func:`failing_together` wraps the construction up to the exchange (resolution,
  checks, start-up verification), so a rank which raises there publishes its error instead
  of vanishing.
* :class:`AckAgreement` is an elementwise all-reduce MIN over the status of each queued write
  (completed, pending, failed on rank r), so a write is acknowledged only once it completed on
  every rank and dropped everywhere once it failed on any, with a bounded wait that names a
  rank which stopped taking part.

The generation counts exchanges per group in this process; ranks construct controllers
collectively, so their counters agree and a later exchange never reads an earlier one's keys.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvcore.errors import PlanMismatch, RanksFailed
from kvcore.streams import resolve_device

KEY_PREFIX = "kvcore/plan"
ACK_KEY_PREFIX = "kvcore/acks"

_generations: dict[str, int] = {}
_ack_generations: dict[str, int] = {}
_local = threading.local()  # .scopes: per open failing_together, has this rank published yet?


def _scopes() -> list[bool]:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


class AckAgreement:
    """The acknowledgement rounds of one controller over the ranks of ``process_group``.

    Each round is an all-reduce MIN (:meth:`min_each`) whose wait is bounded by ``timeout_s``:
    a rank that does not take part in time (stopped, dead, or not polling: every rank must
    call ``poll_acks()``/``wait_acks()`` in step) fails the round with
    :class:`~kvcore.errors.RanksFailed` naming it, instead of blocking for the process group's
    own timeout. To name it, each rank writes the number of the round it entered into the
    group's store (one key per rank, overwritten each round) before it reduces. A failed
    round leaves the group unable to agree again (a collective may still be pending in it):
    every later round raises the same error.
    """

    def __init__(self, process_group: Any, timeout_s: float,
                 store: dist.Store | None = None) -> None:
        self.process_group = process_group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.store = store if store is not None else _group_store(process_group)
        name = getattr(process_group, "group_name", None) or "world"
        self.generation = _ack_generations.get(name, 0)
        _ack_generations[name] = self.generation + 1
        self.round = 0
        self.broken: RanksFailed | None = None

    def key(self, rank: int) -> str:
        return f"{ACK_KEY_PREFIX}/{self.generation}/{rank}"

    def min_each(self, values: Sequence[int]) -> list[int]:
        """The elementwise minimum of ``values`` (equally long on every rank) over the ranks,
        or RanksFailed (see the class)."""
        if self.broken is not None:
            raise self.broken
        self.round += 1
        try:
            self.store.set(self.key(self.rank), str(self.round))
        except Exception as exc:  # any store failure means a lost host
            raise self._fail(self._store_lost(exc)) from exc
        t = torch.tensor(list(values), dtype=torch.int64,
                         device=_collective_device(self.process_group))
        try:
            work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.process_group,
                                   async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as exc:  # a timeout or a lost peer
            raise self._fail(self._who_is_missing(exc)) from exc
        return [int(v) for v in t.tolist()]

    def _store_lost(self, exc: BaseException) -> tuple[str, list[int]]:
        return (f"the store became unreachable ({type(exc).__name__}: {exc}); the rank "
                "hosting it (usually rank 0) has probably exited", [0] if self.rank else [])

    def _who_is_missing(self, exc: BaseException) -> tuple[str, list[int]]:
        try:
            behind = [r for r in range(self.world) if r != self.rank and (
                not self.store.check([self.key(r)])
                or int(self.store.get(self.key(r))) < self.round)]
        except Exception as lost:  # noqa: BLE001 - the store host is gone too
            return self._store_lost(lost)
        if not behind:
            return f"the collective failed ({type(exc).__name__}: {exc})", []
        names = ", ".join(map(str, behind))
        return (f"rank{'s' if len(behind) > 1 else ''} {names} did not take part within "
                f"{self.timeout_s:g} s (stopped, dead, or not polling: every rank must call "
                f"poll_acks() or wait_acks() in step; {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})", behind)

    def _fail(self, why: tuple[str, list[int]]) -> RanksFailed:
        message, missing = why
        self.broken = RanksFailed(
            f"acknowledgement round {self.round} failed on rank {self.rank} of {self.world}: "
            f"{message}; no write can be acknowledged through this group any more: recreate "
            "the process group and the controller", {}, missing)
        return self.broken


def agree_on_plans(facts: Sequence[dict[str, object]], process_group: Any,
                   timeout_s: float, store: dist.Store | None = None) -> None:
    """Exchange plan facts with every rank of ``process_group``; raise on all if any differ.

    Args:
        facts: this rank's plans as plain data (``HiCacheController.plan_facts()``).
        process_group: the group whose ranks must agree.
        timeout_s: how long to wait for the slowest peer before naming it as missing.
        store: the store to exchange through (default: the group's own store).

    Raises:
        PlanMismatch: ranks resolved different plans; the message names the ranks and fields.
        RanksFailed: a peer reported an error before the exchange, or did not arrive in time.
    """
    exchange = _Exchange(process_group, timeout_s, store)
    exchange.publish({"ok": True, "facts": list(facts)})
    entries = exchange.collect()
    mismatch = describe_mismatch({r: e["facts"] for r, e in entries.items()})
    if mismatch is not None:
        message, differences = mismatch
        raise PlanMismatch(message, differences)


def report_failure(error: BaseException, process_group: Any,
                   store: dist.Store | None = None) -> None:
    """Publish that this rank failed before the exchange, so its peers fail instead of waiting.

    Best effort: if the store cannot be reached the peers still fail at their deadline.
    """
    with contextlib.suppress(Exception):
        _Exchange(process_group, 0.0, store).publish(
            {"ok": False, "error": f"{type(error).__name__}: {error}"})


@contextlib.contextmanager
def failing_together(process_group: Any, store: dist.Store | None = None) -> Iterator[None]:
    """Run the work that ends in :func:`agree_on_plans`; an error before it is published.

    A no-op without a process group. An error raised once this rank has published (a
    mismatch, a failed peer, or anything after the exchange) is not published again, so
    every rank takes part in exactly one exchange per construction.
    """
    if process_group is None:
        yield
        return
    scopes = _scopes()
    scopes.append(False)
    try:
        yield
    except BaseException as exc:
        if not scopes[-1]:
            report_failure(exc, process_group, store)
        raise
    finally:
        scopes.pop()


def describe_mismatch(facts_by_rank: dict[int, Sequence[dict[str, object]]],
                      ) -> tuple[str, list[dict[str, object]]] | None:
    """Compare every rank's plan facts with the lowest rank's; None when all are equal.

    Returns the message (ranks with identical differences are named together) and the
    differences as records ``{rank, reference_rank, plan, field, value, reference_value}``.
    """
    ranks = sorted(facts_by_rank)
    base_rank = ranks[0]
    base = _by_plan(facts_by_rank[base_rank])
    differences: list[dict[str, object]] = []
    groups: dict[str, list[int]] = {}
    for rank in ranks[1:]:
        other = _by_plan(facts_by_rank[rank])
        parts = []
        for plan in [*base, *(k for k in other if k not in base)]:
            fields = (_diff(other[plan], base[plan], "") if plan in other and plan in base
                      else [("plan", other.get(plan, _ABSENT), base.get(plan, _ABSENT))])
            differences += [dict(rank=rank, reference_rank=base_rank, plan=plan, field=f,
                                 value=v, reference_value=b) for f, v, b in fields]
            if fields:
                parts.append(f"{plan}: " + ", ".join(f"{f} {v!r} vs {b!r}" for f, v, b in fields))
        if parts:
            groups.setdefault("; ".join(parts), []).append(rank)
    if not groups:
        return None
    lines = []
    for text, members in groups.items():
        who = (f"rank {members[0]} differs" if len(members) == 1 else
               f"ranks {', '.join(map(str, members))} differ")
        lines.append(f"\n  {who} from rank {base_rank} in {text}")
    return "plan mismatch across ranks:" + "".join(lines), differences


def _by_plan(facts: Sequence[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {f"member {f.get('member')} {f.get('op')}": f for f in facts}


def _diff(value: object, base: object, path: str) -> list[tuple[str, object, object]]:
    """Leaf fields where ``value`` differs from ``base``, as (dotted path, value, base)."""
    if isinstance(value, dict) and isinstance(base, dict):
        return [d for k in sorted(value.keys() | base.keys(), key=str) if k != "member"
                for d in _diff(value.get(k, _ABSENT), base.get(k, _ABSENT),
                               f"{path}.{k}" if path else str(k))]
    if isinstance(value, list) and isinstance(base, list) and len(value) == len(base):
        return [d for i, (v, b) in enumerate(zip(value, base, strict=True))
                for d in _diff(v, b, f"{path}[{i}]")]
    return [] if value == base else [(path, value, base)]


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _collective_device(process_group: Any) -> torch.device:
    backend = str(dist.get_backend(process_group))
    if backend == "gloo" or "cpu:" in backend:  # "cpu:gloo,cuda:nccl" groups reduce on the CPU
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return resolve_device(accelerator.type)


def _group_store(process_group: Any) -> dist.Store:
    from torch.distributed import distributed_c10d as c10d

    group = c10d._get_default_group() if process_group is None else process_group
    return c10d._get_process_group_store(group)


class _Exchange:
    """One generation of the store protocol for one group."""

    def __init__(self, process_group: Any, timeout_s: float, store: dist.Store | None) -> None:
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.timeout_s = timeout_s
        self.store = store if store is not None else _group_store(process_group)
        name = getattr(process_group, "group_name", None) or "world"
        self.generation = _generations.get(name, 0)
        _generations[name] = self.generation + 1

    def key(self, rank: int) -> str:
        return f"{KEY_PREFIX}/{self.generation}/{rank}"

    def publish(self, entry: dict[str, object]) -> None:
        scopes = _scopes()
        if scopes:
            scopes[-1] = True
        # (Store.set takes bytes as well; torch's stub names str only)
        self.store.set(self.key(self.rank), pickle.dumps(entry))  # type: ignore[arg-type]

    def collect(self) -> dict[int, dict[str, Any]]:
        """Every rank's entry; raise RanksFailed once a peer failed or the deadline passed."""
        deadline = time.monotonic() + self.timeout_s
        entries: dict[int, dict[str, Any]] = {}
        pause = 0.001
        while True:
            try:
                for rank in range(self.world):
                    if rank not in entries and self.store.check([self.key(rank)]):
                        entries[rank] = pickle.loads(self.store.get(self.key(rank)))
            except Exception as exc:  # any store failure means a lost peer
                raise self._failed(entries, (
                    f"the store became unreachable ({type(exc).__name__}: {exc}); the rank "
                    "hosting it (usually rank 0) has probably exited; no word from")) from exc
            if any(not e["ok"] for e in entries.values()):
                raise self._failed(entries)
            if len(entries) == self.world:
                return entries
            if time.monotonic() >= deadline:
                raise self._failed(entries, "no answer within "
                                   f"{self.timeout_s:g} s, dead or stuck before the exchange:")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _failed(self, entries: dict[int, dict[str, Any]], lost: str = "") -> RanksFailed:
        """Name the failed ranks and their errors, else why and which peers are missing."""
        failed = {r: str(e["error"]) for r, e in sorted(entries.items()) if not e["ok"]}
        missing = [] if failed else [r for r in range(self.world)
                                     if r not in entries and r != self.rank]
        parts = [f"rank {r} failed before the plan exchange: {err}" for r, err in failed.items()]
        if missing:
            names = ", ".join(map(str, missing))
            parts.append(f"{lost} rank{'s' if len(missing) > 1 else ''} {names}")
        return RanksFailed(f"plan agreement failed on rank {self.rank} of {self.world}: "
                           + "; ".join(parts), failed, missing)
