#!/usr/bin/env python3
"""kvcore-sglang's hook bodies on a GPU, on pools laid out exactly as SGLang 0.5.23 lays them,
against kvcore's reference backend. Runs WITHOUT sglang (no network needed).

    KVCORE_PYTHON_ENV=system scripts/install.sh          # kvcore, kvio_cuda, kvcore-sglang
    python3 scripts/gpu_sglang_check.py [--out DIR]      # DIR defaults to $OUT, else ./out
    scripts/gpu_run.sh setup sglang                      # the same, inside the GPU run

What it builds, replicated from SGLang 0.5.23's source (no sglang import):

* device pools as ``MHATokenToKVPool._create_buffers_normal`` makes them: per layer one
  ``(2, ceil(size + page, page), H, D)`` allocation whose halves ``[0, :rows]`` / ``[1, :rows]``
  are the K and V buffers (rows = size + page_size: page 0 is the padding page), and
  ``MLATokenToKVPool``'s ``(size + page, 1, kv_lora_rank + rope_dim)`` buffer per layer; the
  uint64 pointer tables ``k_data_ptrs``/``v_data_ptrs``/``data_ptrs`` on the device;
* host pools as ``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost.init_kv_buffer`` shape them
  (``page_num = size // page + 1`` pages), with their per-layer views and pointer tables
  (``make_kernel_ptr_table``);
* the indices where SGLang's HiCacheController puts them for ``io_backend='kernel'``
  (``move_indices``): both on the device, except the page_first write-back, whose host indices
  SGLang keeps on the CPU (``_move_write_operation``, staged JIT write-back).

Each case runs the hook bodies (``kvcore_sglang.hooks``), which resolve kvio_cuda through
kvcore's registry, on a new (non-default) stream that stands in for SGLang's transfer
streams, under ``torch.cuda.set_sync_debug_mode("error")``; then the same transfer runs on
copies of the pools through kvcore's reference backend, and the whole host buffer and every
device buffer must be equal byte for byte. Destinations are poisoned with random bytes first.
A case that synchronised is reported as such (with the message) and re-run without the sync
check, so its bytes are still compared. Host memory registered with cudaHostRegister, as
SGLang's default allocator makes it, is a decline case: SGLang's original method must run.

Writes ``gpu_sglang_check.log`` and ``gpu_sglang_check.json`` to the output folder; exit
status 1 if any case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
try:
    import kvcore_sglang  # noqa: F401
except ImportError:  # run from a checkout without the integration installed
    sys.path.insert(0, str(ROOT / "integrations" / "kvcore_sglang"))

from kvcore_sglang import hooks  # noqa: E402

from kvcore import Kind, Op  # noqa: E402
from kvcore.registry import default_registry, make_request  # noqa: E402

REGISTERED_ATTR = hooks.SGLANG_REGISTERED_RANGES_ATTR


# -- SGLang 0.5.23's pools, replicated -----------------------------------------------------------


def ceil_align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def host_tokens(device_size: int, page: int, ratio: float = 2.0) -> tuple[int, int]:
    """HostKVCache.__init__: size = device tokens * ratio; one padding page more."""
    page_num = int(device_size * ratio) // page + 1
    return page_num * page, page_num


def alloc_host(dims: tuple[int, ...], dtype: torch.dtype, memory: str) -> torch.Tensor:
    """'pinned': torch's pinned allocator; 'registered': SGLang's alloc_with_host_register
    (pageable memory, then cudaHostRegister, the ranges recorded on the tensor)."""
    if memory == "plain":  # --cpu-dry-run only
        return torch.empty(dims, dtype=dtype)
    if memory == "pinned":
        return torch.empty(dims, dtype=dtype, pin_memory=True)
    # page-aligned pageable memory, as SGLang's mmap allocator hands out
    nbytes = math.prod(dims) * dtype.itemsize
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    buf = raw[skip:skip + nbytes].view(dtype).view(dims)
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")
    setattr(buf, REGISTERED_ATTR, [(buf.data_ptr(), nbytes)])
    return buf


def unregister(buf: torch.Tensor) -> None:
    for ptr, _ in getattr(buf, REGISTERED_ATTR, None) or []:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def ptr_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """make_kernel_ptr_table / the device pools' data_ptrs: uint64 on the device."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


class _Pool:
    """Attributes only (hashable by identity, as SGLang's pool objects are)."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class MHATokenToKVPoolHost(_Pool):
    """The attributes of SGLang's MHATokenToKVPoolHost that the hooks read, same shapes."""


class MLATokenToKVPoolHost(_Pool):
    """The attributes of SGLang's MLATokenToKVPoolHost that the hooks read, same shapes."""


def mha_pools(layout: str, dtype: torch.dtype, page: int, layers: int, heads: int, dim: int,
              device_pages: int, memory: str, device: torch.device) -> MHATokenToKVPoolHost:
    size = device_pages * page
    rows = size + page
    fused = [torch.zeros((2, ceil_align(rows, page), heads, dim), dtype=dtype, device=device)
             for _ in range(layers)]
    k = tuple(b[0, :rows] for b in fused)
    v = tuple(b[1, :rows] for b in fused)
    hsize, page_num = host_tokens(size, page)
    dims = {"layer_first": (2, layers, hsize, heads, dim),
            "page_first": (2, hsize, layers, heads, dim)}[layout]
    kv_buffer = alloc_host(dims, dtype, memory)
    if layout == "page_first":
        k_refs = [kv_buffer[0].transpose(0, 1)[i] for i in range(layers)]
        v_refs = [kv_buffer[1].transpose(0, 1)[i] for i in range(layers)]
    else:
        k_refs = [kv_buffer[0][i] for i in range(layers)]
        v_refs = [kv_buffer[1][i] for i in range(layers)]
    info = SimpleNamespace(scales=None, transfer_buffers=None,
                           buffers=SimpleNamespace(layout=SimpleNamespace(value="nhd")))
    return MHATokenToKVPoolHost(
        layout=layout, page_size=page, page_num=page_num, size=hsize, layer_num=layers,
        target_layer_num=layers, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=dtype,
        dcp_size=1, device_rows_packed=True, kv_buffer=kv_buffer, _buffer_infos=(info,),
        device_k_buffers=k, device_v_buffers=v, device_k_data_ptrs=ptr_table(list(k), device),
        device_v_data_ptrs=ptr_table(list(v), device), k_data_ptrs=ptr_table(k_refs, device),
        v_data_ptrs=ptr_table(v_refs, device), token_stride_size=heads * dim * dtype.itemsize)


def mla_pools(layout: str, dtype: torch.dtype, page: int, layers: int, kv_dim: int,
              device_pages: int, memory: str, device: torch.device) -> MLATokenToKVPoolHost:
    size = device_pages * page
    kv = tuple(torch.zeros((size + page, 1, kv_dim), dtype=dtype, device=device)
               for _ in range(layers))
    hsize, page_num = host_tokens(size, page)
    dims = {"layer_first": (layers, hsize, 1, kv_dim),
            "page_first": (hsize, layers, 1, kv_dim)}[layout]
    kv_buffer = alloc_host(dims, dtype, memory)
    refs = ([kv_buffer.transpose(0, 1)[i] for i in range(layers)] if layout == "page_first"
            else [kv_buffer[i] for i in range(layers)])
    return MLATokenToKVPoolHost(
        layout=layout, page_size=page, page_num=page_num, size=hsize, layer_num=layers,
        target_layer_num=layers, kv_cache_dim=kv_dim, dtype=dtype, dcp_size=1,
        device_rows_packed=True, kv_buffer=kv_buffer, _native_buffers=None,
        _layer_shard_enabled=False, _target_layer_indices=tuple(range(layers)),
        _device_layer_num=layers, _is_dummy=False, device_kv_buffers=kv,
        device_data_ptrs=ptr_table(list(kv), device), data_ptrs=ptr_table(refs, device),
        token_stride_size=kv_dim * dtype.itemsize)


def device_layers(host: Any) -> list[torch.Tensor]:
    if isinstance(host, MHATokenToKVPoolHost):
        return [*host.device_k_buffers, *host.device_v_buffers]
    return list(host.device_kv_buffers)


def poison(tensors: list[torch.Tensor], gen: torch.Generator) -> None:
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def tokens(pages: torch.Tensor, page: int) -> torch.Tensor:
    return (pages[:, None] * page + torch.arange(page)).flatten()


# -- one case -------------------------------------------------------------------------------


def never_original(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("SGLang's original method ran for a pool kvcore routes")


def run_hooks(host: Any, kind: Kind, hi_wb: torch.Tensor, di_wb: torch.Tensor,
              hi_ld: torch.Tensor, di_ld: torch.Tensor, stream: Any, sync_debug: bool,
              original: Any = never_original) -> None:
    """What L2TransferEngine does: the write-back, then one load call per layer, all on
    SGLang's stream."""
    on_gpu = stream is not None  # else --cpu-dry-run: no streams, no sync check
    if on_gpu:
        torch.cuda.set_sync_debug_mode("error" if sync_debug else "default")
    try:
        with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
            hooks.backup_from_device_all_layer(original, kind, host, None, hi_wb, di_wb,
                                               "kernel")
            for layer in range(host.layer_num):
                hooks.load_to_device_per_layer(original, kind, host, None, hi_ld, di_ld, layer,
                                               "kernel")
    finally:
        if on_gpu:
            torch.cuda.set_sync_debug_mode("default")


def reference_pair(host: Any, kind: Kind):
    """Copies of the pools and the reference backend's plans for them."""
    from kvcore import DevicePool, HostPool

    dev_copy = [t.clone() for t in device_layers(host)]
    L = host.layer_num
    if kind is Kind.MHA:
        dp = DevicePool.wrap(kind, dev_copy[:L], dev_copy[L:], page_size=host.page_size)
        heads, dim = host.head_num, host.head_dim
    else:
        dp = DevicePool.wrap(kind, dev_copy, page_size=host.page_size)
        heads, dim = 1, host.kv_cache_dim
    hp = HostPool.wrap(host.kv_buffer.clone(), kind, host.layout, num_layers=L, head_num=heads,
                       head_dim=dim, page_size=host.page_size)
    plans = {}
    for op in (Op.WRITE_BACK, Op.LOAD_LAYER):
        req = make_request(op, kind, host.layout, host.dtype, dp.element_bytes, dp.device)
        plans[op] = default_registry().resolve(req, "reference")
    return dp, hp, plans


def run_case(case: dict[str, Any], device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    kind = Kind(case["kind"])
    if kind is Kind.MHA:
        host = mha_pools(case["layout"], case["dtype"], case["page"], case["layers"],
                         case["heads"], case["dim"], case["device_pages"], case["memory"], device)
    else:
        host = mla_pools(case["layout"], case["dtype"], case["page"], case["layers"],
                         case["dim"], case["device_pages"], case["memory"], device)
    page, n = case["page"], case["batch_pages"]
    dev_pages = device_layers(host)[0].shape[0] // page
    di_wb = tokens(torch.randperm(dev_pages - 1, generator=gen)[:n] + 1, page)
    hi = tokens(torch.randperm(host.page_num, generator=gen)[:n], page)
    di_ld = tokens(torch.randperm(dev_pages - 1, generator=gen)[:n] + 1, page)
    # where SGLang's controller puts them for io_backend 'kernel'
    hi_wb = hi if case["layout"] == "page_first" else hi.to(device)
    hi_ld = hi.to(device)
    di_wb, di_ld = di_wb.to(device), di_ld.to(device)
    result: dict[str, Any] = {k: (str(v).removeprefix("torch.") if k == "dtype" else v)
                              for k, v in case.items()}
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    if case["memory"] == "registered":
        calls: list[str] = []
        hooks.route_for(host, kind)  # the one-time decision, outside the sync check
        run_hooks(host, kind, hi_wb, di_wb, hi_ld, di_ld, stream, True,
                  original=lambda *a, **k: calls.append("original"))
        route = hooks.route_for(host, kind)
        result.update(expect="decline", original_calls=len(calls),
                      reason=getattr(route, "reason", None),
                      ok=isinstance(route, hooks.Decline) and len(calls) == 1 + host.layer_num)
        unregister(host.kv_buffer)
        return result

    # the one-time decision per pool (builds kvcore's pools and pointer tables: a host to
    # device copy, so it is made before the sync check, as a server makes it on its first
    # transfer); SGLang's pointer tables must address the very tensors kvcore wraps
    route = hooks.route_for(host, kind)
    if isinstance(route, hooks.Decline):
        result.update(ok=False, error=f"declined: {route.reason}")
        return result
    if kind is Kind.MHA:
        same = (torch.equal(route.device_pool.k_ptrs.cpu(), host.device_k_data_ptrs.cpu())
                and torch.equal(route.device_pool.v_ptrs.cpu(), host.device_v_data_ptrs.cpu()))
    else:
        same = torch.equal(route.device_pool.k_ptrs.cpu(), host.device_data_ptrs.cpu())
    result["backends"] = {op.value: p.backend_name for op, p in route.plans.items()}
    result["variants"] = {op.value: p.select(p.page_bytes(page, host.layer_num)).variant
                          for op, p in route.plans.items()}
    result["pointer_tables_match"] = same

    # warm-up, as a server's first batch: builds the backend, its library and staging
    run_hooks(host, kind, hi_wb, di_wb, hi_ld, di_ld, stream, False)
    sync(stream)
    poison(device_layers(host), gen)
    poison([host.kv_buffer], gen)
    sync(stream)
    dp, hp, ref_plans = reference_pair(host, kind)
    try:
        t0 = time.perf_counter()
        run_hooks(host, kind, hi_wb, di_wb, hi_ld, di_ld, stream, True)
        result["submit_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        result["synchronised"] = None
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        result["synchronised"] = str(exc).splitlines()[0]
        sync(stream)
        poison(device_layers(host), gen)
        poison([host.kv_buffer], gen)
        sync(stream)
        dp, hp, ref_plans = reference_pair(host, kind)
        run_hooks(host, kind, hi_wb, di_wb, hi_ld, di_ld, stream, False)
    sync(stream)
    ref_plans[Op.WRITE_BACK].transfer(dp, hp, hi, di_wb.cpu())
    for layer in range(host.layer_num):
        ref_plans[Op.LOAD_LAYER].transfer(dp, hp, hi, di_ld.cpu(), layer=layer)
    sync(stream)
    host_ok = torch.equal(host.kv_buffer.view(torch.uint8), hp.buffer.view(torch.uint8))
    dev_ok = all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                 for a, b in zip(device_layers(host), dp.all_buffers(), strict=True))
    result.update(host_equal=host_ok, device_equal=dev_ok)
    want = {"cuda"} if device.type == "cuda" else {"reference"}
    result["ok"] = bool(host_ok and dev_ok and same and result["synchronised"] is None
                        and set(result["backends"].values()) == want)
    return result


def sync(stream: Any) -> None:
    if stream is not None:
        stream.synchronize()
        torch.cuda.synchronize()


def cases(dry_run: bool = False) -> list[dict[str, Any]]:
    memory = "plain" if dry_run else "pinned"
    out = []
    for kind, heads, dim in (("mha", 8, 128), ("mla", 1, 576)):
        for layout in ("layer_first", "page_first"):
            for dtype in (torch.bfloat16, torch.float16):
                for page in (16, 64):
                    out.append(dict(kind=kind, layout=layout, dtype=dtype, page=page, layers=8,
                                    heads=heads, dim=dim, device_pages=64, batch_pages=24,
                                    memory=memory))
        if dry_run:
            continue
        out.append(dict(kind=kind, layout="page_first", dtype=torch.bfloat16, page=64, layers=8,
                        heads=heads, dim=dim, device_pages=16, batch_pages=4,
                        memory="registered"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="exercise this script on the CPU (reference against reference)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_sglang_check.log"
    lines: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    if args.cpu_dry_run:
        device = torch.device("cpu")
        name = "CPU dry run (reference against reference)"
    elif not torch.cuda.is_available():
        say("no CUDA device; this check runs on a GPU (or pass --cpu-dry-run)")
        log_path.write_text("\n".join(lines) + "\n")
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
    say(f"gpu_sglang_check: {name}, torch {torch.__version__}, "
        f"python {platform.python_version()}")
    try:
        import sglang  # noqa: F401

        say("note: sglang is importable here; this check does not use it")
    except ImportError:
        say("sglang: not installed (as intended)")
    for rec in default_registry().backends():
        avail = default_registry().availability(rec.name)
        say(f"backend {rec.name}: priority {rec.spec.capabilities.priority}, "
            f"{'available' if avail else 'unavailable: ' + avail.reason}")
    gen = torch.Generator().manual_seed(20261204)
    results = []
    for case in cases(args.cpu_dry_run):
        hooks.reset()
        try:
            r = run_case(case, device, gen)
        except Exception as exc:  # noqa: BLE001 - reported per case
            r = {k: (str(v).removeprefix("torch.") if k == "dtype" else v)
                 for k, v in case.items()}
            r.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc())
        results.append(r)
        label = (f"{r['kind']}/{r['layout']} {r['dtype']} page {r['page']} "
                 f"{r['memory']} host memory")
        if r.get("expect") == "decline":
            detail = f"declined ({r.get('reason')}), original ran {r['original_calls']}x"
        elif "error" in r:
            detail = r["error"]
        else:
            detail = (f"backends {r['backends']}, variants {r['variants']}, host "
                      f"{'==' if r['host_equal'] else '!='} reference, device "
                      f"{'==' if r['device_equal'] else '!='} reference, pointer tables "
                      f"{'match' if r['pointer_tables_match'] else 'DIFFER'}, "
                      + (f"SYNCHRONISED: {r['synchronised']}" if r["synchronised"]
                         else f"no sync, {r['submit_ms']} ms to submit"))
        say(f"{'PASS' if r['ok'] else 'FAIL'} {label}: {detail}")
    failed = [r for r in results if not r["ok"]]
    say(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    log_path.write_text("\n".join(lines) + "\n")
    (out / "gpu_sglang_check.json").write_text(json.dumps(results, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
