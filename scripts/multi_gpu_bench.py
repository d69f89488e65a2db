#!/usr/bin/env python
"""Write-back and per-layer load on N GPUs at once, against each GPU alone, in one run.

Starts one process per GPU (NCCL, with NCCL_NVLS_ENABLE=0), builds a HiCacheController per
rank with the best available backend (verified against the reference at construction) and
checks that every rank resolved the same plans. Then, per operation and per contiguous copy
(the ceiling):

* alone: each rank in turn, the others idle;
* all at once: every rank after a barrier.

Each measurement is one span of ``--repeat`` back-to-back calls after ``--warmup`` calls
(device events on a GPU, wall clock on the CPU). Aggregate GiB/s = bytes moved by all ranks /
the slowest rank's span; its ratio is to N x the contiguous memcpy ceiling, i.e. the sum of
every GPU's ceiling measured alone in this run. Without an accelerator it runs with gloo and
the reference backend on the CPU and says that its figures are not GPU figures.

    python scripts/multi_gpu_bench.py --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvcore.bench.machine import machine_facts
from kvcore.bench.runner import Call, index_sets
from kvcore.bench.sweep import Case, parse_dtype
from kvcore.bench.timing import Clock, gib_per_s
from kvcore.controller import HiCacheController
from kvcore.layout import Kind, Layout, Op, parse_enum
from kvcore.pools import DevicePool
from kvcore.registry import REFERENCE, allocate_host_pool
from kvcore.streams import has_streams
from kvcore.verify import random_fill

OPS = (Op.WRITE_BACK, Op.LOAD_LAYER)
COPIES = {"d2h copy": "d2h", "h2d copy": "h2d"}  # the ceiling of write-back and of loads
CPU_NOTE = ("CPU-only run (gloo, reference backend): host memcpy figures, NOT GPU figures")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=None,
                   help="ranks (default: every GPU; 1 without an accelerator)")
    p.add_argument("--backend", default=None, help="force a kvcore backend by name")
    p.add_argument("--kind", default="mha", choices=[k.value for k in Kind])
    p.add_argument("--layout", default="page_first", choices=[x.value for x in Layout])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=64, help="pages per call")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--element-dim", type=int, default=1024,
                   help="elements per token per layer of K (MHA: heads x 128)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--agreement-timeout-s", type=float, default=120.0)
    p.add_argument("--json", metavar="FILE", help="write the full results as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write a markdown report")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \
        else None
    available = torch.accelerator.device_count() if accelerator is not None else 0
    nprocs = args.nprocs or max(1, available)
    if accelerator is not None and nprocs > available:
        print(f"--nprocs {nprocs}: only {available} {accelerator.type} devices", file=sys.stderr)
        return 2
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    command = shlex.join([os.path.basename(sys.executable), *sys.argv])
    device_type = accelerator.type if accelerator is not None else "cpu"
    mp.spawn(rank_main, args=(nprocs, device_type, _free_port(), args, command),
             nprocs=nprocs, join=True)
    return 0


def rank_main(rank: int, world: int, device_type: str, port: int, args: argparse.Namespace,
              command: str) -> None:
    """One rank: build, agree, measure alone and together; rank 0 reports."""
    device = torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")
    if device_type != "cpu":
        torch.accelerator.set_device_index(rank)
    dist.init_process_group(dist.get_default_backend_for_device(device),
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=10))
    control = dist.new_group(backend="gloo")  # barriers and gathers stay off the GPU
    try:
        report = measure_rank(rank, world, device, args, control)
        if rank == 0:
            emit(report, args, command)
    finally:
        dist.destroy_process_group()


def measure_rank(rank: int, world: int, device: torch.device, args: argparse.Namespace,
                 control: Any) -> dict[str, Any]:
    cases = {op: Case(op, parse_enum(Kind, args.kind, "kind"),  # type: ignore[arg-type]
                      parse_enum(Layout, args.layout, "layout"),  # type: ignore[arg-type]
                      parse_dtype(args.dtype), args.page_size, args.pages, 2 * args.pages,
                      args.layers, args.element_dim) for op in OPS}
    case = cases[Op.WRITE_BACK]
    nbytes = case.bytes_moved
    dev = DevicePool.allocate(case.kind, case.num_layers, case.pool_tokens, case.head_num,
                              case.head_dim, case.dtype, device, case.page_size)
    host = allocate_host_pool(case.kind, case.layout, case.num_layers, case.pool_tokens,
                             case.head_num, case.head_dim, case.dtype, case.page_size, device,
                             backend=args.backend)
    gen = torch.Generator().manual_seed(rank)
    for t in (*dev.all_buffers(), host.buffer):
        random_fill(t, gen)
    ctl = HiCacheController(dev, host, backend=args.backend, verify=True,
                            process_group=dist.group.WORLD,
                            agreement_timeout_s=args.agreement_timeout_s)
    sets = index_sets(case, gen, device)
    calls: dict[str, Callable[[int], object]] = {}
    for op in OPS:
        call = Call(ctl.plan(op), (dev, host), sets, cases[op])
        call.check_and_run(0)
        calls[op.value] = call
    allocate = ctl.registry.instance(REFERENCE, device).allocate_host  # type: ignore[attr-defined]
    calls.update(contiguous_copies(nbytes, device, allocate))

    alone: dict[str, list[float]] = {name: [] for name in calls}
    for turn in range(world):
        for name, call in calls.items():
            ms = span_ms(call, device, args) if rank == turn else None
            alone[name].append(_gather(ms, control)[turn])  # the others wait here
    together = {name: _gather(span_ms(call, device, args, lambda: dist.barrier(group=control)),
                              control) for name, call in calls.items()}
    round_trip(ctl, dev, sets)
    return {
        "world": world, "bytes_per_rank_call": nbytes, "case": case.facts(),
        "plans": {op.value: ctl.plan(op).describe() for op in OPS},
        "host_memory": host.memory.value,
        "machine": machine_facts(device, host.memory.value),
        "timer": Clock(device, 0, 1).kind, "cpu_only": not has_streams(device),
        "alone_ms": alone, "together_ms": together,
    }


def round_trip(ctl: HiCacheController, dev: DevicePool,
               sets: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write pages back through the controller, await the agreed ack, load them elsewhere."""
    (_, source), (_, target) = sets[0], sets[1]
    ack = ctl.write(source)
    acked = ctl.wait_acks()  # all-reduce MIN over the group
    if [a.id for a in acked] != [ack.id]:
        raise RuntimeError(f"expected the ack of write {ack.id}, got {acked}")
    ctl.load(ack.host_indices, target).wait()
    ctl.free_host(ack.host_indices)
    for i, t in enumerate(dev.all_buffers()):
        if not torch.equal(t[target].view(torch.uint8), t[source].view(torch.uint8)):
            raise RuntimeError(f"round trip through the controller changed device buffer {i}")


def contiguous_copies(nbytes: int, device: torch.device,
                      allocate: Callable[..., tuple[torch.Tensor, object]],
                      ) -> dict[str, Callable[[int], object]]:
    """The ceiling calls: one contiguous copy of ``nbytes`` each way, host memory pinned."""
    host = allocate((nbytes,), torch.uint8)[0]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    asynchronous = has_streams(device)
    return {"d2h copy": lambda i: host.copy_(dev, non_blocking=asynchronous),
            "h2d copy": lambda i: dev.copy_(host, non_blocking=asynchronous)}


def span_ms(call: Callable[[int], object], device: torch.device, args: argparse.Namespace,
            before: Callable[[], object] = lambda: None) -> float:
    """Mean ms per call over one span of ``repeat`` calls, after warm-up and ``before()``."""
    clock = Clock(device, 0, 1)
    for i in range(args.warmup):
        call(i)
    clock.synchronize()
    before()
    timing = clock.measure(lambda _: [call(args.warmup + i) for i in range(args.repeat)])
    return timing.median_ms / args.repeat


def _gather(value: float | None, control: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(out, value, group=control)
    return out


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per operation or copy: per-rank and aggregate GiB/s and the ceiling ratio."""
    n, nbytes = report["world"], report["bytes_per_rank_call"]
    rows = []
    for name, together in report["together_ms"].items():
        direction = COPIES.get(name, "d2h" if name == Op.WRITE_BACK.value else "h2d")
        ceiling_label = next(k for k, v in COPIES.items() if v == direction)
        ceilings = [gib_per_s(nbytes, ms) for ms in report["alone_ms"][ceiling_label]]
        aggregate = gib_per_s(n * nbytes, max(together))
        rows.append({
            "what": name, "direction": direction,
            "alone_gib_s": [gib_per_s(nbytes, ms) for ms in report["alone_ms"][name]],
            "together_gib_s": [gib_per_s(nbytes, ms) for ms in together],
            "aggregate_gib_s": aggregate, "n_x_ceiling_gib_s": sum(ceilings),
            "ratio": aggregate / sum(ceilings) if sum(ceilings) > 0 else 0.0,
        })
    return rows


def table(report: dict[str, Any], rows: list[dict[str, Any]], command: str) -> list[str]:
    """Markdown lines: header facts, then one table row per operation or copy."""
    m, case, n = report["machine"], report["case"], report["world"]
    names = {p["backend"] for p in report["plans"].values()}
    backends = ", ".join(sorted({f"{p['backend']} {p['backend_version']}"
                                 for p in report["plans"].values()}))
    verified = ("the reference itself" if names == {REFERENCE} else
                "verified against the reference at construction")
    gpu = f"{m['gpu']} x {n}" if m.get("gpu") else "none (CPU only)"
    lines = [f"# multi-GPU bench: {n} rank{'s' if n > 1 else ''}", "", "```", command, "```", ""]
    if report["cpu_only"]:
        lines += [f"**{CPU_NOTE}**", ""]
    lines += [
        f"- GPU: {gpu}, driver {m.get('driver') or '-'}, "
        f"CUDA {m.get('cuda') or '-'}, HIP {m.get('hip') or '-'}, torch {m.get('torch')}",
        f"- CPU: {m.get('cpu')} ({m.get('cpu_count')} cores), host memory "
        f"{report['host_memory']}",
        f"- backend: {backends} ({verified}); plans agreed on every rank; a write-back, "
        "its agreed ack and a load round trip through the controller checked on every rank",
        f"- shape: {case['kind']}/{case['layout']} {case['dtype']}, page {case['page_size']}, "
        f"{case['batch_pages']} pages per call, {case['num_layers']} layers, element_dim "
        f"{case['element_dim']}: {report['bytes_per_rank_call'] / 2**20:.3g} MiB per call "
        "per rank",
        f"- timer: {report['timer']}, warm-up {report['warmup']}, one span of "
        f"{report['repeat']} calls (mean)",
        "",
        "| what | alone GiB/s per rank | all at once GiB/s per rank | aggregate GiB/s | "
        "N x ceiling GiB/s | aggregate / (N x ceiling) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['what']} | {_nums(r['alone_gib_s'])} | {_nums(r['together_gib_s'])} "
                     f"| {r['aggregate_gib_s']:.2f} | {r['n_x_ceiling_gib_s']:.2f} "
                     f"| {r['ratio']:.3f} |")
    lines += ["", "ceiling = one contiguous copy of the same bytes in the same direction (d2h "
                  "for write_back, h2d for load_layer; host memory pinned on a GPU), each rank "
                  "alone; N x ceiling = the sum of those; aggregate = bytes of all ranks / the "
                  "slowest rank's time.", ""]
    return lines


def emit(report: dict[str, Any], args: argparse.Namespace, command: str) -> None:
    report = {**report, "warmup": args.warmup, "repeat": args.repeat, "command": command,
              "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    rows = summarize(report)
    text = "\n".join(table(report, rows, command))
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**report, "rows": rows}, f, indent=2)


def _nums(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
