"""Reading ``kvio bench --json`` files back, and joining several runs into one report.

A long sweep (the seed table on one GPU) may be measured in several runs, each with its own
time limit. Every row carries the ceiling measured in its own run, so joining the rows of
runs on the same machine gives one table whose ratios keep their meaning.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from typing import Any

from kvcore.bench.queue import QueueRow
from kvcore.bench.row import Row
from kvcore.bench.runner import BenchResult
from kvcore.bench.sweep import Case, parse_dtype
from kvcore.bench.timing import Timing
from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout, Op, parse_enum


def read_document(path: str) -> Any:
    """The document of one ``kvio bench --json`` file, in any form it writes: one JSON
    document, or JSON lines (the document without its rows, then one row per line), either
    of them gzip-compressed. The form is read from the bytes, not from the file name.

    Raises OSError, or ValueError for bytes that are none of these.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == GZIP_MAGIC:
        data = gzip.decompress(data)
    text = data.decode("utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as whole:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            head = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            raise whole from None
        if not isinstance(head, dict) or "rows" in head:
            raise
        rows = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {number}: {exc}") from None
        return {**head, "rows": rows}
    if isinstance(doc, dict) and "rows" not in doc and "controller_rows" in doc:
        return {**doc, "rows": []}  # JSON lines of a run without kernel-path rows: its head
    return doc


def load(path: str) -> tuple[BenchResult, str]:
    """The result and the command line stored in one ``--json`` file (see
    :func:`read_document` for the forms read)."""
    try:
        facts = read_document(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgument("--merge", "a readable kvio bench JSON file",
                              f"{path}: {exc}") from exc
    schema = facts.get("schema") if isinstance(facts, dict) else None
    if schema != "kvcore.bench/1":
        raise InvalidArgument("--merge", "a file written by kvio bench --json (kvcore.bench/1)",
                              f"{path}: schema {schema!r}")
    try:
        rows = [_row(r) for r in facts["rows"]]
        named = [_case(c) for c in facts.get("not_run_cases", [])]
        result = BenchResult(rows=rows, machine=facts["machine"], backends=facts["backends"],
                             settings=facts["settings"], started=facts["started"],
                             elapsed_s=_duration("elapsed_s", facts["elapsed_s"]),
                             not_run_cases=named,
                             not_run_unnamed=max(0, facts.get("not_run", 0) - len(named)),
                             controller_rows=[QueueRow.from_facts(r)
                                              for r in facts.get("controller_rows", [])],
                             controller_not_run=facts.get("controller_not_run", 0))
        return result, facts["command"]
    except (KeyError, TypeError, ValueError) as exc:
        what = f"missing or malformed {exc}" if isinstance(exc, KeyError) else f"malformed: {exc}"
        raise InvalidArgument("--merge", "every field of kvcore.bench/1",
                              f"{path}: {what}") from exc


GZIP_MAGIC = b"\x1f\x8b"

#: the settings that say how a row was timed; merged runs must agree on every one
TIMING_SETTINGS = ("timer", "stream", "warmup", "warmup_per", "repeat", "reference_repeat")


def merge(results: Sequence[BenchResult]) -> BenchResult:
    """One result holding every run's rows, in run order.

    The runs must come from the same GPU and driver and be timed the same way (their ratios
    are then comparable, and the report's one header line is true of every row); a case
    measured twice for the same backend keeps the later run's row. A case one run did not
    reach counts as not run only if no run measured it.
    """
    if not results:
        raise InvalidArgument("--merge", "at least one JSON file", "none")
    first = results[0]
    for other in results[1:]:
        for fact in ("gpu", "driver", "torch"):
            if other.machine.get(fact) != first.machine.get(fact):
                raise InvalidArgument(
                    "--merge", f"runs on one machine (same {fact})",
                    f"{first.machine.get(fact)!r} and {other.machine.get(fact)!r}")
        for fact in TIMING_SETTINGS:
            if other.settings.get(fact) != first.settings.get(fact):
                raise InvalidArgument(
                    "--merge", f"runs timed the same way (same {fact})",
                    f"{first.settings.get(fact)!r} and {other.settings.get(fact)!r}")
    by_key: dict[tuple[object, ...], Row] = {}
    for result in results:
        for row in result.rows:
            key = (row.backend, *row.case.key())  # (a starred subscript needs 3.11)
            by_key[key] = row
    backends: dict[str, dict[str, Any]] = {}
    for result in results:
        backends.update({b["name"]: b for b in result.backends})
    measured = {row.case.key() for row in by_key.values()}
    not_run = {c.key(): c for result in results for c in result.not_run_cases
               if c.key() not in measured}
    settings = dict(first.settings)
    settings["runs"] = len(results)
    machine = dict(first.machine)
    speeds = [r.machine["host_speed_ns"] for r in results if r.machine.get("host_speed_ns")]
    if speeds:  # the rows' CPU times came from every run: the slowest host is the bound
        machine["host_speed_ns"] = {k: max(s[k] for s in speeds if k in s)
                                    for k in {k: None for s in speeds for k in s}}
    return BenchResult(rows=list(by_key.values()), machine=machine,
                       backends=list(backends.values()), settings=settings,
                       started=first.started,
                       elapsed_s=sum(r.elapsed_s for r in results),
                       not_run_cases=list(not_run.values()),
                       not_run_unnamed=sum(r.not_run_unnamed for r in results),
                       controller_rows=[q for r in results for q in r.controller_rows],
                       controller_not_run=sum(r.controller_not_run for r in results))


def _case(facts: dict[str, Any]) -> Case:
    return Case(parse_enum(Op, facts["op"], "op"), parse_enum(Kind, facts["kind"], "kind"),
                parse_enum(Layout, facts["layout"], "layout"), parse_dtype(facts["dtype"]),
                facts["page_size"], facts["batch_pages"], facts["total_pages"],
                facts["num_layers"], facts["element_dim"], facts.get("head_group_num", 1))


def _row(facts: dict[str, Any]) -> Row:
    case = _case(facts)
    ceiling = facts["ceiling"]
    return Row(case=case, backend=facts["backend"], backend_version=facts["backend_version"],
               variant=facts["variant"], status=facts["status"], reason=facts["reason"],
               timing=_timing(facts["timing"]),
               ceiling=_timing(ceiling), ceiling_kind=ceiling["copy"] if ceiling else None,
               speedup=facts["speedup"], host_slowdown=facts.get("host_slowdown"),
               attempts=facts.get("attempts", 1))


def _timing(facts: dict[str, Any] | None) -> Timing | None:
    if facts is None:
        return None
    samples = facts["samples_ms"]
    if not isinstance(samples, list) or not samples:
        raise ValueError(f"samples_ms must be a non-empty list, got {samples!r}")
    return Timing(tuple(_duration("samples_ms", x) for x in samples))


def _duration(field: str, value: object) -> float:
    """A time read from a file: a finite, non-negative number (NaN, inf, negative refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field} holds {value!r}, not a finite non-negative time")
    return float(value)
