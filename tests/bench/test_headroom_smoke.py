"""CI smoke of ``rollout-gateway bench headroom`` at tiny sizes (real gateway process,
Postgres): the simulated demand counts every call, and one gateway process is driven to
saturation with traces on."""

from __future__ import annotations

import pytest

from bench.runners.headroom import HeadroomOptions, headroom_markdown, run_headroom


@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_headroom_demand_supply_and_projection(tmp_path):
    opts = HeadroomOptions(workloads=["tau"], gpus=2, check_gpus=4, prompts=2,
                           saturation_s=1.5, concurrency=8, pools=[16], out=tmp_path)
    doc = run_headroom(opts, lambda _msg: None, "smoke")
    d = doc["demand"]["tau"]
    assert d["calls"] >= d["trajectories"] == 2 * 8  # at least one call per trajectory
    assert d["start_burst_calls"] >= d["trajectories"]  # every first call is in window one
    assert d["mean_rps_per_gpu"] == pytest.approx(d["calls"] / d["makespan_s"] / 2)
    assert doc["check"]["trajectories"] == 2 * d["trajectories"]
    one = doc["supply"]["120"]
    assert one["achieved_rps"] > 0 and one["errors"] == 0 and one["cpu_ms_per_call"] > 0
    row = doc["pools"]["tau"]["16"]
    assert row["peak_rps"] == pytest.approx(d["peak_rps_per_gpu"] * 16)
    assert row["processes"] >= 1
    sh = doc["sharding"]
    assert sum(sh["per_shard"]) == sh["trajectories"] == 2 * d["trajectories"]
    assert sh["sharded_s"] == max(sh["shard_makespans_s"]) > 0 and sh["ratio"] > 0
    assert "| tau |" in headroom_markdown(doc)
