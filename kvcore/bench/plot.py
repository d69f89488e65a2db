"""GiB/s and ratio against shape, per backend (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kvcore.bench.runner import BenchResult
from kvcore.errors import KVCoreError


class PlotUnavailable(KVCoreError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'kvcore[plot]' (or matplotlib)") from exc
    return plt


def require_matplotlib() -> None:
    """Raise PlotUnavailable now where --plot could not be drawn (before a sweep, not after
    it)."""
    _pyplot()


def plot(result: BenchResult, path: str) -> None:
    """Write a PNG: one column per op, rows GiB/s and ratio, one line per backend/kind/layout.

    The x axis is MiB moved per call (log scale); the ceiling is drawn dashed in the GiB/s row.
    """
    plt = _pyplot()
    from matplotlib import ticker
    rows = [r for r in result.rows if r.timing is not None]
    ops = list(dict.fromkeys(r.case.op.value for r in rows)) or ["(no timed rows)"]
    fig, axes = plt.subplots(2, len(ops), figsize=(5.5 * len(ops), 8), squeeze=False)
    for col, op in enumerate(ops):
        lines: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        ceiling: dict[float, float] = {}
        for r in rows:
            if r.case.op.value != op:
                continue
            mib = r.case.bytes_moved / 2**20
            label = f"{r.backend} {r.case.kind.value}/{r.case.layout.value}"
            lines[label].append((mib, r.gib_s or 0.0, r.ratio or 0.0))
            if r.ceiling_gib_s:
                ceiling[mib] = r.ceiling_gib_s
        top, bottom = axes[0][col], axes[1][col]
        for label, pts in sorted(lines.items()):
            pts.sort()
            xs = [p[0] for p in pts]
            top.plot(xs, [p[1] for p in pts], marker="o", label=label)
            bottom.plot(xs, [p[2] for p in pts], marker="o", label=label)
        if ceiling:
            xs = sorted(ceiling)
            top.plot(xs, [ceiling[x] for x in xs], "k--", label="ceiling (contiguous copy)")
        top.set_title(op)
        top.set_ylabel("GiB/s")
        bottom.set_ylabel("ratio = achieved / ceiling")
        bottom.axhline(1.0, color="grey", linewidth=0.8)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xlabel("MiB per call")
            ax.grid(True, which="both", alpha=0.3)
        top.legend(fontsize="x-small")
    m = result.machine
    fig.suptitle(f"kvio bench on {m.get('gpu') or m.get('cpu')} ({result.settings.get('device')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
