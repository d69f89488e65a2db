"""``kvio replay``: a synthetic multi-turn workload through the controller, checksummed.

Exits 0 when the run had no errors (checksum mismatches or failed transfers), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvcore.cli.common import (
    check_fits,
    check_output_path,
    check_time_limit,
    parse_device,
    require_backend,
    sigterm_interrupts,
)
from kvcore.controller import WritePolicy
from kvcore.errors import InvalidArgument
from kvcore.layout import Kind, Layout
from kvcore.registry import default_registry
from kvcore.replay import ReplayConfig, ReplayStats, WorkloadConfig, run_replay


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "replay", help="replay a prefix-reusing multi-turn workload and check every page",
        description="Drive the controller with sessions that share system prompts and grow "
                    "turn by turn, many in flight at once. Pages are keyed by a chained hash; "
                    "both pools are small enough to evict; every page loaded back is checked "
                    "on the device against the checksum recorded when it was written. Exits "
                    "1 if any error occurred.")
    p.add_argument("--device", default=None,
                   help="torch device (default: the accelerator if there is one, else cpu)")
    p.add_argument("--backend", default=None, help="force a backend, as KVCORE_BACKEND does")
    p.add_argument("--write-policy", default=WritePolicy.WRITE_THROUGH.value,
                   choices=[w.value for w in WritePolicy])
    bounds = p.add_argument_group("bounds (the first reached stops the run; checked between "
                                  "waves of --concurrency requests, so a run may pass one by "
                                  "up to a wave; Ctrl-C or SIGTERM stops it too, and the "
                                  "report says so)")
    bounds.add_argument("--min-transfers", type=int, default=10_000,
                        help="stop once this many pages were written plus loaded "
                             "(default 10000; 0 for no bound)")
    bounds.add_argument("--max-requests", type=int, default=None)
    bounds.add_argument("--time-limit", type=float, default=None, metavar="SECONDS")
    geo = p.add_argument_group("geometry")
    geo.add_argument("--kind", default="mha", choices=[k.value for k in Kind])
    geo.add_argument("--layout", default="page_first", choices=[lay.value for lay in Layout])
    geo.add_argument("--layers", type=int, default=4)
    geo.add_argument("--heads", type=int, default=None,
                     help="heads per token (MHA; default 4); MLA has one latent vector")
    geo.add_argument("--head-dim", type=int, default=64)
    geo.add_argument("--page-size", type=int, default=16)
    geo.add_argument("--dtype", default="bfloat16")
    geo.add_argument("--device-pages", type=int, default=None,
                     help="device pool pages (default: 5/4 of what one wave can pin)")
    geo.add_argument("--host-pages", type=int, default=None,
                     help="host pool pages (default: 3x the device pool)")
    wl = p.add_argument_group("workload")
    wl.add_argument("--concurrency", type=int, default=32, help="requests per wave")
    wl.add_argument("--sessions", type=int, default=256, help="live sessions")
    wl.add_argument("--prompts", type=int, default=4, help="shared system prompts")
    wl.add_argument("--prompt-pages", type=int, default=8)
    wl.add_argument("--max-turns", type=int, default=8)
    wl.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--log", type=Path, default=None, metavar="FILE",
                     help="also write the JSON result to FILE")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


#: options that take a positive integer where given (0 would run something else or nothing)
POSITIVE = ("--layers", "--heads", "--head-dim", "--device-pages",
            "--host-pages", "--concurrency", "--sessions", "--prompts", "--prompt-pages",
            "--max-turns", "--max-requests")


#: the replay's parameter names and the options that set them
OPTION_OF = {"live_sessions": "--sessions", "concurrency": "--concurrency",
             "system_prompts": "--prompts", "prompt_pages": "--prompt-pages",
             "max_turns": "--max-turns", "device_pages": "--device-pages",
             "host_pages": "--host-pages", "page_size": "--page-size"}


def _as_options(exc: InvalidArgument) -> InvalidArgument:
    """``exc`` naming the command line's options instead of the parameters they set (the
    page size keeps its name: its errors say --page-size themselves)."""
    if exc.argument == "page_size" or exc.argument not in OPTION_OF:
        return exc
    expected = exc.expected
    for name, option in OPTION_OF.items():
        expected = expected.replace(name, option)
    return InvalidArgument(OPTION_OF[exc.argument], expected, exc.got, exc.context)


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    """The :class:`ReplayConfig` the command line describes."""
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument("--dtype", "a torch dtype name", repr(args.dtype))
    if args.page_size < 1:
        raise InvalidArgument("page_size", "a positive number of tokens per page (--page-size)",
                              str(args.page_size))
    if args.min_transfers < 0:
        raise InvalidArgument("--min-transfers", "0 (no bound) or a positive count",
                              str(args.min_transfers))
    check_time_limit(args.time_limit)
    if args.backend is not None:
        require_backend(default_registry(), args.backend, "--backend")
    if args.kind == "mla" and args.heads not in (None, 1):
        raise InvalidArgument("--heads", "1 or unset for --kind mla (one latent vector per "
                              "token; --head-dim sets its size)", str(args.heads))
    for option in POSITIVE:
        value = getattr(args, option.removeprefix("--").replace("-", "_"))
        if value is not None and value < 1:
            raise InvalidArgument(option, "a positive integer", str(value))
    workload = WorkloadConfig(system_prompts=args.prompts, prompt_pages=args.prompt_pages,
                              live_sessions=args.sessions, concurrency=args.concurrency,
                              max_turns=args.max_turns, seed=args.seed)
    return ReplayConfig(
        workload=workload, kind=Kind(args.kind), layout=Layout(args.layout),
        num_layers=args.layers, head_num=1 if args.kind == "mla" else args.heads or 4,
        head_dim=args.head_dim, page_size=args.page_size, dtype=dtype,
        device=str(parse_device(args.device)),
        device_pages=args.device_pages, host_pages=args.host_pages,
        write_policy=WritePolicy(args.write_policy), backend=args.backend,
        min_transfers=args.min_transfers or None, max_requests=args.max_requests,
        time_limit_s=args.time_limit)


@contextlib.contextmanager
def _progress_bar(cfg: ReplayConfig, enabled: bool,
                  ) -> Iterator[Callable[[ReplayStats], None] | None]:
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # rich is the optional "progress" extra
        enabled = False
    if not enabled:
        yield None
        return
    total = cfg.min_transfers
    with Progress(TextColumn("replay"), BarColumn(), TextColumn("{task.completed} transfers"),
                  TextColumn("{task.fields[errors]} errors"), TimeElapsedColumn(),
                  transient=True, console=None) as bar:
        task = bar.add_task("replay", total=total, errors=0)

        def update(s: ReplayStats) -> None:
            bar.update(task, completed=s.transfers, errors=s.errors)

        yield update


def _check_memory(cfg: ReplayConfig) -> None:
    """Refuse, before anything is allocated, pools that cannot fit in memory."""
    dev_pages, host_pages = cfg.sizes()
    kv = 2 if cfg.kind is Kind.MHA else 1
    page = kv * cfg.num_layers * cfg.page_size * cfg.head_num * cfg.head_dim * cfg.dtype.itemsize
    device, cpu = torch.device(cfg.device), torch.device("cpu")
    if device.type == "cpu":
        needs = {cpu: (dev_pages + host_pages) * page}
    else:
        needs = {device: dev_pages * page, cpu: host_pages * page}
    check_fits("--host-pages/--device-pages", f"{dev_pages} device and {host_pages} host "
               f"pages of {page} B", needs)


def run(args: argparse.Namespace) -> int:
    check_output_path("--log", args.log)
    try:
        cfg = config_from_args(args)
        cfg.sizes()
    except InvalidArgument as exc:
        raise _as_options(exc) from None
    _check_memory(cfg)
    with (_progress_bar(cfg, not args.no_progress and sys.stderr.isatty()) as progress,
          sigterm_interrupts()):
        stats = run_replay(cfg, progress=progress)
    facts = stats.as_dict()
    if args.log is not None:
        args.log.write_text(json.dumps(facts, indent=2) + "\n")
    print(json.dumps(facts, indent=2) if args.json else stats.table())
    return 1 if stats.errors else 0
