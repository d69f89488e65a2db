"""``kvio backends``: what is installed, what can run here, and how a request resolves."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from kvcore.capabilities import Unavailable
from kvcore.cli.common import parse_device, require_backend
from kvcore.errors import NO_PLUGIN_HINT, REFERENCE_HINT, InvalidArgument
from kvcore.layout import Kind, Layout, Op
from kvcore.plan import dtype_name
from kvcore.registry import (
    ENTRY_POINT_GROUP,
    Registry,
    default_registry,
    make_request,
    undeclared_plugins,
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("backends", help="list backends, their availability and capabilities",
                       description="List every discovered backend and why it is or is not "
                                   "available; --explain shows how one request resolves.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--explain", action="store_true",
                   help="resolve one request (--op/--kind/--layout/...) and say why each "
                        "other candidate lost")
    p.add_argument("--op", default="write_back", choices=[o.value for o in Op])
    p.add_argument("--kind", default="mha", choices=[k.value for k in Kind])
    p.add_argument("--layout", default="page_first", choices=[lay.value for lay in Layout])
    p.add_argument("--dtype", default="bfloat16", help="torch dtype name (default bfloat16)")
    p.add_argument("--element-bytes", type=int, default=1024)
    p.add_argument("--device", default=None,
                   help="torch device (default: the accelerator if there is one, else cpu)")
    p.add_argument("--backend", default=None, help="force a backend, as KVCORE_BACKEND does")
    return p


def backend_facts(registry: Registry) -> list[dict[str, Any]]:
    """One JSON-able record per backend (and per broken plugin)."""
    out = []
    for rec in registry.backends():
        caps = rec.spec.capabilities
        avail = registry.availability(rec.name)
        ops = []
        for s in caps.ops:
            ops.append({
                "op": s.op.value, "variant": s.variant,
                "kinds": sorted(k.value for k in s.kinds),
                "layouts": sorted(lay.value for lay in s.layouts),
                "host_index": {"residency": s.host_index.residency.value,
                               "dtypes": [dtype_name(d) for d in s.host_index.dtypes]},
                "device_index": {"residency": s.device_index.residency.value,
                                 "dtypes": [dtype_name(d) for d in s.device_index.dtypes]},
                "dtypes": None if s.dtypes is None else sorted(dtype_name(d) for d in s.dtypes),
                "element_alignment": s.element_alignment, "staged": s.staged,
                "staging_bytes": s.staging_bytes, "batched_memcpy": s.batched_memcpy,
                "contiguous_pages": s.contiguous_pages, "layer_signals": s.layer_signals,
                "page_window": [s.min_page_bytes, s.max_page_bytes],
            })
        out.append({
            "name": rec.name, "version": caps.version, "api_version": caps.api_version,
            "platform": caps.platform, "priority": caps.priority, "source": rec.source,
            "distribution": rec.distribution,
            "available": bool(avail),
            "reason": avail.reason if isinstance(avail, Unavailable) else avail.detail,
            "host_memory": caps.host_memory.value,
            "device_types": sorted(caps.device_types) if caps.device_types else None,
            "ops": ops,
        })
    for b in registry.broken():
        out.append({"name": b.name, "distribution": b.distribution, "available": False,
                    "reason": b.reason, "broken": True, "ops": []})
    for r in registry.refused():
        out.append({"name": r.name, "distribution": r.distribution, "available": False,
                    "reason": r.reason, "refused": True, "ops": []})
    return out


def _table(facts: list[dict[str, Any]]) -> str:
    lines = []
    for f in facts:
        if f.get("refused"):
            lines.append(f"{f['name']} from {f['distribution'] or 'an unknown distribution'} "
                         f"REFUSED (not imported)")
            lines.append(f"    why: {f['reason']}")
            continue
        state = "available" if f["available"] else "UNAVAILABLE"
        head = f"{f['name']} {f.get('version', '?')} [{f.get('platform', '?')}, " \
               f"priority {f.get('priority', '-')}] {state}"
        lines.append(head)
        if f["reason"]:
            lines.append(f"    {'why' if not f['available'] else 'info'}: {f['reason']}")
        for op in f["ops"]:
            lay = ", ".join(op["layouts"])
            lines.append(
                f"    {op['op']:<10} {op['variant']:<8} {'/'.join(op['kinds']):<8} {lay}")
            lines.append(
                f"               host idx {op['host_index']['residency']}, device idx "
                f"{op['device_index']['residency']}, align {op['element_alignment']} B"
                + (f", dtypes {'/'.join(op['dtypes'])}" if op.get("dtypes") else "")
                + (f", staging {op['staging_bytes'] >> 20} MiB" if op["staged"] else "")
                + (", all layers in one job, a signal per layer"
                   if op.get("layer_signals") else "")
                + _window(*op["page_window"]))
    return "\n".join(lines)


def _window(low: int, high: int | None) -> str:
    """``, pages >= 64 KiB`` and the like: which page sizes a variant serves ('' for all)."""
    def size(n: int) -> str:
        return f"{n >> 20} MiB" if n % (1 << 20) == 0 else (
            f"{n >> 10} KiB" if n % (1 << 10) == 0 else f"{n} B")

    if high is None:
        return f", pages >= {size(low)}" if low else ""
    return f", pages {size(low)} to < {size(high)}" if low else f", pages < {size(high)}"


def run(args: argparse.Namespace) -> int:
    registry = default_registry()
    if args.explain:
        if args.backend is not None:
            require_backend(registry, args.backend, "--backend")
        return _explain(args, registry)
    ignored = [f"--{name.replace('_', '-')}" for name, default in EXPLAIN_DEFAULTS
               if getattr(args, name) != default]
    if ignored:  # they describe a request: without --explain they would be dropped unsaid
        raise InvalidArgument(ignored[0], "--explain with it (it describes the request to "
                              "explain)", " ".join(ignored))
    facts = backend_facts(registry)
    print(json.dumps(facts, indent=2) if args.json else _table(facts))
    for unseen in undeclared_plugins():  # (a misspelt entry-point group hides a plugin)
        print(f"kvio backends: {unseen} looks like a kvcore plugin but declares no "
              f"{ENTRY_POINT_GROUP!r} entry point, so it is not listed", file=sys.stderr)
    if not facts:  # kvcore without any plugin: say what to install
        print(f"kvio backends: no backend is installed: {NO_PLUGIN_HINT}", file=sys.stderr)
        return 1
    if not any(f["available"] for f in facts):  # e.g. kvio-cuda alone on a machine without
        print("kvio backends: none of the installed backends can run on this machine; "
              f"{REFERENCE_HINT}", file=sys.stderr)
        return 1
    return 0


#: the options of a request --explain resolves, with their defaults
EXPLAIN_DEFAULTS = (("op", "write_back"), ("kind", "mha"), ("layout", "page_first"),
                    ("dtype", "bfloat16"), ("element_bytes", 1024), ("device", None),
                    ("backend", None))


def _explain(args: argparse.Namespace, registry: Registry) -> int:
    # what would be chosen for a device this machine may not have (asked from a CPU box about
    # a GPU one): resolution reads the capabilities and availability, never the device
    device = parse_device(args.device, must_exist=False)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument("--dtype", "a torch dtype name such as bfloat16", repr(args.dtype))
    req = make_request(args.op, args.kind, args.layout, dtype, args.element_bytes, device)
    res = registry.explain(req, args.backend)
    result = {
        "request": str(req),
        "chosen": res.chosen.name if res.chosen else None,
        "variants": [v.variant for v in res.variants],
        "candidates_in_order": list(res.order),
        "refused": res.reasons,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if res.chosen else 1
    print(f"request: {req}")
    print(f"chosen:  {result['chosen'] or 'none'}"
          + (f" (variants: {', '.join(v.variant for v in res.variants)})" if res.chosen
             else ""))
    for name, why in res.reasons.items():
        print(f"  {name}: {why}")
    return 0 if res.chosen else 1
