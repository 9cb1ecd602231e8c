"""CI smoke of ``rollout-gateway bench relay`` at tiny sizes (real processes, Postgres):
the sides run what they claim (the counter of relay paths says so), and the report
renders with and without its in-process part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.reports.relay_table import relay_markdown

pytestmark = pytest.mark.postgres


def test_bench_relay_runs_each_side_on_its_own_path(tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    cmd = [sys.executable, "-m", "gateway", "bench", "relay", "--rounds", "1", "--step-s",
           "1", "--repeats", "1", "--baseline", "HEAD", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    reads = doc["in_process"]["reads"]
    assert set(reads) == {"1", "4", "16"}
    assert all(r["us_per_event"]["fast"] > 0 and r["us_per_event"]["general"] > 0
               for r in reads.values())
    e2e = doc["end_to_end"]
    assert e2e["sides"] == ["fast", "general", "baseline"]
    taken = e2e["relayed_events"]
    assert taken["fast"]["fast"] > 10 * taken["fast"].get("general", 0)
    assert "fast" not in taken["general"] and taken["general"]["general"] > 0
    row = e2e["rounds"][0]
    assert all(row[s]["1500"]["errors"] == 0 and row[s]["1500"]["rps"] > 0
               for s in e2e["sides"])
    md = relay_markdown(doc)
    assert "fast / general" in md and "fast / `HEAD`" in md
    doc["in_process"] = None
    assert relay_markdown(doc).startswith("End to end")
