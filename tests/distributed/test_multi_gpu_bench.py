"""scripts/multi_gpu_bench.py on the CPU: gloo ranks, the reference backend, labelled as such."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "multi_gpu_bench.py"


def test_the_bench_runs_on_cpu_ranks_and_says_its_figures_are_not_gpu_figures(
        tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    env = {**os.environ, "KVCORE_PLUGINS": ""}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--nprocs", "2", "--layers", "2", "--pages", "2",
         "--page-size", "4", "--element-dim", "128", "--warmup", "1", "--repeat", "2",
         "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["world"] == 2 and report["cpu_only"] is True
    assert report["nccl_nvls_enable"] == "0"
    assert {p["backend"] for p in report["plans"].values()} == {"reference"}
    assert report["bytes_per_rank_call"] == 2 * 2 * 2 * 4 * 128 * 2  # kv, L, pages, P, dim, B
    assert [r["what"] for r in report["rows"]] == ["write_back", "load_layer", "d2h copy",
                                                   "h2d copy"]
    for row in report["rows"]:
        assert len(row["alone_gib_s"]) == len(row["together_gib_s"]) == 2
        assert row["aggregate_gib_s"] > 0 and row["n_x_ceiling_gib_s"] > 0
        ceiling = "d2h copy" if row["direction"] == "d2h" else "h2d copy"
        assert row["n_x_ceiling_gib_s"] == sum(
            next(r for r in report["rows"] if r["what"] == ceiling)["alone_gib_s"])
    text = out_md.read_text()
    assert "NOT GPU figures" in text and "NOT GPU figures" in done.stdout
    assert "| write_back |" in text and "| load_layer |" in text
