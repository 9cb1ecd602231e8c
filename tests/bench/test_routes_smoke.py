"""CI smoke of ``rollout-gateway bench routes`` at tiny sizes (real processes, Postgres):
each mode runs, and what the engines were asked matches the mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.postgres, pytest.mark.slow]  # slow: CI time (README)


@pytest.mark.timeout(240)
def test_bench_routes_runs_every_mode(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "gateway", "bench", "routes", "--router", "tiny-moe",
           "--trajectories", "2", "--turns", "3", "--concurrency", "1", "--repeats", "1",
           "--out", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=220, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "routes.json").read_text())
    s = doc["summary"]
    assert {r["mode"] for r in doc["runs"]} == set(s)
    assert all(r["calls"] == 6 and r["latency_ms_p50"] > 0 for r in doc["runs"])
    # asking only new positions returns fewer than asking from 0 every turn
    assert 0 < s["routes"]["route_positions_per_call"] < s["routes-from-0"][
        "route_positions_per_call"]
    # a streamed call on a routed engine costs one routes request; the dense engine is
    # asked once (one client at a time), then known to have none
    assert s["routes-stream"]["engine_requests_per_call"] == 2
    assert s["dense-stream"]["engine_requests_per_call"] == 7 / 6
    assert s["dense"]["engine_requests_per_call"] == 1 == s["routes"]["engine_requests_per_call"]
    assert "| routes-from-0 |" in (tmp_path / "out" / "routes.md").read_text()
