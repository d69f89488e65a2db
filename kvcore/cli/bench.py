"""``kvio bench``: measure every backend side by side against the contiguous-copy ceiling."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvcore.bench import queue, report
from kvcore.bench.runner import Bench, BenchResult
from kvcore.bench.sweep import PRESETS, Case, expand, override
from kvcore.cli.common import (
    check_fits,
    check_output_path,
    check_time_limit,
    parse_device,
    require_backend,
    sigterm_interrupts,
)
from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout, layouts_for, parse_enum
from kvcore.plan import dtype_name
from kvcore.registry import REFERENCE, Registry, default_registry
from kvcore.streams import has_streams

#: option -> Sweep field it overrides
AXES = {"op": "ops", "kind": "kinds", "layout": "layouts", "dtype": "dtypes",
        "page_size": "page_sizes", "batch_pages": "batch_pages", "total_pages": "total_pages",
        "num_layers": "num_layers", "element_dim": "element_dims",
        "head_group_num": "head_group_nums"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="measure transfer throughput of every backend against a memcpy ceiling",
        description="Check each backend against the reference on random data, then time it "
                    "(warm-up, repetitions, median) and compare with one contiguous copy of "
                    "the same bytes between the same memories. Axis options take repeated "
                    "values or comma lists and replace the preset's values.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="default: small and quick; seed: the seed table; single-page: latency "
                        "of one 64-token page against one copy")
    p.add_argument("--backend", action="append", default=None,
                   help="backend to measure (repeatable; default: every available backend)")
    for opt in AXES:
        p.add_argument(f"--{opt.replace('_', '-')}", dest=opt, action="append", default=None,
                       metavar="V[,V...]")
    p.add_argument("--device", default=None,
                   help="torch device (default: the accelerator if there is one, else cpu)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds per row, each calling every index set once (default 2)")
    p.add_argument("--repeat", type=int, default=7, help="timed calls per row (default 7)")
    p.add_argument("--reference-repeat", type=int, default=None, metavar="N",
                   help="timed calls of the reference's own rows, the first of them the oracle "
                        "call every backend is checked against, without warm-up (default: as "
                        "--repeat); the reference is slow on a GPU and only compared with")
    p.add_argument("--retime", type=int, default=2, metavar="N",
                   help="on an accelerator, run a case again at the end, up to N times, when "
                        "its contiguous copy ran more than 3%% under the run's fastest or a "
                        "row's samples spread more than 5%% (a disturbed host); an undisturbed "
                        "attempt is kept, else the one with the fastest copy (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random data and indices")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no new case after SECONDS; the report then says how many "
                        "cases were not run (SIGTERM and Ctrl-C stop the same way)")
    p.add_argument("--json", metavar="FILE",
                   help="write full records as JSON ('-': stdout); FILE.jsonl writes one line "
                        "per row, FILE.jsonl.gz (or .json.gz) compresses it")
    p.add_argument("--markdown", metavar="FILE", help="write the table as markdown")
    p.add_argument("--plot", metavar="FILE.png", help="plot GiB/s and ratio (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.add_argument("--through", choices=("both", "controller", "kernel"), default="both",
                   help="controller: queues of HiCacheController calls, the path an engine "
                        "calls (write + acks, load + wait_layer of every layer; host layout "
                        "from --layout, default page_first); kernel: one submit per row with "
                        "indices placed in advance, the preset's table; both (default)")
    p.add_argument("--queue-pages", default=None, metavar="N[,N...]",
                   help="pages per controller call (default 1,4,16,64 on an accelerator, "
                        "1,4 on the CPU)")
    p.add_argument("--merge", nargs="+", metavar="FILE.json", default=None,
                   help="measure nothing: join the rows of earlier --json files (runs of one "
                        "sweep on one machine, in any --json form: .json, .jsonl, .gz; a case "
                        "several runs measured keeps the later file's row) and write the "
                        "reports from them; options that choose what to measure are refused")
    return p


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


#: the options that say what to measure, with their defaults (a merge measures nothing)
MEASURE_DEFAULTS = (("device", None), ("warmup", 2), ("repeat", 7), ("reference_repeat", None),
                    ("retime", 2), ("seed", 0), ("time_limit", None), ("through", "both"),
                    ("queue_pages", None))
OUTPUT_DEFAULTS = (("json", None), ("markdown", None), ("plot", None))


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run: every option that differs from its default."""
    words = ["kvio", "bench", "--preset", args.preset]
    for opt in ("backend", *AXES):
        for value in _split(getattr(args, opt)) or []:
            words += [f"--{opt.replace('_', '-')}", value]
    for opt, default in (*MEASURE_DEFAULTS, *OUTPUT_DEFAULTS):
        value = getattr(args, opt)
        if value != default:
            words += [f"--{opt.replace('_', '-')}", str(value)]
    if args.quiet:
        words.append("--quiet")
    return " ".join(shlex.quote(w) for w in words)


#: what a sweep's or a bench's own checks call a value -> the option that sets it
OPTION_OF = {**{name: f"--{opt.replace('_', '-')}" for opt, field in AXES.items()
                for name in (opt, field)},
             **{name: f"--{name.replace('_', '-')}" for name in
                ("warmup", "repeat", "reference_repeat", "retime", "seed")}}


def run(args: argparse.Namespace) -> int:
    """``kvio bench``; a refused value names the option that set it."""
    try:
        return _run(args)
    except InvalidArgument as exc:
        option = OPTION_OF.get(exc.argument)
        if option is None:
            raise
        raise InvalidArgument(option, exc.expected, exc.got, exc.context) from None


def _run(args: argparse.Namespace) -> int:
    for option in ("json", "markdown", "plot"):  # before the sweep, not after it
        check_output_path(f"--{option}", getattr(args, option))
    if args.plot:
        from kvcore.bench.plot import require_matplotlib

        require_matplotlib()
    if args.merge:
        return _merge(args)
    check_time_limit(args.time_limit)
    cases = _cases(args) if args.through != "controller" else []
    device = parse_device(args.device)
    registry = default_registry()
    for name in _split(args.backend) or []:
        require_backend(registry, name, "--backend")
        available = registry.availability(name)
        if not available:
            raise InvalidArgument("--backend", "a backend available on this machine",
                                  f"{name!r}: {available.reason}")  # type: ignore[union-attr]
    if not args.backend:  # measured without them, and said so
        for broken in registry.broken():
            print(f"kvio bench: {broken.reason}; not measured", file=sys.stderr)
    bench = Bench(registry=registry, device=device, cases=cases,
                  backends=_split(args.backend), warmup=args.warmup, repeat=args.repeat,
                  seed=args.seed, settings={"preset": args.preset},
                  time_limit_s=args.time_limit, reference_repeat=args.reference_repeat,
                  retime=args.retime)
    names = bench.backend_names()
    _check_memory(cases, names, device)
    total = len(cases) * len(names)
    quiet = args.quiet or args.json == "-"
    mode = "off" if quiet else "bar" if sys.stdout.isatty() else "lines"
    queues = _queue_cases(args, device) if args.through != "kernel" else []
    total += len(queues) * len(bench.backend_names())
    start = time.perf_counter()
    with progress(total, mode) as advance, sigterm_interrupts():
        result = bench.run(advance)
        planned = len(queues) * len(names)
        if queues and not result.not_run:
            rows: list[queue.QueueRow] = []
            limit = args.time_limit

            def out_of_time() -> bool:
                return limit is not None and time.perf_counter() - start > limit

            try:  # interrupted or out of time, the queues measured so far are reported
                queue.run_all(bench.registry, device, names, queues, args.warmup,
                              max(3, args.repeat // 2), args.seed, advance, rows, out_of_time)
            except KeyboardInterrupt:
                pass
            result.controller_rows = rows
            _account_for_queues(result, bench.registry, names, start)
        result.controller_not_run = planned - len(result.controller_rows)
    if result.not_run:
        print(f"kvio bench: stopped early, {result.not_run} of {len(cases)} cases not run",
              file=sys.stderr)
    if result.controller_not_run:
        print(f"kvio bench: stopped early, {result.controller_not_run} of {planned} controller "
              "queues not run", file=sys.stderr)
    _report(args, result, command_line(args))
    return _exit_code(result)


def _account_for_queues(result: BenchResult, registry: Registry, names: list[str],
                        start: float) -> None:
    """The run's facts with its controller queues: the elapsed time includes them, and where no
    kernel case allocated a host pool, the host memory is the one the queues' pools have
    (what each backend declares; allocate_host_pool refuses a pool that is not)."""
    result.elapsed_s = time.perf_counter() - start
    if result.machine.get("host_memory") is None and names:
        memory = registry.get(names[0]).spec.capabilities.host_memory.value
        result.machine = {**result.machine, "host_memory": memory,
                          "pinned": memory == "pinned"}


def _queue_cases(args: argparse.Namespace, device: torch.device) -> list[queue.QueueCase]:
    on_gpu = has_streams(device)
    pages = (_positive_ints("--queue-pages", args.queue_pages) if args.queue_pages
             else (1, 4, 16, 64) if on_gpu else (1, 4))
    kinds = tuple(parse_enum(Kind, k, "kind") for k in _split(args.kind) or ("mha", "mla"))
    layouts = tuple(parse_enum(Layout, v, "layout")
                    for v in _split(args.layout) or ("page_first",))
    check_layouts_exist(kinds, layouts)
    budget = (1 << 30) if on_gpu else (8 << 20)
    layers = _split(args.num_layers)
    return queue.queue_cases(pages, kinds, layouts, budget,
                             num_layers=int(layers[0]) if layers else 32 if on_gpu else 8)


def _positive_ints(option: str, value: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, else InvalidArgument naming ``option``."""
    words = _split([value]) or []
    try:
        numbers = tuple(int(w) for w in words)
    except ValueError:
        numbers = ()
    if not numbers or min(numbers) < 1:
        raise InvalidArgument(option, "positive integers, comma-separated", repr(value))
    return numbers


def _check_memory(cases: list[Case], names: list[str], device: torch.device) -> None:
    """Refuse, before anything is allocated, a sweep whose largest geometry cannot fit: the
    initial and expected pools, and one pool pair per other backend, each a device pool and
    a host pool (a lower bound: staging and the ceiling's buffers come on top)."""
    if not cases:
        return
    pairs = 2 + sum(1 for n in names if n != REFERENCE)
    case = max(cases, key=lambda c: c.kv_count * c.num_layers * c.pool_tokens * c.element_bytes)
    pool = case.kv_count * case.num_layers * case.pool_tokens * case.element_bytes
    cpu = torch.device("cpu")
    needs = {cpu: 2 * pairs * pool} if device.type == "cpu" else {device: pairs * pool,
                                                                  cpu: pairs * pool}
    what = (f"{case.kind.value} {case.num_layers} layers x {case.total_pages} pages of "
            f"{case.page_size} x {case.element_dim} {dtype_name(case.dtype)}, {pairs} pool pairs")
    check_fits("--total-pages", what, needs)


def _cases(args: argparse.Namespace) -> list[Case]:
    sweep = override(PRESETS[args.preset],
                     **{field: _split(getattr(args, opt)) for opt, field in AXES.items()})
    if args.layout:  # (a preset's layouts may include some that not every kind has)
        check_layouts_exist(sweep.kinds, sweep.layouts)
    cases = expand(sweep)
    if not cases:
        raise InvalidArgument(
            "--head-group-num", "a head group count some layout asked for takes with these "
                                "elements (kvcore.layout.head_group_options)",
            f"{', '.join(map(str, sweep.head_group_nums))}: no case is left")
    return cases


def check_layouts_exist(kinds: Sequence[Kind], layouts: Sequence[Layout]) -> None:
    """Refuse a layout asked for that exists for none of the kinds asked for (its rows would
    be left out without a word, or fail)."""
    for layout in layouts:
        if not any(layout in layouts_for(kind) for kind in kinds):
            asked = ", ".join(k.value for k in kinds)
            has = ", ".join(k.value for k in Kind if layout in layouts_for(k))
            raise InvalidArgument("--layout", f"layouts that exist for {asked}",
                                  f"{layout.value} (for {has} only)")


def _name_not_run(result: BenchResult, command: str) -> None:
    """For a file written before runs listed the cases they did not reach: name them from
    its command (the cases of that sweep without a row), where there are exactly as many as
    it counted."""
    if not result.not_run_unnamed:
        return
    words = shlex.split(command)
    parser = argparse.ArgumentParser(prog="kvio", add_help=False)
    add_parser(parser.add_subparsers())
    try:
        args = parser.parse_args(words[1:])
    except SystemExit:  # not a command this version can read: the count stays unnamed
        return
    measured = {row.case.key() for row in result.rows}
    missing = [c for c in _cases(args) if c.key() not in measured]
    if len(missing) == result.not_run_unnamed:
        result.not_run_cases, result.not_run_unnamed = missing, 0


def _merge(args: argparse.Namespace) -> int:
    from kvcore.bench import merge

    measuring = [f"--{opt.replace('_', '-')}" for opt in ("backend", *AXES)
                 if getattr(args, opt)]
    measuring += [f"--{opt.replace('_', '-')}" for opt, default in MEASURE_DEFAULTS
                  if getattr(args, opt) != default]
    if args.preset != "default":
        measuring.append("--preset")
    if measuring:  # it would be ignored: the merged runs say what they measured
        raise InvalidArgument("--merge", "no option that chooses what to measure (a merge "
                              "reports the runs as they ran; filter them with --json and jq)",
                              " ".join(measuring))
    seen: dict[Path, str] = {}
    for path in args.merge:
        key = Path(path).resolve()
        if key in seen:
            raise InvalidArgument("--merge", "each file once", f"{path} (as {seen[key]})")
        seen[key] = path
    for option in ("json", "markdown", "plot"):  # (an input written over is lost)
        out = getattr(args, option)
        if out not in (None, "-") and Path(out).resolve() in seen:
            raise InvalidArgument(f"--{option}", "a file that is not one of the --merge inputs",
                                  repr(out))
    loaded = [merge.load(path) for path in args.merge]
    runs: dict[tuple[str, str], str] = {}
    for path, (result, command) in zip(args.merge, loaded, strict=True):
        key2 = (result.started, command)
        if key2 in runs:
            raise InvalidArgument("--merge", "each run once", f"{path}: the run of {runs[key2]} "
                                  f"(started {result.started}) again")
        runs[key2] = path
        _name_not_run(result, command)
    result = merge.merge([r for r, _ in loaded])
    header = "kvio bench --merge " + " ".join(shlex.quote(p) for p in args.merge)
    _report(args, result, "\n".join([header, *(cmd for _, cmd in loaded)]))
    return _exit_code(result)


def _exit_code(result: BenchResult) -> int:
    """1 when a row failed its check, a controller queue failed, or cases (or controller
    queues) were not run, else 0."""
    return 1 if (result.not_run or result.controller_not_run
                 or any(r.status == "failed" for r in result.rows)
                 or any(r.error is not None for r in result.controller_rows)) else 0


def _report(args: argparse.Namespace, result: BenchResult, cmd: str) -> None:
    """Print the table and write the --json / --markdown / --plot files."""
    json_to_stdout = args.json == "-"
    latency = args.preset == "single-page"
    if not args.quiet and not json_to_stdout:
        print(report.text_table(result, latency))
    if json_to_stdout:
        print(report.to_json(result, cmd))
    elif args.json:
        with open(args.json, "wb") as f:
            f.write(report.json_bytes(result, cmd, args.json))
    if args.markdown:
        _write(args.markdown, report.markdown(result, cmd, latency))
    if args.plot:
        from kvcore.bench.plot import plot

        plot(result, args.plot)




def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@contextlib.contextmanager
def progress(total: int, mode: str) -> Iterator[Callable[[str], None] | None]:
    """Yields advance(label) or None. ``mode``: ``bar`` (rich, else tqdm, for a terminal),
    ``lines`` (one line per row on stderr with the elapsed time, for logs) or ``off``."""
    if mode == "off":
        yield None
        return
    if mode == "lines":
        t0, done = time.perf_counter(), 0

        def line(label: str) -> None:
            nonlocal done
            done += 1
            print(f"[{done:>{len(str(total))}}/{total} {time.perf_counter() - t0:7.1f} s] {label}",
                  file=sys.stderr, flush=True)

        yield line
        return
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    except ImportError:
        rich_progress = None
    else:
        rich_progress = Progress(TextColumn("{task.description:<48}"), BarColumn(),
                                 MofNCompleteColumn(), transient=True)
    if rich_progress is not None:
        with rich_progress as bar:
            task = bar.add_task("kvio bench", total=total)
            yield lambda label: bar.update(task, advance=1, description=label)
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    with tqdm(total=total, leave=False) as bar:

        def advance(label: str) -> None:
            bar.set_description(label)
            bar.update(1)

        yield advance
