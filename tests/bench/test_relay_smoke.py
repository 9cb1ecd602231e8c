"""CI smoke of ``rollout-gateway bench relay`` at tiny sizes (real processes, Postgres):
the sides run what they claim (the counter of relay paths says so), and the report
renders with and without its in-process part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.reports.relay_table import relay_markdown

pytestmark = [pytest.mark.postgres, pytest.mark.slow]  # slow: CI time (README)


def _relay(tmp_path: Path, *args: str) -> dict[str, Any]:
    """``bench relay`` at one short round with ``args``: its JSON."""
    out = tmp_path / "relay.json"
    cmd = [sys.executable, "-m", "gateway", "bench", "relay", "--rounds", "1", "--step-s",
           "1", *args, "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_bench_relay_runs_each_side_on_its_own_path(tmp_path: Path) -> None:
    doc = _relay(tmp_path, "--repeats", "1", "--baseline", "HEAD")
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


def test_bench_relay_runs_the_fast_path_on_grouped_events(tmp_path: Path) -> None:
    """``--stream-interval 8``: one more side, the fast path against an upstream that
    groups tokens as vLLM's flag does; its ratio is reported over the fast path."""
    doc = _relay(tmp_path, "--repeats", "0", "--stream-interval", "8")
    e2e = doc["end_to_end"]
    assert e2e["sides"] == ["fast", "general", "grouped"]
    row = e2e["rounds"][0]
    assert all(row["grouped"][n]["errors"] == 0 and row["grouped"][n]["rps"] > 0
               for n in ("100", "1500"))
    assert row["grouped_vs_fast"] == pytest.approx(
        row["grouped"]["us_per_token"] / row["fast"]["us_per_token"])
    assert e2e["relayed_events"]["grouped"]["fast"] > 0
    md = relay_markdown(doc)
    assert "fast path, 8 tokens an event / one token an event" in md
    assert "`--stream-interval 8`" in md
