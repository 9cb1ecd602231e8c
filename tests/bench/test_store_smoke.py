"""CI smoke of ``rollout-gateway bench store`` at tiny sizes (real processes, Postgres)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.reports.perf import write_section

pytestmark = pytest.mark.postgres


@pytest.mark.slow  # CI time (README)
@pytest.mark.timeout(180)
def test_store_smoke(tmp_path: Path):
    bench_md = tmp_path / "BENCHMARKS.md"
    bench_md.write_text("# Benchmarks\n\n## bench sim\n\nkept as is\n")
    cmd = [sys.executable, "-m", "gateway", "bench", "store", "--writer-trajectories", "6",
           "--trajectories", "3", "--turns", "3", "--concurrency", "3", "--linear-turns", "2",
           "--linear-turns", "4", "--linear-turns", "8", "--out", str(tmp_path / "out"),
           "--record", str(bench_md), "--routes", "tiny-moe", "--routes-trajectories", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "store.json").read_text())
    for part in ("writer", "end_to_end"):
        r = doc[part]
        assert r["calls"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0
        assert 1 < r["bytes_per_token"] < 100
    assert doc["end_to_end"]["calls"] == 9 and doc["writer"]["calls"] == 18
    lin = doc["linearity"]
    assert [r["turns"] for r in lin["trajectories"]] == [2, 4, 8]
    assert 0.5 < lin["exponent_bytes_vs_tokens"] < 1.5
    assert lin["exponent_full_prompts_vs_tokens"] > lin["exponent_bytes_vs_tokens"]
    routes = doc["routes"]  # tiny-moe: 2 layers x top 2, one byte per id
    assert routes["raw_bytes_per_token"] == 4
    for store in ("files", "database"):  # the ids, and a header per call
        assert len(routes[store]["rate_ratio"]) == 2
        assert 4 <= routes[store]["routes_bytes_per_token"] < 5
    assert set(routes["runs"]) == {"without", "disk", "files", "database"}
    assert all(r["calls"] == 6 for runs in routes["runs"].values() for r in runs)
    assert routes["bound"]["disk_mb_per_s"] > 0 and routes["disk"]["rate_ratio_mean"] > 0
    text = bench_md.read_text()
    assert "## bench sim\n\nkept as is" in text and "## bench store" in text
    assert (tmp_path / "docs" / "benchmarks" / "store" / "store.png").exists()


def test_write_section_replaces_only_its_own(tmp_path: Path):
    md = tmp_path / "B.md"
    md.write_text("# B\n\n## bench sim\n\nS\n\n## bench store\n\nold\n\n## bench live\n\nL\n")
    write_section(md, "bench store", "new")
    assert md.read_text() == "# B\n\n## bench sim\n\nS\n\n## bench store\n\nnew\n\n" \
                             "## bench live\n\nL\n"
    write_section(md, "bench overhead", "O")
    assert md.read_text().endswith("## bench live\n\nL\n\n## bench overhead\n\nO\n")
