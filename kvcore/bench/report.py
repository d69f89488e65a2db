"""Reports of a benchmark: a text table, a markdown document and JSON records."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from typing import Any

from kvcore.bench.row import OK, Row
from kvcore.bench.runner import BenchResult
from kvcore.bench.slowdown import (
    SLOWDOWN_TOLERANCE,
    SPREAD_TOLERANCE,
    Tolerances,
    worst_spread,
)
from kvcore.bench.timing import Timing

MIB = 2**20


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def time_ratio(row: Row) -> float | None:
    """The row's time over one contiguous copy of the same bytes (1 / ratio)."""
    if row.timing is None or row.ceiling is None or row.ceiling.median_ms <= 0:
        return None
    return row.timing.median_ms / row.ceiling.median_ms


def table_rows(rows: Sequence[Row], latency: bool = False) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the results table (``latency`` adds time / copy time)."""
    header = ["backend", "op", "kind", "layout", "dtype", "page", "batch", "layers",
              "elem_dim", "MiB", "ms", "spread%", "GiB/s", "ceil GiB/s", "ratio", "speedup"]
    if latency:
        header.append("x copy time")
    header.append("status")
    cells = []
    for r in rows:
        c = r.case
        t = r.timing
        layout = c.layout.value + (f" g{c.head_group_num}" if c.head_group_num > 1 else "")
        line = [r.backend, c.op.value, c.kind.value, layout,
                str(c.dtype).removeprefix("torch."), str(c.page_size), str(c.batch_pages),
                str(c.num_layers), str(c.element_dim), _num(c.bytes_moved / MIB, 3),
                _num(t.median_ms if t else None, 3), spread_cell(t),
                _num(r.gib_s), _num(r.ceiling_gib_s), _num(r.ratio),
                "-" if r.speedup is None else f"{r.speedup:.2f}x"]
        if latency:
            line.append(_num(time_ratio(r)))
        line.append(r.status)
        cells.append(line)
    return header, cells


#: a sample this many times the median is an outlier (a preemption, not the transfer)
OUTLIER = 2.0

#: the widest spread% a table shows as a number
SPREAD_SHOWN = 999


def outliers(t: Timing) -> int:
    """How many samples of ``t`` took more than OUTLIER times its median."""
    med = t.median_ms
    return sum(1 for x in t.samples_ms if med > 0 and x > OUTLIER * med)


def spread_cell(t: Timing | None) -> str:
    """spread% as the tables show it, readable however one sample went.

    On a shared CPU one timed call preempted for tens of milliseconds makes (max - min) /
    median run to thousands of percent. A row with exactly one outlier (OUTLIER x the median)
    shows the spread of its other samples with ``*`` (the footnote says so; the JSON keeps
    every sample); a spread still over SPREAD_SHOWN % reads ``>999``.
    """
    if t is None:
        return "-"
    spread, mark = t.spread_pct, ""
    if outliers(t) == 1 and len(t.samples_ms) >= 3:
        rest = sorted(t.samples_ms)[:-1]
        spread, mark = Timing(tuple(rest)).spread_pct, "*"
    text = f">{SPREAD_SHOWN}" if spread > SPREAD_SHOWN else f"{spread:.0f}"
    return text + mark


def spread_note(rows: Sequence[Row]) -> list[str]:
    """The footnote of the rows whose spread% leaves one outlier out (none: no line)."""
    flagged = sum(1 for r in rows if r.timing is not None and spread_cell(r.timing).endswith("*"))
    if not flagged:
        return []
    return [f"* spread% without the one sample over {OUTLIER:g}x the median in {flagged} row(s) "
            "(a call preempted by the host); the JSON keeps every sample"]


def failures(rows: Sequence[Row]) -> list[str]:
    """One line per row that was not timed, with the reason."""
    return [f"{r.backend} {' '.join(str(k) for k in r.case.key())}: {r.status}: {r.reason}"
            for r in rows if r.status != OK]


def header_lines(result: BenchResult) -> list[str]:
    """Machine and settings facts, one per line."""
    m, s = result.machine, result.settings
    accel = m.get("gpu") or "none"
    runtime = (f"CUDA {m['cuda']}" if m.get("cuda") else f"ROCm/HIP {m['hip']}" if m.get("hip")
               else "no GPU runtime")
    names = ", ".join(f"{b['name']} {b['version']}" for b in result.backends)
    return [
        f"device: {s.get('device')}  GPU: {accel}  driver: {m.get('driver') or '-'}  "
        f"{runtime}  torch {m.get('torch')}",
        f"CPU: {m.get('cpu')} ({m.get('cpu_count')} cores)  host memory: "
        f"{m.get('host_memory') or '-'} (pinned: {'yes' if m.get('pinned') else 'no'})",
        *host_speed_lines(m.get("host_speed_ns"), s.get("runs", 1)),
        f"backends: {names}  timer: {s.get('timer')}"
        + (" on a dedicated stream" if s.get("stream") == "dedicated" else "")
        + f", warm-up {s.get('warmup')}"
        + (" rounds over every index set" if s.get("warmup_per") == "index set" else "")
        + ", "
        f"repeat {s.get('repeat')} (median)"
        + (f", reference: repeat {s['reference_repeat']} from its oracle call, no warm-up"
           if s.get("reference_repeat") is not None else "")
        + f"  elapsed {result.elapsed_s:.1f} s",
        *([f"environment: {' '.join(f'{k}={v}' for k, v in s['environment'].items())}"]
          if s.get("environment") else []),
        *host_lines(result),
        *([f"INCOMPLETE: stopped early, {result.not_run} case(s) not run"]
          if result.not_run else []),
        *([f"INCOMPLETE: stopped early, {result.controller_not_run} controller queue(s) not "
           "run"] if result.controller_not_run else []),
    ]


def host_speed_lines(speed: dict[str, float] | None, runs: int = 1) -> list[str]:
    """The host's speed at the steps CPU times are made of (``host_speed_ns``), where known:
    CPU rows of two runs compare only beside it. Merged runs keep each step's slowest."""
    if not speed:
        return []
    names = {"python_call": "a Python call", "tensor_attributes": "3 tensor attributes",
             "sum_range_1000": "sum(range(1000))"}
    which = f" (the slowest of {runs} runs)" if runs > 1 else ""
    return [f"host speed{which}: "
            + ", ".join(f"{names.get(k, k)} "
                        + (f"{v / 1e3:.1f} us" if v >= 1e3 else f"{v:.0f} ns")
                        for k, v in speed.items())
            + " (CPU times follow these)"]


def host_lines(result: BenchResult) -> list[str]:
    """Where the run judged the host by its own measurements: the cases it re-timed, and
    those still disturbed on every attempt (see ``kvcore/bench/slowdown.py``)."""
    s = result.settings
    if not s.get("check_host"):
        return []
    slow_at = s.get("slowdown_tolerance", SLOWDOWN_TOLERANCE)
    spread_at = s.get("spread_tolerance", SPREAD_TOLERANCE)
    tolerances = Tolerances(slow_at, spread_at)
    retimed = {r.case.key() for r in result.rows if r.attempts > 1}
    by_case: dict[tuple[Any, ...], list[Row]] = {}
    for r in result.rows:
        by_case.setdefault(r.case.key(), []).append(r)
    disturbed = {key for key, rows in by_case.items()
                 if tolerances.exceeded(rows[0].host_slowdown or 0.0, worst_spread(rows))}
    if not retimed and not disturbed:
        return []
    return [f"host: {len(retimed)} case(s) re-timed because their contiguous copy ran more "
            f"than {slow_at:.0%} under the run's fastest or a row's samples spread more than "
            f"{spread_at:.0%}; {len(disturbed)} still did on every attempt (their rows may "
            "read low)"]


CONTROLLER_TITLE = ("Through the controller (what an engine calls: back-to-back write() + "
                    "poll_acks(), or load() + wait_layer() of every layer)")
KERNEL_TITLE = "Kernel path (one submit, indices placed in advance)"


def controller_section(result: BenchResult, heading: str = "") -> list[str]:
    """The queue rows as a markdown table under a title (nothing when there are none)."""
    if not result.controller_rows:
        return []
    from kvcore.bench.queue import markdown_rows

    return ["", f"{heading}{CONTROLLER_TITLE}", "", *markdown_rows(result.controller_rows),
            "", "ratio = one contiguous copy of a call's bytes / wall time per call over the "
            "whole queue; CPU us/call = median time inside write() or load() in that queue; "
            "device idle = the same with each call made once the one before completed; "
            "caller busy = those CPU times (with wait_layer) in the fastest queue over its "
            "wall time per call: near 100% the queue is CPU-bound, and its ratio follows the "
            "host's speed; host ns/Python call = the host's speed timed just before the row's "
            "queues (the CPU times follow it)"]


def text_table(result: BenchResult, latency: bool = False) -> str:
    """The header, an aligned table and the reasons of untimed rows."""
    header, cells = table_rows(result.rows, latency)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    numeric = set(range(5, len(header) - 1))

    def fmt(cols: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cols, widths, strict=True))).rstrip()

    lines = [*header_lines(result), *controller_section(result)]
    if cells:
        if result.controller_rows:
            lines += ["", KERNEL_TITLE]
        lines += ["", fmt(header), fmt(["-" * w for w in widths])]
        lines += [fmt(c) for c in cells]
    fails = failures(result.rows)
    if fails:
        lines += ["", "not timed:", *(f"  {f}" for f in fails)]
    lines += ["", "ratio = achieved GiB/s / ceiling GiB/s (one contiguous copy of the same "
                  "bytes); speedup = reference time / backend time", *spread_note(result.rows)]
    return "\n".join(lines)


def markdown(result: BenchResult, command: str, latency: bool = False) -> str:
    """A markdown document: the command line, the header and the table."""
    header, cells = table_rows(result.rows, latency)
    out = ["# kvio bench", "", "```", command, "```", ""]
    out += [f"- {line}" for line in header_lines(result)]
    out += controller_section(result, "## ")
    if cells:
        if result.controller_rows:
            out += ["", f"## {KERNEL_TITLE}"]
        out += ["", "| " + " | ".join(header) + " |",
                "|" + "|".join("---" if i < 5 else "---:" for i in range(len(header))) + "|"]
        out += ["| " + " | ".join(c) + " |" for c in cells]
    fails = failures(result.rows)
    if fails:
        out += ["", "Not timed:", "", *(f"- {f}" for f in fails)]
    out += ["", "ratio = achieved GiB/s / ceiling GiB/s (one contiguous copy of the same bytes "
                "between the same memories); speedup = reference time / backend time.",
            *(["", *spread_note(result.rows)] if spread_note(result.rows) else []), ""]
    return "\n".join(out)


def to_json(result: BenchResult, command: str) -> str:
    """The full records (validated by ``kvcore/schemas/bench.schema.json``)."""
    facts: dict[str, Any] = {**result.facts(), "command": command}
    return json.dumps(facts, indent=2)


def to_json_lines(result: BenchResult, command: str) -> str:
    """The records of :func:`to_json` as JSON lines: the document without its rows on the
    first line, then one compact line per row (``kvio bench --merge`` reads both)."""
    facts: dict[str, Any] = {**result.facts(), "command": command}
    rows = facts.pop("rows")
    return "\n".join(json.dumps(obj, separators=(",", ":")) for obj in (facts, *rows)) + "\n"


def json_bytes(result: BenchResult, command: str, path: str) -> bytes:
    """The ``--json`` file for ``path``, in the form its name asks for: ``.jsonl`` JSON lines,
    ``.json`` one indented document, either with ``.gz`` gzip-compressed (reproducibly)."""
    name = path.removesuffix(".gz")
    text = (to_json_lines(result, command) if name.endswith(".jsonl")
            else to_json(result, command) + "\n")
    data = text.encode("utf-8")
    return gzip.compress(data, mtime=0) if path.endswith(".gz") else data


def schema() -> dict[str, Any]:
    """The JSON schema of :func:`to_json`'s output, shipped as package data."""
    from importlib import resources

    text = resources.files("kvcore").joinpath("schemas/bench.schema.json").read_text("utf-8")
    return json.loads(text)
