"""Whether kvio_rocm can run here, as pure functions over injectable facts.

:func:`gather_facts` collects what matters from torch and the system and never raises;
:func:`probe` turns facts into ``(available, reason)`` with a concrete reason either way.
Tests pass hand-made :class:`RocmFacts` to cover every missing piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RocmFacts", "gather_facts", "probe"]


@dataclass(frozen=True)
class RocmFacts:
    """What the probe decides on.

    ``torch_hip_version``: ``torch.version.hip`` (None on CUDA/CPU builds).
    ``device_count``: AMD GPUs torch sees. ``gcn_arch``: GPU 0's gfx target without feature
    suffixes (``gfx942``), None when unknown. ``compiler``: the HIP compiler found (hipcc or
    ROCm's clang), None when none. ``compiler_targets``: gfx targets that compiler accepts
    (empty when it could not be asked). ``torch_version`` and ``searched`` only feed messages.
    """

    torch_hip_version: str | None
    device_count: int
    gcn_arch: str | None
    compiler: Path | None
    compiler_targets: frozenset[str] | set[str] = field(default_factory=frozenset)
    torch_version: str = "unknown"
    searched: tuple[str, ...] = ()
    rocm_version: str | None = None


def probe(facts: RocmFacts | None = None) -> tuple[bool, str]:
    """``(True, description)`` when kvio_rocm can build and run its kernels on this machine,
    else ``(False, reason)``. ``facts`` default to :func:`gather_facts`. Never raises."""
    if facts is None:
        facts = gather_facts()
    if facts.torch_hip_version is None:
        return False, (f"torch {facts.torch_version} is not a ROCm build "
                       "(torch.version.hip is None)")
    if facts.device_count <= 0:
        return False, (f"no AMD GPU visible (torch {facts.torch_version} with HIP "
                       f"{facts.torch_hip_version} reports 0 devices; check "
                       "HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES and /dev/kfd access)")
    if not facts.gcn_arch:
        return False, ("cannot tell the AMD GPU's gfx target "
                       "(torch.cuda.get_device_properties(0).gcnArchName is empty)")
    arch = facts.gcn_arch
    if facts.compiler is None:
        where = ", ".join(facts.searched) if facts.searched else "the usual ROCm locations"
        return False, (f"no compiler found that targets {arch}: looked for hipcc, amdclang++, "
                       f"clang in {where}")
    targets = frozenset(facts.compiler_targets)
    if targets and arch not in targets:
        near = sorted(t for t in targets if t[:4] == arch[:4]) or sorted(targets)[-8:]
        return False, (f"no compiler found that targets {arch}: {facts.compiler} knows "
                       f"{', '.join(near)} (a newer ROCm is needed for {arch})")
    rocm = f"ROCm {facts.rocm_version}, " if facts.rocm_version else ""
    listed = "" if targets else " (it did not list its targets)"
    gpus = f"{facts.device_count} GPU" + ("s" if facts.device_count != 1 else "")
    return True, (f"{arch}, {gpus}, HIP {facts.torch_hip_version}, {rocm}"
                  f"compiler {facts.compiler}{listed}")


def gather_facts() -> RocmFacts:
    """Collect :class:`RocmFacts` from torch, the environment and the compiler. Never raises:
    whatever cannot be read is left empty (and the probe says so)."""
    torch_version, hip, count, arch = "unknown", None, 0, None
    try:
        import torch

        torch_version = str(torch.__version__)
        hip = getattr(torch.version, "hip", None)
        if hip is not None and torch.cuda.is_available():
            count = int(torch.cuda.device_count())
            if count > 0:
                raw = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") or ""
                from kvio_rocm.build import parse_gcn_arch

                arch = parse_gcn_arch(raw)
    except Exception:  # noqa: BLE001 - the probe must never raise
        pass

    compiler: Path | None = None
    targets: frozenset[str] = frozenset()
    rocm_version: str | None = None
    searched: tuple[str, ...] = ()
    try:
        from kvio_rocm.build import find_toolchain, search_locations

        searched = search_locations()

        tc = find_toolchain()
        compiler, rocm_version = tc.compiler, tc.version
        clang = tc.rocm_root / "llvm" / "bin" / "clang" if tc.rocm_root else None
        argv = [str(clang)] if clang is not None and clang.is_file() else [str(tc.compiler)]
        from kvio_rocm.codegen import supported_gfx_targets

        targets = supported_gfx_targets(argv)
    except Exception:  # noqa: BLE001 - BuildError (nothing found) or anything unexpected
        pass
    return RocmFacts(torch_hip_version=hip, device_count=count, gcn_arch=arch,
                     compiler=compiler, compiler_targets=targets, torch_version=torch_version,
                     searched=searched, rocm_version=rocm_version)
