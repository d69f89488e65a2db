"""Whether small write-backs of contiguous host pages should skip the staging hop: the same
queues of controller ``write()`` calls (kvio bench's controller rows, page_first) as shipped
(``shipped``: under DIRECT_WRITE_BACK_MAX_BYTES the direct kernel, above it the staged
variant), with every write-back ``staged`` (a device gather, then copies of whole pages), with
the ``direct`` kernel forced (one kernel storing into pinned host memory, the host indices in
its launch), with every staged write-back ``handed`` to the library's thread
(``kvio_write_back_staged_async`` from the first byte: the caller pays the checks and the
handover, the thread the runtime calls), with the direct kernel ``narrow`` (under 4 MiB, as
before d7e5d21: one MHA page staged), as shipped but with the direct kernel ``fenced`` by
kvcore (torch events around kvio_transfer_direct_inline) instead of ordered by the library
(kvio_transfer_direct_after), and as shipped but with the caller's stream looked up on every
call (``lookup``: torch's stream object built each time, as before 754a0cc). Rows for
page_first and layer_first (whose write-back is always the direct kernel).
h100-2026-12-07 ran ``wide`` (8 MiB, now shipped) against a 4 MiB ``shipped``.

h200-2026-12-05: an MLA write of 1 page (2.25 MiB) ran at 0.78-0.82 of the ceiling and 4 pages
at 0.91, under issue 21's 0.85 / 0.93; MHA (8 MiB a page) at 0.905-0.915 / 0.95.

    python scripts/probe_write_variant.py      # on a CUDA machine; prints a markdown table
"""

from __future__ import annotations

import importlib
import sys

import attrs
import torch

CASES = [(layout, kind, pages) for layout in ("page_first", "layer_first")
         for kind in ("mla", "mha") for pages in (1, 4, 16)]


def force_direct() -> None:
    """kvio_cuda's capabilities without the staged write-back (the direct one takes over)."""
    import kvio_cuda

    from kvcore.layout import Op

    ops = tuple(o for o in kvio_cuda.CAPABILITIES.ops
                if not (o.op is Op.WRITE_BACK and o.variant == "staged"))
    kvio_cuda.CAPABILITIES = attrs.evolve(kvio_cuda.CAPABILITIES, ops=ops)


def main() -> None:
    import kvio_cuda  # noqa: F401  (reloaded between variants)

    import kvcore.controller
    import kvcore.native
    import kvcore.native_abi
    from kvcore.bench.ceiling import Ceiling
    from kvcore.bench.queue import QueueCase, run_queue
    from kvcore.bench.timing import Clock
    from kvcore.layout import Kind, Layout
    from kvcore.registry import REFERENCE, default_registry, reset_default_registry
    from kvcore.streams import CurrentStream

    shipped_min = kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES
    shipped_direct = kvcore.native.DIRECT_WRITE_BACK_MAX_BYTES
    variants = sys.argv[1:] or ["shipped", "fenced", "lookup", "narrow", "staged"] * 2
    print("| variant | layout | kind | pages | MiB | ratio | ms/call | ceiling ms | CPU us |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    shipped_after = kvcore.native_abi.DIRECT_AFTER_FUNCTIONS
    for variant in variants:
        importlib.reload(sys.modules["kvio_cuda"])  # the shipped capabilities again
        kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES = 1 if variant == "handed" else shipped_min
        kvcore.native.DIRECT_WRITE_BACK_MAX_BYTES = {
            "shipped": shipped_direct, "fenced": shipped_direct, "lookup": shipped_direct,
            "narrow": (4 << 20) - 1}.get(variant, 0)
        kvcore.native_abi.DIRECT_AFTER_FUNCTIONS = (
            shipped_after | {"(none: fenced by kvcore)"} if variant == "fenced"
            else shipped_after)
        kvcore.controller.CurrentStream = (  # type: ignore[misc]
            (lambda device, handle: CurrentStream(device, None)) if variant == "lookup"
            else CurrentStream)
        if variant == "direct":
            force_direct()
        reset_default_registry()
        registry = default_registry()
        device = torch.device("cuda")
        clock = Clock(device, 1, 5)
        ceiling = Ceiling(clock, registry.instance(REFERENCE, device).allocate_host)  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(5)
        for layout, kind, pages in CASES:
            one = QueueCase("write", Kind(kind), Layout(layout), pages, 1)
            case = attrs.evolve(one, calls=max(4, min(128, (2 << 30) // one.bytes_per_call)))
            row = run_queue(case, "cuda", registry, device, ceiling, 5, gen)
            if row.error:
                print(f"| {variant} | {layout} | {kind} | {pages} | - | {row.error} | | | |",
                      flush=True)
                continue
            print(f"| {variant} | {layout} | {kind} | {pages} | {one.bytes_per_call / 2**20:.2f} | "
                  f"{row.ratio:.3f} | {row.ms_per_call:.4f} | {row.ceiling_ms:.4f} | "
                  f"{row.cpu_us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
