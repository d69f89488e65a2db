"""Which part of the signaled load's end of layer costs its 3% (h200-2026-12-05: every
signaled seed row -3.0% since h200-2026-12-04; the flags' location ruled out).

Builds the kernel library once per variant of the end of layer, from patched copies of
csrc/kvio_cuda.cu, and times the same signaled submit of every layer with each (one process
per library; shapes and timing as scripts/probe_signaled_flags.py):

- ``shipped``: flags raised in layer order through the cursor, SC fences, acquire loads, a
  memset of the counters before each launch (main);
- ``acq_rel fences``: the SC fences of the publication made acquire-release;
- ``relaxed``: acquire-release fences and relaxed loads of the counts and cursor;
- ``per-layer flags``: each layer's completer raises its own flag and zeroes its own counter
  (h200-2026-12-04: no order, no cursor, no memset);
- ``per-layer flags, memset``: the same with the memset before each launch;
- ``in order, kernel reset``: e550bef's publication (one look per layer, the last raiser
  zeroes the cursor), no memset.

Only ``shipped`` is correct under every interleaving (the others are timing experiments).
The edits match csrc/kvio_cuda.cu as of commit 02df8bc (run the probe in a checkout of it);
h200-2026-12-05b holds its result, which made main raise the flags per group instead.

    python scripts/probe_signaled_publish.py      # on a CUDA machine; prints a markdown table
"""

# ruff: noqa: B023  (each closure is called inside its loop turn)
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PUBLISH = ("            publish_in_order(sig, static_cast<uint32_t>(num_layers), "
           "counts_per_layer);\n")
PER_LAYER = """            fence_acq_rel_gpu();
            sig.counters[layer] = 0;
            asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(sig.flags + layer),
                         "r"(sig.epoch) : "memory");
"""
NO_MEMSET = ("    KVIO_CHECK(cudaMemsetAsync(counters, 0, (size_t(num_layers) + 1) * "
             "sizeof(uint32_t), s));\n", "")
SC = ('asm volatile("fence.sc.gpu;"', 'asm volatile("fence.acq_rel.gpu;"')
ACQUIRE = ("ld.acquire.gpu.global.u32", "ld.relaxed.gpu.global.u32")
SECOND_LOOK = ("""        if (load_acquire_gpu(sig.counters + c) != counts_per_layer) {
            fence_sc_gpu();  // the cursor this call moved before the last look at layer c
            if (load_acquire_gpu(sig.counters + c) != counts_per_layer) {
                break;  // layer c is not in yet: whoever completes it goes on from here
            }
        }
""", """        if (load_acquire_gpu(sig.counters + c) != counts_per_layer) {
            break;
        }
""")
KERNEL_RESET = ("        ++c;\n    }\n}\n",
                "        if (++c == num_layers) {\n            atomicExch(cursor, 0u);\n        }\n"
                "    }\n}\n")

VARIANTS: dict[str, list[tuple[str, str]]] = {
    "shipped": [],
    "acq_rel fences": [SC],
    "relaxed": [SC, ACQUIRE],
    "per-layer flags": [(PUBLISH, PER_LAYER), NO_MEMSET],
    "per-layer flags, memset": [(PUBLISH, PER_LAYER)],
    "in order, kernel reset": [SECOND_LOOK, KERNEL_RESET, NO_MEMSET],
}
ORDER = ["shipped", "acq_rel fences", "relaxed", "per-layer flags", "per-layer flags, memset",
         "in order, kernel reset", "shipped"]


def patched(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"probe out of date: {old!r} occurs {source.count(old)} times")
        source = source.replace(old, new)
    return source


def build(name: str, edits: list[tuple[str, str]], work: Path) -> Path:
    import torch
    from kvio_cuda import build as kb

    major, minor = torch.cuda.get_device_capability()
    nvcc = kb.find_nvcc()
    slug = name.replace(" ", "_").replace(",", "")
    source = work / f"{slug}.cu"
    source.write_text(patched(kb.SOURCE.read_text(), edits))
    out = work / f"lib_{slug}.so"
    cmd = kb.compile_command(nvcc.path, source, out, major, minor, nvcc.version,
                             kb.toolkit_lib_dir(nvcc.path), verbose_ptxas=False)
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    # the sidecar kvcore's loader verifies a built library against
    out.with_name(out.name + ".sha256").write_text(hashlib.sha256(out.read_bytes()).hexdigest())
    return out


def run_one(name: str, library: str) -> None:
    """Times every shape with ``library`` as kvio_cuda's kernels (in this process)."""
    import torch
    from kvio_cuda import build as kb
    from probe_signaled_flags import SHAPES, make_case, timed

    kb.library_path = lambda *a, **k: (kb.LibraryChoice(f"probe {name}"), Path(library))
    for kind, layout, layers, heads in SHAPES:
        bound, h, d, src, dst, nbytes = make_case(kind, layout, layers, heads)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            def call() -> None:
                bound.submit(h, d, stream=stream, check=False)
            call()
            ms = timed(call, stream)
            ceil = timed(lambda: dst.copy_(src, non_blocking=True), stream)
        print(f"| {kind} | {layout} | {layers} | {nbytes / 2**20:.0f} | {name} | {ms:.3f} | "
              f"{ceil:.3f} | {ceil / ms:.3f} |", flush=True)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--run":
        run_one(sys.argv[2], sys.argv[3])
        return
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(8) as pool:
        libs = dict(zip(VARIANTS, pool.map(lambda n: build(n, VARIANTS[n], Path(tmp)),
                                           VARIANTS), strict=True))
        print("| kind | layout | layers | MiB | variant | ms/call | ceiling ms | ratio |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
        for name in ORDER:
            subprocess.run([sys.executable, __file__, "--run", name, str(libs[name])],
                           check=True)


if __name__ == "__main__":
    main()
