"""The soak (``-m soak``; also ``rollout-gateway bench soak``): 10 minutes, 200 concurrent
trajectories through a simulated pool. A short smoke run of the same code is in every
CI run so the soak itself cannot rot."""

from __future__ import annotations

import pytest

from bench.runners.soak import SoakConfig, run_soak


@pytest.mark.soak
@pytest.mark.timeout(1200)
async def test_soak_10_minutes_200_trajectories():
    res = await run_soak(SoakConfig(duration_s=600, warmup_s=60, concurrency=200))
    assert res.check() == []
    assert res.calls_ok > 10_000


@pytest.mark.timeout(120)
async def test_soak_smoke():
    res = await run_soak(SoakConfig(duration_s=8, warmup_s=2, concurrency=30,
                                    sample_every_s=1, settle_s=0))
    assert res.calls_failed == 0 and res.calls_ok > 100
    assert res.in_flight_end == 0 and res.backend_in_flight_end == 0
    assert res.live_trajectories_end == 0 and res.trace_dropped == 0
    assert res.tasks_end_idle <= res.tasks_idle
