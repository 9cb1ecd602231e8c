"""The compressed wall clock slowed while it runs, and the demo's governor that slows it."""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.sim.clock import WallClock, release_clock, shared_clock
from bench.harness.governor import Governor


def test_slowing_keeps_simulated_time_continuous_and_never_speeds_up():
    clock = WallClock(20.0)
    before = clock.now()
    clock.slow_to(5.0)
    after = clock.now()
    assert 0 <= after - before < 0.05  # no jump at the change
    t0, w0 = clock.now(), time.monotonic()
    time.sleep(0.05)
    rate = (clock.now() - t0) / (time.monotonic() - w0)
    assert rate == pytest.approx(5.0, rel=0.02)
    with pytest.raises(ValueError, match="only slow down"):
        clock.slow_to(6.0)


async def test_a_sleeper_finishes_its_simulated_time_after_the_clock_slows():
    clock = WallClock(100.0)
    start = clock.now()
    sleeper = asyncio.create_task(clock.sleep(10.0))  # 0.1 s of wall time at 100x
    await asyncio.sleep(0.05)  # half of it gone: 5 simulated seconds
    clock.slow_to(50.0)  # the other 5 now take 0.1 s, not 0.05 s
    w0 = time.monotonic()
    await sleeper
    assert clock.now() - start >= 10.0
    assert time.monotonic() - w0 >= 0.09


def test_servers_naming_a_clock_share_it_until_it_is_released():
    a = shared_clock("test-clock", 10.0)
    assert shared_clock("test-clock", 99.0) is a  # the first speed stands
    release_clock("test-clock")
    assert shared_clock("test-clock", 3.0) is not a
    release_clock("test-clock")


def _governor(speed: float) -> tuple[Governor, list[float]]:
    told: list[float] = []
    return Governor(WallClock(speed), on_speed=told.append), told


def test_the_governor_slows_an_overloaded_host_to_the_pace_it_kept_then_waits():
    gov, told = _governor(20.0)
    # b lost 4 s of 20 while the loop's thread was busy the whole window
    gov.observe({"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 4.0}, sim_s=20.0, busy=1.0)
    assert gov.clock.speed == pytest.approx(20.0 * 0.8 * gov.margin)
    assert told == [gov.clock.speed] and gov.behind_s == pytest.approx(4.0)
    for _ in range(gov.settle):  # the backlog of the old pace drains: counted, not acted on
        gov.observe({"b": 0.0}, {"b": 8.0}, sim_s=10.0, busy=1.0)
    assert len(told) == 1 and gov.behind_s == pytest.approx(4.0 + 8.0 * gov.settle)
    gov.observe({"b": 0.0}, {"b": 9.0}, sim_s=10.0, busy=1.0)  # still behind: at most halved
    assert gov.clock.speed == pytest.approx(told[0] * 0.5 * gov.margin)
    assert "slowed from 20x" in gov.describe()


def test_the_governor_tolerates_small_lag_new_servers_and_bursts():
    gov, told = _governor(20.0)
    gov.observe({"a": 0.0}, {"a": 0.1, "new": 50.0}, sim_s=20.0, busy=1.0)  # 0.5%, new
    # a burst of fixed work: the servers lost 25% but the thread was mostly idle, and a
    # slower clock would not have avoided it
    gov.observe({"a": 0.1}, {"a": 5.1}, sim_s=20.0, busy=0.5)
    assert gov.clock.speed == 20.0 and told == []
    assert gov.behind_s == pytest.approx(5.1)
    assert gov.describe() == "clock kept at 20x"


def test_the_governor_never_goes_below_real_time():
    gov, _ = _governor(1.2)
    gov.observe({"a": 0.0}, {"a": 19.0}, sim_s=20.0, busy=1.0)
    assert gov.clock.speed == 1.0
